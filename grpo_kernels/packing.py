"""Which tokens form which sequence: padded [B, T] rows, or a packed batch described by ``cu_seqlens``.

The kernels work per token and never need to know: a packed batch is one row of ``total`` tokens
to them ([1, total, V] logits, a view). Everything that is a sum or mean over a sequence (the
reductions, GSPO's sequence ratio, VESPO's weight, the off-policy mask, per-row metrics) runs on
the sequence layout [S, T_max], built from the per-token values by a gather (O(total), no logits),
so a packed batch gives exactly what the padded layout gives for the same sequences.
"""

from __future__ import annotations

from typing import Optional

import torch

from .objective import as_row_column


class Rows:
    """The map between the token layout (what the kernels read: [B * T] or [total]) and the sequence
    layout ([B, T] or [S, T_max], 0 where a sequence has no token)."""

    def __init__(self, B: int, T: int, cu_seqlens: Optional[torch.Tensor] = None):
        self.packed = cu_seqlens is not None
        if not self.packed:
            self.S, self.T_max, self.N = B, T, B * T
            return
        starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        self.S, self.N = lengths.numel(), int(cu_seqlens[-1])
        self.T_max = int(lengths.max()) if self.S else 0  # the one host sync of a packed call
        steps = torch.arange(self.T_max, device=cu_seqlens.device)
        self.valid = steps < lengths.unsqueeze(1)  # [S, T_max]
        self.index = torch.where(self.valid, starts.unsqueeze(1) + steps, 0)  # token of each (sequence, step)
        self.sequence_of_token = torch.repeat_interleave(torch.arange(self.S, device=cu_seqlens.device), lengths,
                                                         output_size=self.N)

    def tokens(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A per-token or per-sequence input as the kernels read it: contiguous fp32 [N]."""
        if t is None:
            return None
        t = t.detach().float()
        if not self.packed:
            return as_row_column(t).expand(self.S, self.T_max).reshape(-1).contiguous()
        if self._is_seq_layout(t):
            return self.from_seq(t).contiguous()
        if t.numel() == self.N and (t.dim() == 1 or t.shape[-1] == self.N):  # per token
            return t.reshape(-1).contiguous()
        return t.reshape(-1)[self.sequence_of_token].contiguous()  # per sequence: [S] or [S, 1]

    def _is_seq_layout(self, t: torch.Tensor) -> bool:
        return t.dim() == 2 and tuple(t.shape) == (self.S, self.T_max) and not (self.S == 1 and self.T_max == self.N)

    def seq(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A per-token ([N], [1, N], padded [B, T]) or per-sequence tensor in the sequence layout:
        [S, T_max] (0 where there is no token) or [S, 1]; differentiable."""
        if t is None or not self.packed:
            return None if t is None else as_row_column(t)
        if self._is_seq_layout(t) or (t.dim() == 2 and t.shape[1] == 1 and t.shape[0] == self.S):
            return t  # already in the sequence layout
        if t.numel() == self.N and (t.dim() == 1 or t.shape[-1] == self.N):
            return torch.where(self.valid, t.reshape(-1)[self.index], 0.0)
        return t.reshape(self.S, 1)

    def from_seq(self, t: torch.Tensor) -> torch.Tensor:
        """A sequence-layout [S, T_max] tensor back in the token layout, [N]."""
        return t.reshape(-1) if not self.packed else t[self.valid]
