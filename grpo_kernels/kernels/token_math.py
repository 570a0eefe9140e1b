"""The Triton functions every kernel file shares: the host's contracts as constexprs, the logit's head transform
(base 2, the soft-cap and its chain factor), the online log-sum-exp fold of a row's lanes, and the per-token loss
math of every loss type with its derivative dLoss/dlogp (``token_loss_and_grad``: one formula, which the logits
kernels (``logits.py``), the split-row kernels (``split_row.py``) and the lm_head kernels (``fused_linear.py``) all
call, so that the loss is written once on the device).

Conventions the kernels keep:
- The head's soft-cap (``softcap``, None on most models): the kernels read raw logits x and compute
  log softmax(cap(x) / tau) with cap(x) = softcap * tanh(x / softcap) (Gemma's ``final_logit_softcapping``;
  the front end folds a head's scale into tau and softcap). None compiles the cap out: the hot loops of
  an uncapped head are unchanged, instruction for instruction. The gradient carries the cap's chain
  factor, 1 - tanh^2.
- Everything that can change between steps is a run-time argument and is excluded from Triton's integer
  specialization (``RUNTIME_INTS``), so a loop that changes T, beta, the epsilons or the temperature never
  recompiles. Constexprs only say which optional features are present.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

# The host's values and the flag bits, named in one place (triton-free, for the front end).
from .contracts import (
    FLAG_HIGH_CLIPPED,
    FLAG_LOW_CLIPPED,
    KL_K1,
    KL_K3,
    LOSS_CISPO,
    LOSS_FLAG_BIAS_CORRECTION_KL,
    LOSS_FLAG_DELTA,
    LOSS_FLAG_DUAL_CLIP,
    LOSS_FLAG_KL_CLAMP,
    LOSS_FLAG_KL_STRAIGHT_THROUGH,
    LOSS_FLAG_LOG_RATIO_CLAMP,
    LOSS_NONE,
    LOSS_PPO_CLIP,
)
from .logsumexp import rescale_lse

# The same contracts as the kernels read them: Triton takes module globals only as constexprs.
C_LOSS_NONE = tl.constexpr(LOSS_NONE)
C_LOSS_PPO_CLIP = tl.constexpr(LOSS_PPO_CLIP)
C_LOSS_CISPO = tl.constexpr(LOSS_CISPO)
C_KL_K3 = tl.constexpr(KL_K3)
C_KL_K1 = tl.constexpr(KL_K1)
C_FLAG_LOW = tl.constexpr(FLAG_LOW_CLIPPED)
C_FLAG_HIGH = tl.constexpr(FLAG_HIGH_CLIPPED)
C_LOSS_FLAG_DELTA = tl.constexpr(LOSS_FLAG_DELTA)
C_LOSS_FLAG_DUAL_CLIP = tl.constexpr(LOSS_FLAG_DUAL_CLIP)
C_LOSS_FLAG_LOG_RATIO_CLAMP = tl.constexpr(LOSS_FLAG_LOG_RATIO_CLAMP)
C_LOSS_FLAG_KL_CLAMP = tl.constexpr(LOSS_FLAG_KL_CLAMP)
C_LOSS_FLAG_BIAS_CORRECTION_KL = tl.constexpr(LOSS_FLAG_BIAS_CORRECTION_KL)
C_LOSS_FLAG_KL_STRAIGHT_THROUGH = tl.constexpr(LOSS_FLAG_KL_STRAIGHT_THROUGH)

RUNTIME_INTS = ["T", "V", "N", "stride_b", "stride_t", "grad_stride_b", "grad_stride_t"]

# The loss math's min / max / clamp propagate NaN as torch's do: Triton's default drops it
# (min(NaN, y) = y), which would turn a NaN log-prob into a finite, wrong loss.
NAN = tl.constexpr(tl.PropagateNan.ALL)


@triton.jit
def row_pointer(base_ptr, pid, T, stride_b, stride_t, ROW_ALIGN: tl.constexpr):
    """Pointer to the first logit of flat token ``pid`` of a [B, T, V] tensor.

    ROW_ALIGN: the launcher's promise that every row starts at a multiple of this many
    elements (16 bytes' worth when the strides allow, else 1); with 16 bytes the compiler
    can issue 128-bit vector loads and stores.
    """
    b = pid // T
    t = pid - b * T
    return base_ptr + tl.multiple_of(b * stride_b + t * stride_t, ROW_ALIGN)


# The row loops work in base 2: x2 = logit * inv_temperature * log2(e), one multiply per logit
# before exp2. A finite floor stands in for -inf as the running max, so that a -inf logit (a
# masked-out vocabulary entry) never meets -inf - (-inf).
LOG2E = tl.constexpr(1.4426950408889634)
# The soft-cap's division compiled as div.approx.f32 (libdevice's fast_dividef: a MUFU.RCP and a multiply, 2 ulp;
# IEEE-correct '/' costs about 3 more instructions a logit for its range check on sm_90); Triton's interpreter has no
# libdevice, and divides exactly
APPROX_DIVISION = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")
LN2 = tl.constexpr(0.6931471805599453)
FLOOR = tl.constexpr(-1.0e30)


@triton.jit
def base2_logit(x, c, softcap):
    """A raw logit x (any dtype) as the row loops read it, fp32 in base 2 (c = log2(e) / tau): x c, or under the
    head's soft-cap softcap tanh(x / softcap) c, computed as 2 softcap c / (1 + e^(-2 x / softcap)) - softcap c
    (tanh y = 2 / (1 + e^(-2y)) - 1): one exp2 and one fast division (``APPROX_DIVISION``) a logit, the scalars
    hoisted out of the loops. ``softcap`` None is decided at compile time: one multiply, as without a cap. A capped
    logit is finite (+-softcap c at x = +-inf; NaN stays NaN); on a GPU, ex2.approx and the division (2 ulp each)
    make its error a few ulps of the cap."""
    x = x.to(tl.float32)
    if softcap is not None:
        denominator = 1.0 + tl.exp2(x * (-2.0 * LOG2E / softcap))
        if APPROX_DIVISION:
            return libdevice.fast_dividef(2.0 * softcap * c, denominator) - softcap * c
        return (2.0 * softcap * c) / denominator - softcap * c
    return x * c


@triton.jit
def capped_logit(x, softcap):
    """A raw logit as the model's head returns it, fp32: softcap * tanh(x / softcap), or x itself where ``softcap``
    is None (``base2_logit`` in natural units)."""
    return base2_logit(x, 1.0, softcap)


@triton.jit
def cap_slope(x2, c, softcap):
    """d capped / dx = 1 - tanh^2(x / softcap), from the capped logit x2 in the units of c (``base2_logit``):
    tanh = x2 / (softcap c). The gradient's chain factor under a soft-cap."""
    t = x2 * (1.0 / (softcap * c))
    return 1.0 - t * t


@triton.jit
def chained(grad, x2, c, softcap):
    """A gradient with respect to the capped logit taken to the raw one: times ``cap_slope`` under a soft-cap, else
    itself (no instruction)."""
    if softcap is not None:
        grad = grad * cap_slope(x2, c, softcap)
    return grad


@triton.jit
def padded_base2_logit(x, in_row, c, softcap):
    """``base2_logit`` of a masked load whose lanes past the row hold -inf: they stay -inf (they add nothing), where
    a cap would make them finite."""
    x2 = base2_logit(x, c, softcap)
    if softcap is not None:
        x2 = tl.where(in_row, x2, float("-inf"))
    return x2


@triton.jit
def lse_fold(x2, m, s, t, COMPUTE_ENTROPY: tl.constexpr):
    """``lse_fold_sums`` without the sum of squares (the split-row chunks' fold)."""
    m, s, t, _ = lse_fold_sums(x2, m, s, t, 0.0, COMPUTE_ENTROPY, False)
    return m, s, t


@triton.jit
def lse_fold_sums(x2, m, s, t, q, COMPUTE_ENTROPY: tl.constexpr, COMPUTE_SUMSQ: tl.constexpr):
    """Fold one block of base-2 logits into each lane's running max m, sum s = sum 2^(x - m),
    t = sum 2^(x - m) * x (the entropy's) and q = sum 2^(2 (x - m)) (the squared probabilities', Σπ²),
    with one exp2 a logit and no cross-lane reduction.

    2^-|x - m| is at once the rescale of s when x is the lane's new max and x's own term when it
    is not (its square the same for q: one multiply more); the lanes are combined once per row, after the loop
    (``lse_finish``).
    """
    d = x2 - m
    e = tl.exp2(-tl.abs(d))
    bigger = d > 0.0
    s = tl.where(bigger, s * e + 1.0, s + e)
    if COMPUTE_ENTROPY:
        t = tl.where(bigger, t * e + x2, t + e * x2)
    if COMPUTE_SUMSQ:
        ee = e * e
        q = tl.where(bigger, q * ee + 1.0, q + ee)
    return tl.maximum(m, x2), s, t, q


@triton.jit
def lse_finish(m, s, t, q, COMPUTE_ENTROPY: tl.constexpr, COMPUTE_SUMSQ: tl.constexpr):
    """(log-sum-exp in base 2, entropy in nats, sum of squared probabilities) of a row from its lanes' (m, s, t, q):
    every lane's sums are rescaled to the row's max (finite: the lanes start at FLOOR), then added."""
    row_max = tl.max(m, axis=0)
    if COMPUTE_SUMSQ:
        q = q * tl.exp2(2.0 * (m - row_max))
    s, t = rescale_lse(m, s, t, row_max, COMPUTE_ENTROPY, BASE2=True)
    sum_exp = tl.sum(s, axis=0)
    lse2 = row_max + tl.log2(sum_exp)
    entropy = 0.0
    if COMPUTE_ENTROPY:
        entropy = LN2 * (lse2 - tl.sum(t, axis=0) / sum_exp)
    sum_squares = 0.0
    if COMPUTE_SUMSQ:
        sum_squares = tl.sum(q, axis=0) / (sum_exp * sum_exp)
    return lse2, entropy, sum_squares


@triton.jit
def _clamp_with_grad(x, lo, hi):
    """torch.clamp and its derivative (1 inside [lo, hi], boundaries included, else 0); NaN stays NaN."""
    inside = (x >= lo) & (x <= hi)
    return tl.minimum(tl.maximum(x, lo, propagate_nan=NAN), hi, propagate_nan=NAN), tl.where(inside, 1.0, 0.0)


@triton.jit
def _min_with_grad(a, da, b, db):
    """torch.minimum and its derivative: the smaller side's, split evenly on a tie."""
    value = tl.minimum(a, b, propagate_nan=NAN)
    grad = tl.where(a < b, da, tl.where(a > b, db, 0.5 * (da + db)))
    return value, grad


@triton.jit
def _kl_with_grad(
    logp,
    ref,
    log_ratio_clamp,
    kl_clamp,
    KL_KIND: tl.constexpr,
    HAS_LOG_RATIO_CLAMP: tl.constexpr,
    HAS_KL_CLAMP: tl.constexpr,
):
    """Per-token KL estimate and its derivative with respect to logp."""
    if KL_KIND == C_KL_K3:  # exp(x) - x - 1 with x = ref - logp
        x = ref - logp
        dx = -1.0
        if HAS_LOG_RATIO_CLAMP:
            x, inside = _clamp_with_grad(x, -log_ratio_clamp, log_ratio_clamp)
            dx = -inside
        ex = tl.exp(x)
        kl = ex - x - 1.0
        dkl = (ex - 1.0) * dx
    elif KL_KIND == C_KL_K1:  # logp - ref
        kl = logp - ref
        dkl = tl.full(kl.shape, 1.0, tl.float32)
    else:  # k2: (logp - ref)^2 / 2
        diff = logp - ref
        kl = 0.5 * diff * diff
        dkl = diff
    if HAS_KL_CLAMP:
        kl, inside = _clamp_with_grad(kl, -kl_clamp, kl_clamp)
        dkl = dkl * inside
    return kl, dkl


@triton.jit
def token_loss_and_grad(
    logp,
    adv,
    old,
    ref,
    iw,
    loss_scalars,
    LOSS_KIND: tl.constexpr,
    KL_KIND: tl.constexpr,
    LOSS_FLAGS: tl.constexpr,
):
    """The per-token loss of one loss_type, its derivative with respect to logp, the KL and the clip flags.

    Element-wise: ``logp`` and the per-token inputs may be scalars (the logits kernel, one
    token per program) or [BLOCK_N] vectors (the fused lm_head kernel). ``old``, ``ref``
    and ``iw`` are None where absent (on-policy, no KL term, no importance weights): what
    they switch on is decided at compile time. ``loss_scalars`` is the kernels' run-time
    tuple in ``contracts.LOSS_SCALARS`` order (the host's ``options._kernel_loss``). The optional
    features are one integer constexpr, ``LOSS_FLAGS`` (``contracts.LOSS_FLAG_*`` bits), decoded here into
    compile-time flags: an integer folds at compile time, where a tuple of flags passed to a jit function
    carries run-time values only (tried on triton 3.6 and 3.9: its flags compiled as run-time ifs). The bit is
    on the left of ``&``: the interpreter passes a constexpr parameter as a plain int.
    Returns (loss, dloss_dlogp, kl, flags); kl is 0 without KL, flags holds the
    FLAG_LOW_CLIPPED / FLAG_HIGH_CLIPPED bits.
    """
    eps_low, eps_high, delta, dual_clip, beta, log_ratio_clamp, kl_clamp, sapo_tau_pos, sapo_tau_neg = loss_scalars
    HAS_DELTA: tl.constexpr = (C_LOSS_FLAG_DELTA & LOSS_FLAGS) != 0
    HAS_DUAL_CLIP: tl.constexpr = (C_LOSS_FLAG_DUAL_CLIP & LOSS_FLAGS) != 0
    HAS_LOG_RATIO_CLAMP: tl.constexpr = (C_LOSS_FLAG_LOG_RATIO_CLAMP & LOSS_FLAGS) != 0
    HAS_KL_CLAMP: tl.constexpr = (C_LOSS_FLAG_KL_CLAMP & LOSS_FLAGS) != 0
    BIAS_CORRECTION_KL: tl.constexpr = (C_LOSS_FLAG_BIAS_CORRECTION_KL & LOSS_FLAGS) != 0
    KL_STRAIGHT_THROUGH: tl.constexpr = (C_LOSS_FLAG_KL_STRAIGHT_THROUGH & LOSS_FLAGS) != 0
    HAS_OLD: tl.constexpr = old is not None
    HAS_KL: tl.constexpr = ref is not None
    HAS_IW: tl.constexpr = iw is not None
    # Importance ratio coef_1 = exp(logp - old); on-policy (no old) it is exactly 1
    # while its derivative, coef_1 itself, still flows (TRL's logp.detach()).
    # Zeros and ones are built with tl.full, never as 0.0 * logp: a -inf target log-prob
    # (a vocabulary entry masked to -inf) would make those NaN.
    zero = tl.full(logp.shape, 0.0, tl.float32)
    if HAS_OLD:
        log_ratio = logp - old
    else:
        log_ratio = zero
    dlog_ratio = zero + 1.0
    if HAS_LOG_RATIO_CLAMP:
        log_ratio, dlog_ratio = _clamp_with_grad(log_ratio, -log_ratio_clamp, log_ratio_clamp)
    coef_1 = tl.exp(log_ratio)
    dcoef_1 = coef_1 * dlog_ratio

    flags = zero.to(tl.int32)
    if LOSS_KIND == C_LOSS_PPO_CLIP:  # -min(coef_1 * A, clamp(coef_1, 1 - el, 1 + eh) * A)
        coef_2, inside = _clamp_with_grad(coef_1, 1.0 - eps_low, 1.0 + eps_high)
        dcoef_2 = dcoef_1 * inside
        if HAS_DELTA:  # TRL's cap on the unclipped branch (it also feeds the clip metrics)
            coef_1, below = _clamp_with_grad(coef_1, float("-inf"), delta)
            dcoef_1 = dcoef_1 * below
        neg_policy, neg_dpolicy = _min_with_grad(coef_1 * adv, dcoef_1 * adv, coef_2 * adv, dcoef_2 * adv)
        policy = -neg_policy
        dpolicy = -neg_dpolicy
        if HAS_DUAL_CLIP:  # for A < 0 the loss is at most -A * c
            bounded, dbounded = _min_with_grad(-adv * dual_clip, 0.0, policy, dpolicy)
            policy = tl.where(adv < 0.0, bounded, policy)
            dpolicy = tl.where(adv < 0.0, dbounded, dpolicy)
        flags = tl.where((coef_1 < 1.0 - eps_low) & (adv < 0.0), C_FLAG_LOW, 0)
        flags += tl.where((coef_1 > 1.0 + eps_high) & (adv > 0.0), C_FLAG_HIGH, 0)
    elif LOSS_KIND == C_LOSS_CISPO:  # -stopgrad(min(coef_1, eh)) * A * logp
        capped = tl.minimum(coef_1, eps_high, propagate_nan=NAN)
        # At a -inf logp the ratio is 0 and the term's limit (ratio * logp -> 0) is 0, not 0 * -inf.
        policy = tl.where(capped == 0.0, 0.0, -capped * adv * logp)
        dpolicy = -capped * adv
        flags = tl.where((coef_1 > eps_high) & (adv > 0.0), C_FLAG_HIGH, 0)
    else:  # SAPO: -sigmoid(tau * (coef_1 - 1)) * 4 / tau * A
        tau = tl.where(adv > 0.0, sapo_tau_pos, sapo_tau_neg)
        soft = tl.sigmoid(tau * (coef_1 - 1.0))
        policy = -soft * 4.0 / tau * adv
        dpolicy = -4.0 * soft * (1.0 - soft) * adv * dcoef_1

    if HAS_IW:  # rollout correction multiplies the policy term, never the KL
        policy = policy * iw
        dpolicy = dpolicy * iw
    loss = policy
    dloss = dpolicy
    kl = zero
    if HAS_KL:
        kl, dkl = _kl_with_grad(logp, ref, log_ratio_clamp, kl_clamp, KL_KIND, HAS_LOG_RATIO_CLAMP, HAS_KL_CLAMP)
        if KL_STRAIGHT_THROUGH:  # the estimate's value, k2's gradient (the KL's own in expectation), unclamped
            dkl = logp - ref
        if BIAS_CORRECTION_KL:  # KL * coef_1 (the ratio before delta's cap, as in TRL)
            coef_1_kl = tl.exp(log_ratio)
            dkl = dkl * coef_1_kl + kl * coef_1_kl * dlog_ratio
            kl = kl * coef_1_kl
        loss += beta * kl
        dloss += beta * dkl
    return loss, dloss, kl, flags


@triton.jit
def token_loss_at(
    row,
    logp,
    adv_ptr,
    old_ptr,
    ref_ptr,
    iw_ptr,
    loss_scalars,
    LOSS_KIND: tl.constexpr,
    KL_KIND: tl.constexpr,
    LOSS_FLAGS: tl.constexpr,
):
    """``token_loss_and_grad`` of one token of the logits kernels (``row`` a scalar index), its per-token inputs
    read where their pointers are not None."""
    old = None
    ref = None
    iw = None
    if old_ptr is not None:
        old = tl.load(old_ptr + row)
    if ref_ptr is not None:
        ref = tl.load(ref_ptr + row)
    if iw_ptr is not None:
        iw = tl.load(iw_ptr + row)
    return token_loss_and_grad(logp, tl.load(adv_ptr + row), old, ref, iw, loss_scalars, LOSS_KIND, KL_KIND, LOSS_FLAGS)


@triton.jit
def store_loss_terms(row, active, loss, dloss, kl, flags, loss_out, dloss_out, kl_out, flags_out):
    """One token's loss terms as the logits kernels write them: 0 at a masked token; the KL where there is one."""
    if kl_out is not None:
        tl.store(kl_out + row, tl.where(active, kl, 0.0))
    tl.store(loss_out + row, tl.where(active, loss, 0.0))
    tl.store(dloss_out + row, tl.where(active, dloss, 0.0))
    tl.store(flags_out + row, tl.where(active, flags, 0).to(tl.int8))
