"""The O(N) kernels around a loss's logits pass; neither reads a logit.

- ``token_weights_kernel``, before the pass (one program a sequence): the per-token inputs as the loss
  kernels read them (advantages and importance weights given per sequence or per token, written per
  token in fp32), each token's weight in the reduced, scaled loss (``objective.reduction_weights``
  times ``loss_scale``: what the one-pass kernels fold into the gradient they write), each token's
  dLoss/dH of the entropy bonus, and the zero gradient rows of a dropped last position.
- ``loss_metrics_kernel``, after it (one program): the reduced loss, sum over tokens of loss x weight
  (plus entropy x its weight), and the logged metrics, each a mean over the active tokens: the KL, the
  entropy and the clip ratios read from the clip flags.

Why kernels: around the one logits kernel a loss call otherwise runs a dozen small torch ops (a row
sum, a clamp, two divisions, the advantages' expand and copy, a dot, the metrics' gathers, sums and
means), each a dispatch on the host and a launch on the GPU; at small shapes those, not the logits
pass, decide the call's time. Both kernels sum in a fixed order, so the loss and metrics are
deterministic.

A sequence is a row of a padded batch (tokens s T to (s + 1) T) or, with ``cu_seqlens_ptr``, a packed
batch's tokens cu_seqlens[s] to cu_seqlens[s + 1].
"""

from __future__ import annotations

import triton
import triton.language as tl

from .contracts import CLIP_METRICS_NONE, CLIP_METRICS_PPO, DIVISOR_ROW, DIVISOR_SEQUENCE, DIVISOR_TOTAL
from .token_math import C_FLAG_HIGH, C_FLAG_LOW  # the clip flags' bits as the loss kernels write them

# the contracts as the kernels read them (Triton takes module globals only as constexprs)
C_DIVISOR_ROW = tl.constexpr(DIVISOR_ROW)
C_DIVISOR_TOTAL = tl.constexpr(DIVISOR_TOTAL)
C_DIVISOR_SEQUENCE = tl.constexpr(DIVISOR_SEQUENCE)
C_CLIP_METRICS_NONE = tl.constexpr(CLIP_METRICS_NONE)
C_CLIP_METRICS_PPO = tl.constexpr(CLIP_METRICS_PPO)


@triton.jit
def _sum(ptr, start, end, BLOCK: tl.constexpr):
    """The fp32 sum of ptr[start:end], in blocks of BLOCK."""
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for offset in range(start, end, BLOCK):
        index = offset + cols
        acc += tl.load(ptr + index, mask=index < end, other=0.0).to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit
def _copy_per_token(src_ptr, dst_ptr, s, index, inside, PER_ROW: tl.constexpr):
    """dst[index] = src[index] (per token) or src[s] (per sequence), as fp32."""
    if PER_ROW:
        value = tl.zeros(index.shape, tl.float32) + tl.load(src_ptr + s).to(tl.float32)
    else:
        value = tl.load(src_ptr + index, mask=inside, other=0.0).to(tl.float32)
    tl.store(dst_ptr + index, value, mask=inside)


