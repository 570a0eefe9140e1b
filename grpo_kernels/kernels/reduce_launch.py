"""Host launchers of the O(N) kernels around a loss's logits pass (``reduce.py``): the per-token inputs and
weights before it, the reduced loss and the metrics after it.

No autograd here: the front end's host functions (``grpo_kernels.from_logits``, ``from_hidden_states``) call these
with plain tensors.
"""

from __future__ import annotations

import torch

from . import reduce
from .contracts import (
    CLIP_METRICS_NONE,
    DIVISOR_GIVEN,
    DIVISOR_SEQUENCE,
    KernelLoss,
    LossTokens,
    Reduction,
    TokenInputs,
    TokenWeights,
)

TOKEN_BLOCK = 1024  # the token-weights kernel's tokens per iteration (4 warps: 8 a thread)
ZERO_BLOCK = 1024  # its vocabulary entries per iteration when it zeroes a dropped position's gradient row
METRICS_BLOCK = 2048  # the loss-metrics kernel's tokens per iteration (8 warps: 8 a thread per array)


def _per_row(name: str, t: torch.Tensor | None, S: int, N: int) -> tuple[torch.Tensor | None, bool]:
    """(the tensor as the kernel reads it, whether it holds one value a sequence): per token ([N] elements,
    as a contiguous [N]) or per sequence ([S] elements)."""
    if t is None:
        return None, False
    numel = t.numel()
    if t.is_contiguous() and (numel == N or numel == S):  # (the common cases first: host time)
        return t, numel != N
    if numel not in (N, S):
        raise ValueError(f"{name} must hold one value a token ({N}) or a sequence ({S}), got shape {tuple(t.shape)}")
    return (t if t.is_contiguous() else t.reshape(-1).contiguous()), numel != N


