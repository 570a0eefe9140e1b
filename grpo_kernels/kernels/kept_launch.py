"""Host launchers of the kept set's kernels (``kept.py``): a program a token, plain tensors in and out.

``kept_state`` / ``linear_kept_state`` return each entry's x and the [7, N] per-token state the host finishes
(``grpo_kernels.kept_set.finish``); ``kept_gradient`` writes the set's entries into a gradient whose dense part the
logits kernels (or the fused head's dlogits kernel) wrote.
"""

from __future__ import annotations

import torch
import triton

from . import kept
from .contracts import KeptTerms, KeptTokens, fp32_products, rounds_head_logits

STATE_ROWS = 7  # max, sum, sum x, sum of squares, entries here, target found here, target x


def _entry_x(kept_tokens: KeptTokens, device) -> torch.Tensor:
    """Each entry's x, fp32, shaped as the set's ids (CSR [nnz], padded [N, width]); -inf where the kernel reads no
    logit (a masked token's entries)."""
    return torch.full(kept_tokens.ids.shape, float("-inf"), device=device, dtype=torch.float32)


def kept_state(
    logits: torch.Tensor,
    ids: torch.Tensor,
    kept_tokens: KeptTokens,
    *,
    temperature: float,
    softcap: float | None,
    mask: torch.Tensor | None = None,
    col0: int = 0,
    compute_entropy: bool = False,
    compute_sum_squares: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each entry's x, the [7, N] state) of logits [B, T, V] (a unit last stride; V of them a vocabulary slice from
    global id ``col0``) for ids [B, T] (global) and their sets."""
    (B, T), V = ids.shape, logits.shape[-1]
    args = (logits, logits.stride(0), logits.stride(1), T, None, None, None, 0)
    return _state(args, B * T, V, ids, kept_tokens, temperature, softcap, mask, col0, compute_entropy,
                  compute_sum_squares, logits.device, round_logits=False, block_h=16)  # fmt: skip


@fp32_products
def linear_kept_state(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    kept_tokens: KeptTokens,
    *,
    temperature: float,
    softcap: float | None,
    mask: torch.Tensor | None = None,
    col0: int = 0,
    compute_entropy: bool = False,
    compute_sum_squares: bool = False,
    fp32_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kept_state`` from hidden states [N, H] and the lm_head weight [V, H] (a vocabulary slice from ``col0``) and
    bias [V] or None: each entry's logit its own dot product, rounded as the head rounds its logits (unrounded with
    ``fp32_logits``)."""
    N, H = hidden.shape
    args = (None, 0, 0, 1, hidden, weight, bias, H)
    # a [64, 64] tile of gathered weight rows over 8 warps: no spill on any target (tools/aot.py)
    return _state(args, N, weight.shape[0], ids, kept_tokens, temperature, softcap, mask, col0, compute_entropy,
                  compute_sum_squares, hidden.device, round_logits=rounds_head_logits(hidden.dtype, fp32_logits),
                  block_h=min(64, triton.next_power_of_2(max(H, 16))), num_warps=8)  # fmt: skip


def _state(source_args, N, width, ids, kept_tokens, temperature, softcap, mask, col0, compute_entropy,
           compute_sum_squares, device, *, round_logits, block_h, num_warps=4):  # fmt: skip
    """The one launch of ``kept.kept_state_kernel`` behind both launchers (``source_args``: the logits' or the
    head's arguments, the other's None)."""
    x = _entry_x(kept_tokens, device)
    state = torch.zeros(STATE_ROWS, N, device=device, dtype=torch.float32)
    if N > 0:
        kept.kept_state_kernel[(N,)](
            *source_args,
            N,
            ids,
            mask,
            kept_tokens.ids,
            kept_tokens.offsets,
            x,
            state,
            col0,
            width,
            1.0 / temperature,
            None if softcap is None else float(softcap),
            WIDTH=kept_tokens.width,
            COMPUTE_ENTROPY=compute_entropy,
            COMPUTE_SUMSQ=compute_sum_squares,
            ROUND_LOGITS=round_logits,
            BLOCK_H=block_h,
            num_warps=num_warps,
        )
    return x, state


def kept_gradient(
    out: torch.Tensor,
    ids: torch.Tensor,
    kept_tokens: KeptTokens,
    terms: KeptTerms,
    g: torch.Tensor,
    *,
    temperature: float,
    softcap: float | None,
    h: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    col0: int = 0,
    n0: int = 0,
    lead: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the set's entries of ``out`` (the gradient of the logits, [B, T, width] with a unit last stride, or a
    [rows, width] workspace of the tokens from ``n0``; its columns global ids from ``col0``) over its dense part:
    (g (onehot - q) + the entropy terms) / tau at each entry (``kept._entry_gradient``), for the tokens whose set is
    used. ``g``, ``h`` (the entropy bonus's dLoss/dH, or None), ``lse`` and ``entropy`` (the full distribution's) are
    fp32, one per row of ``out``; ``ids`` the targets [N] and ``terms`` over every token. ``lead`` (fp32, one an entry):
    each entry's gradient is (lead - g q) / tau instead (``kept._entry_gradient``: the top-k distillation's entries)."""
    if out.dim() == 2:
        rows, stride_b, stride_t, T = out.shape[0], out.stride(0), 0, 1
    else:
        rows, stride_b, stride_t, T = out.shape[0] * out.shape[1], out.stride(0), out.stride(1), out.shape[1]
    if rows == 0:
        return out
    kept.kept_gradient_kernel[(rows,)](
        out,
        stride_b,
        stride_t,
        T,
        n0,
        ids,
        kept_tokens.ids,
        kept_tokens.offsets,
        terms.x,
        terms.lse,
        terms.target_x,
        terms.found,
        g,
        h,
        lse,
        entropy,
        terms.entropy,
        lead,
        col0,
        out.shape[-1],
        1.0 / temperature,
        None if softcap is None else float(softcap),
        WIDTH=kept_tokens.width,
        ADD_TARGET=kept_tokens.add_target,
        KEPT_ENTROPY=kept_tokens.entropy_over_set,
    )
    return out