@triton.jit(
    do_not_specialize=[
        "T",
        "S",
        "N",
        "divisor",
        "loss_scale",
        "entropy_coef",
        "dropped_stride_b",
        "dropped_stride_t",
        "V",
    ]
)
def token_weights_kernel(
    mask_ptr,
    cu_seqlens_ptr,
    T,
    S,
    N,
    adv_ptr,
    adv_out,
    iw_ptr,
    iw_out,
    weight_out,
    divisor,
    divisor_ptr,
    loss_scale,
    loss_scale_ptr,
    entropy_weight_out,
    bonus_mask_ptr,
    entropy_coef,
    dropped_ptr,
    dropped_stride_b,
    dropped_stride_t,
    V,
    DIVISOR: tl.constexpr,
    ADV_PER_ROW: tl.constexpr,
    IW_PER_ROW: tl.constexpr,
    ENTROPY_AS_LOSS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Sequence ``program_id`` of the token layout (mask fp32 [N]): what a loss launch reads besides the logits.

    Optional tensors are None where absent, and what they switch on is derived from that at compile time:

    - ``adv_out`` / ``iw_out``: advantages / importance weights, per sequence [S] (``*_PER_ROW``) or per
      token [N], in any float dtype, written per token in fp32.
    - ``weight_out``: each token's weight in the reduced loss, times the loss scale (``loss_scale``, or the
      0-d tensor at ``loss_scale_ptr``): mask / divisor, the divisor by ``DIVISOR`` (``contracts.DIVISOR_*``):
      S x the sequence's active count, the batch's active count (each at least 1), the sequence's own at
      ``divisor_ptr`` [S] (the prompt mean's, at least 1), or ``divisor`` (the 0-d tensor at ``divisor_ptr``,
      where 0 divides as 1: no token is active then, every weight is 0).
    - ``entropy_weight_out``: dLoss/dH of the entropy bonus, -entropy_coef x bonus mask / its count (at
      least 1; ENTROPY_AS_LOSS: / the loss's divisor, which needs ``weight_out``), times the loss scale; the bonus
      mask is ``bonus_mask_ptr`` [N], or the mask.
    - ``dropped_ptr``: a [B, T + 1, V] gradient whose position T the logits pass never writes (the model's
      last position, ``drop_last_position``): sequence s zeroes its row there.
    """
    s = tl.program_id(0)
    if cu_seqlens_ptr is not None:
        start = tl.load(cu_seqlens_ptr + s).to(tl.int64)
        end = tl.load(cu_seqlens_ptr + s + 1).to(tl.int64)
    else:
        start = s.to(tl.int64) * T
        end = start + T
    scale = loss_scale
    if loss_scale_ptr is not None:
        scale = tl.load(loss_scale_ptr).to(tl.float32)
    divided = 1.0
    if weight_out is not None:
        if DIVISOR == C_DIVISOR_ROW:
            divided = S * tl.maximum(_sum(mask_ptr, start, end, BLOCK), 1.0)
        elif DIVISOR == C_DIVISOR_TOTAL:
            divided = tl.maximum(_sum(mask_ptr, 0, N, BLOCK), 1.0)
        elif DIVISOR == C_DIVISOR_SEQUENCE:
            divided = tl.load(divisor_ptr + s).to(tl.float32)
        elif divisor_ptr is not None:
            given = tl.load(divisor_ptr).to(tl.float32)
            divided = tl.where(given == 0.0, 1.0, given)
        else:
            divided = divisor
    bonus_count = 1.0
    if entropy_weight_out is not None:
        if ENTROPY_AS_LOSS:
            bonus_count = divided
        elif bonus_mask_ptr is not None:
            bonus_count = tl.maximum(_sum(bonus_mask_ptr, 0, N, BLOCK), 1.0)
        else:
            bonus_count = tl.maximum(_sum(mask_ptr, 0, N, BLOCK), 1.0)

    cols = tl.arange(0, BLOCK)
    for offset in range(start, end, BLOCK):
        index = offset + cols
        inside = index < end
        if adv_out is not None:
            _copy_per_token(adv_ptr, adv_out, s, index, inside, ADV_PER_ROW)
        if iw_out is not None:
            _copy_per_token(iw_ptr, iw_out, s, index, inside, IW_PER_ROW)
        if weight_out is not None or entropy_weight_out is not None:
            m = tl.load(mask_ptr + index, mask=inside, other=0.0)
            if weight_out is not None:
                tl.store(weight_out + index, m / divided * scale, mask=inside)
            if entropy_weight_out is not None:
                if bonus_mask_ptr is not None:
                    m = tl.load(bonus_mask_ptr + index, mask=inside, other=0.0)
                tl.store(entropy_weight_out + index, -entropy_coef * m / bonus_count * scale, mask=inside)

    if dropped_ptr is not None:
        row = dropped_ptr + s.to(tl.int64) * dropped_stride_b + T.to(tl.int64) * dropped_stride_t
        vocab = tl.arange(0, BLOCK_V)
        zeros = tl.zeros([BLOCK_V], dtype=dropped_ptr.dtype.element_ty)
        for v in range(0, V, BLOCK_V):
            tl.store(row + v + vocab, zeros, mask=v + vocab < V)


@triton.jit(do_not_specialize=["N"])
def loss_metrics_kernel(
    mask_ptr,
    N,
    loss_ptr,
    weight_ptr,
    entropy_ptr,
    entropy_weight_ptr,
    kl_ptr,
    flags_ptr,
    loss_out,
    metrics_out,
    CLIP_METRICS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The reduced loss and the metrics of a loss launch's per-token results (fp32 [N], flags int8 [N]).

    ``loss_out`` (0-d) gets sum(loss x weight) (+ sum(entropy x entropy weight) with ``entropy_weight_ptr``,
    the entropy bonus). ``metrics_out`` gets, in this order and each where present,
    the means over active tokens (sum(x mask) / max(sum(mask), 1), TRL's) of the KL (``kl_ptr``), the entropy
    (``entropy_ptr``) and the clip metrics (``CLIP_METRICS``: low, high and region for PPO-clip; the
    capped share for cispo).
    """
    HAS_KL: tl.constexpr = kl_ptr is not None
    HAS_ENTROPY: tl.constexpr = entropy_ptr is not None
    cols = tl.arange(0, BLOCK)
    loss = tl.zeros([BLOCK], tl.float32)
    count = tl.zeros([BLOCK], tl.float32)
    kl = tl.zeros([BLOCK], tl.float32)
    entropy = tl.zeros([BLOCK], tl.float32)
    low = tl.zeros([BLOCK], tl.float32)
    high = tl.zeros([BLOCK], tl.float32)
    either = tl.zeros([BLOCK], tl.float32)
    for offset in range(0, N, BLOCK):
        index = offset + cols
        inside = index < N
        m = tl.load(mask_ptr + index, mask=inside, other=0.0)
        count += m
        loss += tl.load(loss_ptr + index, mask=inside, other=0.0) * tl.load(weight_ptr + index, mask=inside, other=0.0)
        if entropy_weight_ptr is not None:
            loss += tl.load(entropy_ptr + index, mask=inside, other=0.0) * tl.load(
                entropy_weight_ptr + index, mask=inside, other=0.0
            )
        if HAS_KL:
            kl += tl.load(kl_ptr + index, mask=inside, other=0.0) * m
        if HAS_ENTROPY:
            entropy += tl.load(entropy_ptr + index, mask=inside, other=0.0) * m
        if CLIP_METRICS != C_CLIP_METRICS_NONE:
            flags = tl.load(flags_ptr + index, mask=inside, other=0).to(tl.int32)
            is_high = tl.where((flags & C_FLAG_HIGH) != 0, 1.0, 0.0)
            high += is_high * m
            if CLIP_METRICS == C_CLIP_METRICS_PPO:
                is_low = tl.where((flags & C_FLAG_LOW) != 0, 1.0, 0.0)
                low += is_low * m
                either += tl.maximum(is_low, is_high) * m
    tl.store(loss_out, tl.sum(loss, axis=0))
    active = tl.maximum(tl.sum(count, axis=0), 1.0)
    slot = 0
    if HAS_KL:
        tl.store(metrics_out + slot, tl.sum(kl, axis=0) / active)
        slot += 1
    if HAS_ENTROPY:
        tl.store(metrics_out + slot, tl.sum(entropy, axis=0) / active)
        slot += 1
    if CLIP_METRICS == C_CLIP_METRICS_PPO:
        tl.store(metrics_out + slot, tl.sum(low, axis=0) / active)
        tl.store(metrics_out + slot + 1, tl.sum(high, axis=0) / active)
        tl.store(metrics_out + slot + 2, tl.sum(either, axis=0) / active)
    elif CLIP_METRICS != C_CLIP_METRICS_NONE:
        tl.store(metrics_out + slot, tl.sum(high, axis=0) / active)