def fp32_rows(count: int, N: int, device, shape: tuple | None = None) -> tuple:
    """``count`` fp32 [N] tensors as rows of one buffer (one allocation, not ``count``: host time at small N), each
    16-byte aligned whatever N is, as a tensor of its own would be: the JIT specializes pointers on their 16-byte
    alignment, so an N-dependent one would compile other kernels as T changes. With ``shape`` (N elements: the
    ids'), the rows take it where that needs no slice of the buffer (N a multiple of 4), so that a row handed back
    to the caller needs no view either."""
    padded = -(-N // 4) * 4  # (Python ints: triton.cdiv is a constexpr function, slow to call on the host)
    if padded == N:
        return torch.empty(count, *(shape or (N,)), device=device, dtype=torch.float32).unbind()
    return torch.empty(count, padded, device=device, dtype=torch.float32)[:, :N].unbind()


def rows_needed(advantages, importance_weights, reduction: Reduction | None) -> int:
    """How many fp32 [N] rows ``weighted_tokens`` writes (for a caller that allocates them: ``out=``): advantages
    and importance weights per token where given, each token's weight with a reduction, its entropy-bonus weight
    with a coefficient."""
    return (
        (advantages is not None)
        + (importance_weights is not None)
        + (reduction is not None)
        + (reduction is not None and reduction.entropy_coef != 0.0)
    )


def _scalar(value, device) -> tuple[float, torch.Tensor | None]:
    """(a run-time float, a one-element tensor to read instead or None) of a number or 0-d tensor (a loss scale,
    a normalizer) for a kernel on ``device``: a tensor there is read by the kernel (no host sync); a CPU tensor
    with CUDA tensors (torch accepts a CPU 0-d tensor in their arithmetic) is read here, which needs no GPU
    sync; one on another GPU is copied over."""
    if value.__class__ is float:  # (the common case first: host time)
        return value, None
    if not isinstance(value, torch.Tensor):
        return float(value), None
    if value.device == device:
        return 1.0, value
    if value.device.type == "cpu":
        return float(value), None
    return 1.0, value.to(device)


def weighted_tokens(
    loss_tokens: LossTokens, *, dropped_gradient: torch.Tensor | None = None, out: tuple | None = None
) -> tuple[TokenInputs, TokenWeights]:
    """The token-weights kernel on a loss launch's ``LossTokens``: (its per-token inputs as the loss kernels read them,
    advantages and importance weights written per token; the ``TokenWeights``). The mask is fp32, N elements,
    contiguous; advantages / importance weights per token (N elements) or per sequence (S), any float dtype; a
    reduction of None writes no weights. ``dropped_gradient``: a [B, T + 1, V] gradient whose position T is zeroed
    here (the logits pass writes the rest). ``out``: the fp32 [N] rows to write (``rows_needed`` of them), else new
    ones. Written for host time: it runs on every loss call."""
    t, (S, T, cu_seqlens), r = loss_tokens
    mask = t.mask
    N = mask.numel()
    adv, adv_per_row = (None, False) if t.advantages is None else _per_row("advantages", t.advantages, S, N)
    iw, iw_per_row = (
        (None, False) if t.importance_weights is None else _per_row("importance_weights", t.importance_weights, S, N)
    )
    with_bonus = r is not None and r.entropy_coef != 0.0
    rows = iter(out if out is not None else fp32_rows(rows_needed(adv, iw, r), N, mask.device))
    adv_out = None if adv is None else next(rows)
    iw_out = None if iw is None else next(rows)
    weight_out = None if r is None else next(rows)
    entropy_weight_out = next(rows) if with_bonus else None
    weights = TokenWeights(adv_out, iw_out, weight_out, entropy_weight_out)
    tokens = t._replace(advantages=adv_out, importance_weights=iw_out)  # both written per token
    if N == 0:  # no token: empty outputs, and a dropped position zeroed on the host
        if dropped_gradient is not None:
            dropped_gradient[:, -1].zero_()
        return tokens, weights
    divisor, divisor_ptr, scale, scale_ptr = 1.0, None, 1.0, None
    if r is not None:
        if r.divisor_kind == DIVISOR_SEQUENCE:  # one a sequence, fp32 [S], computed on the device
            divisor_ptr = r.divisor
        else:
            divisor, divisor_ptr = _scalar(r.divisor, mask.device)
        scale, scale_ptr = _scalar(r.loss_scale, mask.device)
    divisor = divisor or 1.0  # a normalizer of 0 read on the host (the kernel does the same for a device tensor):
    # no token is active then (validation checks it), every weight is 0, and it divides as 1 so that they stay 0
    dropped = dropped_gradient is not None
    # positional, in the kernel's signature order (reduce.token_weights_kernel): host time
    # (see logits_launch._run_forward)
    reduce.token_weights_kernel[(S,)](
        mask,
        cu_seqlens,
        T,
        S,
        N,
        adv,
        adv_out,
        iw,
        iw_out,
        weight_out,
        divisor,
        divisor_ptr,
        scale,
        scale_ptr,
        entropy_weight_out,
        None if r is None else r.bonus_mask,
        0.0 if r is None else r.entropy_coef,
        dropped_gradient,
        dropped_gradient.stride(0) if dropped else 0,
        dropped_gradient.stride(1) if dropped else 0,
        dropped_gradient.shape[-1] if dropped else 0,
        DIVISOR_GIVEN if r is None else r.divisor_kind,
        adv_per_row,
        iw_per_row,
        r is not None and r.entropy_as_loss,
        TOKEN_BLOCK,
        ZERO_BLOCK,
        num_warps=4,
    )
    return tokens, weights


def reduced(
    mask: torch.Tensor, kernel_loss: KernelLoss, result, weights: TokenWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """``loss_metrics`` of a forward launch's result (``logits_launch.ForwardResult``): (the loss, the metrics)."""
    return loss_metrics(
        mask, kernel_loss, loss=result.loss, entropy=result.entropy, kl=result.kl, flags=result.flags, weights=weights
    )


def loss_metrics(
    mask: torch.Tensor, kernel_loss: KernelLoss, *, loss, entropy, kl, flags, weights: TokenWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the reduced loss, 0-d fp32; the metrics, fp32 [k]: the KL where ``kl`` is given, the entropy where
    ``entropy`` is, then the loss type's clip metrics; ``objective.metric_names`` names them) of a loss launch's
    per-token results (fp32 [N], None where absent; ``flags`` int8 [N]) and its token weights."""
    N = mask.numel()
    clip = kernel_loss.clip_metrics
    count = (kl is not None) + (entropy is not None) + kernel_loss.clip_metric_count
    new = torch.empty if N > 0 else torch.zeros  # no token: a loss and metrics of 0, nothing to launch
    metrics = new(count, device=mask.device, dtype=torch.float32)
    loss_out = new((), device=mask.device, dtype=torch.float32)
    if N == 0:
        return loss_out, metrics
    # positional, in the kernel's signature order (reduce.loss_metrics_kernel): host time
    # (see logits_launch._run_forward)
    reduce.loss_metrics_kernel[(1,)](
        mask,
        N,
        loss,
        weights.weight,
        entropy,
        weights.entropy_weight,
        kl,
        flags if clip != CLIP_METRICS_NONE else None,
        loss_out,
        metrics if count else None,
        clip,
        METRICS_BLOCK,
        num_warps=8,
    )
    return loss_out, metrics
