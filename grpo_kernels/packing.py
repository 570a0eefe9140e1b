"""Which tokens form which sequence: padded [B, T] rows, or a packed batch described by ``cu_seqlens``.

The kernels work per token and never need to know: a packed batch is one row of ``total`` tokens
to them ([1, total, V] logits, a view). Everything that is a sum or mean over a sequence (the
reductions, GSPO's sequence ratio, VESPO's weight, the off-policy mask, per-row metrics) runs on
the sequence layout [S, T_max], built from the per-token values by a gather (O(total), no logits),
so a packed batch gives exactly what the padded layout gives for the same sequences.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .kernels.contracts import Sequences
from .objective import as_row_column
from .validation import check_logits


class SequenceLayout:
    """The map between the token layout (what the kernels read: [B * T] or [total]) and the sequence
    layout ([B, T] or [S, T_max], 0 where a sequence has no token)."""

    def __init__(self, B: int, T: int, cu_seqlens: Optional[torch.Tensor] = None):
        self.packed = cu_seqlens is not None
        if not self.packed:
            self.S, self.T_max, self.N = B, T, B * T
            self.sequences = Sequences(B, T)
            return
        starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        self.S, self.N = lengths.numel(), int(cu_seqlens[-1])
        self.T_max = int(lengths.max()) if self.S else 0  # the one host sync of a packed call
        steps = torch.arange(self.T_max, device=cu_seqlens.device)
        self.valid = steps < lengths.unsqueeze(1)  # [S, T_max]
        self.index = torch.where(self.valid, starts.unsqueeze(1) + steps, 0)  # token of each (sequence, step)
        self.sequence_of_token = torch.repeat_interleave(torch.arange(self.S, device=cu_seqlens.device), lengths,
                                                         output_size=self.N)
        self.sequences = Sequences(self.S, self.T_max, cu_seqlens)  # as the token-weights kernel reads them

    def token_layout(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A per-token or per-sequence tensor as the token-weights kernel reads it: a packed batch's sequence
        layout [S, T_max] taken back to its tokens, anything else as it is (N elements a token, or S a
        sequence: the padded sequence layout is the token layout)."""
        if t is not None and self.packed and self._is_seq_layout(t):
            return self.from_seq(t)
        return t

    def tokens(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A per-token or per-sequence input as the kernels read it: contiguous fp32 [N]."""
        if t is None:
            return None
        t = t.float()  # (not detached: the kernels read it inside a Function, where no gradient can reach it)
        if not self.packed:
            if tuple(t.shape) == (self.S, self.T_max):  # per token already: a view where it can be one
                return t.reshape(-1).contiguous()
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

    def one_row(self, name: str, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """A packed call's per-token input, checked, as one row [1, total]."""
        if t is None:
            return None
        total = self.N
        if not isinstance(t, torch.Tensor) or t.numel() != total or t.dim() not in (1, 2) or t.shape[-1] != total:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} of a packed batch must be [total] or [1, total] with total = {total}, got {got}")
        return t.reshape(1, total)

    def check_per_sequence_or_token(self, name: str, t: Optional[torch.Tensor]) -> None:
        """A packed call's advantages or importance weights: per sequence [S] / [S, 1], or per token."""
        if t is None:
            return
        per_sequence = isinstance(t, torch.Tensor) and t.dim() in (1, 2) and t.numel() == self.S and \
            (t.dim() == 1 or t.shape[1] == 1)
        if not per_sequence:
            self.one_row(f"{name} (per token; or per sequence [S] = [{self.S}])", t)
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def packed_layout(cu_seqlens, source: torch.Tensor, what: str) -> Tuple[SequenceLayout, torch.Tensor]:
    """Check a packed call's ``cu_seqlens`` and its logits or hidden states (``what``) [total, last] or
    [1, total, last]: (its layout, the source as one row [1, total, last], a view)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or \
            cu_seqlens.dtype not in (torch.int32, torch.int64):
        got = (f"shape {tuple(cu_seqlens.shape)}, dtype {cu_seqlens.dtype}" if isinstance(cu_seqlens, torch.Tensor)
               else type(cu_seqlens).__name__)
        raise ValueError(f"cu_seqlens must be an int32 / int64 tensor [S + 1] (flash-attention's convention), "
                         f"got {got}")
    if what == "logits":
        check_logits(source if source.dim() == 3 else source.unsqueeze(0))
    if not isinstance(source, torch.Tensor) or source.dim() not in (2, 3) or (
            source.dim() == 3 and source.shape[0] != 1):
        got = tuple(source.shape) if isinstance(source, torch.Tensor) else type(source).__name__
        last = "V" if what == "logits" else "H"
        raise ValueError(f"packed {what} must be [total, {last}] or [1, total, {last}], got {got}")
    one_row = source if source.dim() == 3 else source.unsqueeze(0)
    total = one_row.shape[1]
    if cu_seqlens.device != source.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but {what} is on {source.device}")
    bounds = cu_seqlens.detach().cpu()
    if int(bounds[0]) != 0 or int(bounds[-1]) != total or bool((bounds[1:] < bounds[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the packed token count {total}, "
                         f"got {bounds.tolist()[:8]}{' ...' if bounds.numel() > 8 else ''}")
    return SequenceLayout(1, total, cu_seqlens), one_row
