"""Triton kernels of the GRPO loss from logits (launched by ``logits_launch.py``). One program per token, a 1-D grid.

Forward (``grpo_forward_kernel``): stream the token's logits row once, keeping an online
fp32 log-sum-exp (and, when asked, the running sum of p * x for the entropy); gather the
target logit; then, in the same program, the per-token loss math of every loss_type and
its derivative with respect to the token's log-prob, ``dloss_dlogp``. Outputs are fp32 [N].

Backward (``logprob_backward_kernel``): one formula for every loss,
``dlogits = g * (onehot(target) - softmax(x / tau)) / tau`` with ``g = dLoss/dlogp`` a
per-token scalar computed by the caller, the softmax recomputed from the saved lse.
A token with g == 0 (masked) gets a zero row without reading its logits.

Conventions:
- ``pid`` and every offset into the logits are int64 (N * V overflows int32).
- logits are [B, T, V] with strides (stride_b, stride_t, 1): a view such as
  ``logits[:, :-1]`` is read in place. The per-token side arrays are contiguous [N].
- Everything that can change between steps is a run-time argument and is excluded from
  Triton's integer specialization (``do_not_specialize``), so a loop that changes T,
  beta, the epsilons or the temperature never recompiles. Constexprs only say which
  optional features are present.
- The head's soft-cap (``softcap``, None on most models): the kernels read raw logits x and compute
  log softmax(cap(x) / tau) with cap(x) = softcap * tanh(x / softcap) (Gemma's ``final_logit_softcapping``;
  the front end folds a head's scale into tau and softcap). None compiles the cap out: the hot loops of
  an uncapped head are unchanged, instruction for instruction. The gradient carries the cap's chain
  factor, 1 - tanh^2.
- Masked tokens (mask == 0) are not read: their log-prob, entropy, loss and derivative
  are written as 0. The reductions multiply them by 0 anyway; skipping them saves the
  bandwidth of padding.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .token_math import (
    C_LOSS_NONE,
    FLOOR,
    LN2,
    LOG2E,
    NAN,
    RUNTIME_INTS,
    base2_logit,
    capped_logit,
    chained,
    lse_finish,
    lse_fold_sums,
    padded_base2_logit,
    row_pointer,
    store_loss_terms,
    token_loss_at,
)


@triton.jit
def _online_logsumexp(
    row_ptr,
    V,
    inv_temperature,
    softcap,
    BLOCK_V: tl.constexpr,
    COMPUTE_ENTROPY: tl.constexpr,
    COMPUTE_SUMSQ: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    EVICTION: tl.constexpr,
):
    """One pass over a row: log-sum-exp of x = cap(logits) / tau (natural log), the entropy of softmax(x) and the
    sum of its squared probabilities, Σπ² (each only where asked).

    Full blocks load without a mask (so aligned rows get 128-bit vector loads); the remainder, if any, is one
    masked block. The loop is software-pipelined over LOOP_STAGES stages (1: not pipelined);
    EVICTION is the loads' L2 eviction policy ("" none: see ``_forward_token``).
    """
    # The lanes' accumulators cover half a block: each block is loaded whole (each thread's logits contiguous,
    # 128-bit loads at any warp count) and folded in as its even and odd logits, which each thread already holds
    # (a split of the register file, no data movement): half the accumulator registers of a block-wide fold.
    HALF: tl.constexpr = BLOCK_V // 2
    block = tl.arange(0, BLOCK_V)
    c = inv_temperature * LOG2E
    m = tl.full([HALF], FLOOR, tl.float32)
    s = tl.zeros([HALF], tl.float32)
    t = tl.zeros([HALF], tl.float32)
    q = tl.zeros([HALF], tl.float32)
    full_end = (V // BLOCK_V) * BLOCK_V
    for start in tl.range(0, full_end, BLOCK_V, num_stages=LOOP_STAGES):
        x = tl.load(row_ptr + start + block, eviction_policy=EVICTION)
        even, odd = tl.split(tl.reshape(x, [HALF, 2]))
        m, s, t, q = lse_fold_sums(base2_logit(even, c, softcap), m, s, t, q, COMPUTE_ENTROPY, COMPUTE_SUMSQ)
        m, s, t, q = lse_fold_sums(base2_logit(odd, c, softcap), m, s, t, q, COMPUTE_ENTROPY, COMPUTE_SUMSQ)
    if full_end < V:  # the remainder: one masked block, folded as the full ones (no other register layout)
        in_row = full_end + block < V
        x = tl.load(row_ptr + full_end + block, mask=in_row, other=float("-inf"))
        even, odd = tl.split(tl.reshape(x, [HALF, 2]))
        even_in_row, odd_in_row = tl.split(tl.reshape(in_row, [HALF, 2]))
        # A padding lane's fold leaves m and s as they were but makes t = t + 0 * -inf = NaN;
        # keep its t, or every row whose V is not a multiple of BLOCK_V would take the slow path.
        m, s, t_folded, q = lse_fold_sums(
            padded_base2_logit(even, even_in_row, c, softcap), m, s, t, q, COMPUTE_ENTROPY, COMPUTE_SUMSQ
        )
        t = tl.where(even_in_row, t_folded, t)
        m, s, t_folded, q = lse_fold_sums(
            padded_base2_logit(odd, odd_in_row, c, softcap), m, s, t, q, COMPUTE_ENTROPY, COMPUTE_SUMSQ
        )
        t = tl.where(odd_in_row, t_folded, t)
    lse2, entropy, sum_squares = lse_finish(m, s, t, q, COMPUTE_ENTROPY, COMPUTE_SUMSQ)
    if COMPUTE_ENTROPY:
        # A -inf logit adds 0 * -inf to t; rather than guard every logit, a row whose entropy came
        # out NaN while its log-sum-exp is finite (only -inf logits do that) is summed again safely.
        if (entropy != entropy) & (lse2 == lse2) & (tl.abs(lse2) < float("inf")):
            entropy = LN2 * (lse2 - _mean_x2(row_ptr, V, c, softcap, lse2, BLOCK_V))
    return lse2 * LN2, entropy, sum_squares


@triton.jit
def _mean_x2(row_ptr, V, c, softcap, lse2, BLOCK_V: tl.constexpr):
    """sum of p * x2 over a row (x2 = logits in base 2), where -inf logits add 0: the entropy's slow path."""
    cols = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        in_row = start + cols < V
        x2 = padded_base2_logit(tl.load(row_ptr + start + cols, mask=in_row, other=float("-inf")), in_row, c, softcap)
        p = tl.exp2(x2 - lse2)
        acc += tl.where(p > 0.0, p * x2, 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _forward_token(
    pid,
    logits_ptr,
    stride_b,
    stride_t,
    ids_ptr,
    T,
    V,
    mask_ptr,
    adv_ptr,
    old_ptr,
    ref_ptr,
    iw_ptr,
    logp_out,
    entropy_out,
    lse_out,
    loss_out,
    dloss_out,
    kl_out,
    flags_out,
    sum_squares_out,
    kept_lse_ptr,
    kept_entropy_ptr,
    grad_weight_ptr,
    grad_logits_ptr,
    grad_stride_b,
    grad_stride_t,
    entropy_grad_ptr,
    inv_temperature,
    softcap,
    loss_scalars,
    LOSS_KIND: tl.constexpr,
    KL_KIND: tl.constexpr,
    LOSS_FLAGS: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    L2_HINTS: tl.constexpr,
):
    """Everything the forward does for one token (row ``pid``): see ``grpo_forward_kernel``."""
    HAS_MASK: tl.constexpr = mask_ptr is not None
    COMPUTE_ENTROPY: tl.constexpr = entropy_out is not None
    COMPUTE_SUMSQ: tl.constexpr = sum_squares_out is not None
    WRITE_GRAD: tl.constexpr = grad_weight_ptr is not None
    HAS_ENTROPY_GRAD: tl.constexpr = entropy_grad_ptr is not None
    # L2_HINTS: the row's first read stays in L2 (evict_last) where the gradient loop reads it again right after,
    # and leaves first (evict_first) where nothing will; without them the loads carry no policy
    FIRST_READ: tl.constexpr = ("evict_last" if WRITE_GRAD else "evict_first") if L2_HINTS else ""
    active = True
    if HAS_MASK:
        active = tl.load(mask_ptr + pid) != 0.0
    row_ptr = row_pointer(logits_ptr, pid, T, stride_b, stride_t, ROW_ALIGN)
    target = tl.load(ids_ptr + pid).to(tl.int64)
    in_set = False
    if active:
        lse, entropy, sum_squares = _online_logsumexp(
            row_ptr, V, inv_temperature, softcap, BLOCK_V, COMPUTE_ENTROPY, COMPUTE_SUMSQ, LOOP_STAGES, FIRST_READ
        )
        logp_lse = lse
        if kept_lse_ptr is not None:  # the sampler's kept set: its log-sum-exp where the token uses it (else +inf)
            kept_lse = tl.load(kept_lse_ptr + pid)
            in_set = kept_lse < float("inf")
            logp_lse = tl.where(in_set, kept_lse, lse)
            if kept_entropy_ptr is not None:  # the entropy over the set
                entropy = tl.where(in_set, tl.load(kept_entropy_ptr + pid), entropy)
        logp = capped_logit(tl.load(row_ptr + target), softcap) * inv_temperature - logp_lse
    else:
        lse = 0.0
        entropy = 0.0
        sum_squares = 0.0
        logp = 0.0
    tl.store(logp_out + pid, logp)
    tl.store(lse_out + pid, lse)
    if COMPUTE_ENTROPY:
        tl.store(entropy_out + pid, entropy)
    if COMPUTE_SUMSQ:
        tl.store(sum_squares_out + pid, sum_squares)

    if LOSS_KIND != C_LOSS_NONE:
        loss, dloss, kl, flags = token_loss_at(
            pid, logp, adv_ptr, old_ptr, ref_ptr, iw_ptr, loss_scalars, LOSS_KIND, KL_KIND, LOSS_FLAGS
        )
        store_loss_terms(pid, active, loss, dloss, kl, flags, loss_out, dloss_out, kl_out, flags_out)
        if WRITE_GRAD:
            # One pass: the reduction's weight of this token is known up front, so dLoss/dlogp
            # is too; re-stream the row (an L2 hit, the row was just read) and write dlogits.
            g = tl.where(active, dloss * tl.load(grad_weight_ptr + pid), 0.0)
            h = 0.0
            if HAS_ENTROPY_GRAD:  # the entropy bonus: dLoss/dH of this token, known up front like g
                h = tl.where(active, tl.load(entropy_grad_ptr + pid), 0.0)
            if kept_lse_ptr is not None:  # a set's token: its entries' share is written after (kept.py)
                g = tl.where(in_set, 0.0, g)
                if kept_entropy_ptr is not None:
                    h = tl.where(in_set, 0.0, h)
            out_ptr = row_pointer(grad_logits_ptr, pid, T, grad_stride_b, grad_stride_t, ROW_ALIGN)
            _write_row_gradient(
                row_ptr,
                out_ptr,
                V,
                lse,
                target,
                g,
                inv_temperature,
                softcap,
                h,
                entropy,
                BLOCK_V,
                HAS_ENTROPY_GRAD,
                LOOP_STAGES,
                L2_HINTS,
            )


@triton.jit(do_not_specialize=RUNTIME_INTS)
def grpo_forward_kernel(
    logits_ptr,
    stride_b,
    stride_t,
    ids_ptr,
    T,
    V,
    N,
    mask_ptr,
    adv_ptr,
    old_ptr,
    ref_ptr,
    iw_ptr,
    logp_out,
    entropy_out,
    lse_out,
    loss_out,
    dloss_out,
    kl_out,
    flags_out,
    sum_squares_out,
    kept_lse_ptr,
    kept_entropy_ptr,
    grad_weight_ptr,
    grad_logits_ptr,
    grad_stride_b,
    grad_stride_t,
    entropy_grad_ptr,
    inv_temperature,
    softcap,
    loss_scalars,
    LOSS_KIND: tl.constexpr,
    KL_KIND: tl.constexpr,
    LOSS_FLAGS: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PERSISTENT: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    L2_HINTS: tl.constexpr,
):
    """One token per program on a grid of N programs; or, PERSISTENT, a grid of a few programs per SM,
    each taking every num_programs-th token, so that the rows in flight (and being re-read by the
    one-pass gradient loop) are bounded by the grid, not by what the hardware keeps resident
    (``logits_launch.l2_programs_per_sm`` sizes it so that they fit in L2).

    The vocabulary loops: blocks of BLOCK_V logits, each thread's logits loaded 128 bits at a time whatever the
    warps (``_online_logsumexp``), software-pipelined over LOOP_STAGES stages (``tl.range``: Triton pipelines a
    loop without ``tl.dot`` only when asked; 1 leaves it as it is), with L2 eviction hints where L2_HINTS
    (``_forward_token``; on triton 3.6 a pipelined load drops them).

    An optional tensor is None where absent, and what it switches on is derived from that at compile
    time: the mask, old and reference log-probs, importance weights, the entropy (``entropy_out``), the sum of
    squared probabilities (``sum_squares_out``, Σπ²: a log-prob pass's, on request), the sampler's kept set
    (``kept_lse_ptr``: each token's log-sum-exp over its set, +inf where it takes the whole vocabulary;
    ``kept_entropy_ptr``: the set's entropy, where the entropy is the set's; ``kept.py``), the one-pass gradient
    (``grad_weight_ptr``: a set's token writes the dense part only, its entries by ``kept.py``), the entropy
    bonus's (``entropy_grad_ptr``) and the head's soft-cap (``softcap``, a number: see the module docstring).

    The two calls of ``_forward_token`` are kept apart on purpose: one loop with a single trip for the
    plain grid (tried, AOT sm_90) cost the fp32 one-pass hot loops 0.3 instructions a logit and up to
    14 registers, though bf16 was unchanged."""
    if PERSISTENT:
        for row in range(tl.program_id(0), N, tl.num_programs(0)):
            _forward_token(
                tl.cast(row, tl.int64),
                logits_ptr,
                stride_b,
                stride_t,
                ids_ptr,
                T,
                V,
                mask_ptr,
                adv_ptr,
                old_ptr,
                ref_ptr,
                iw_ptr,
                logp_out,
                entropy_out,
                lse_out,
                loss_out,
                dloss_out,
                kl_out,
                flags_out,
                sum_squares_out,
                kept_lse_ptr,
                kept_entropy_ptr,
                grad_weight_ptr,
                grad_logits_ptr,
                grad_stride_b,
                grad_stride_t,
                entropy_grad_ptr,
                inv_temperature,
                softcap,
                loss_scalars,
                LOSS_KIND,
                KL_KIND,
                LOSS_FLAGS,
                ROW_ALIGN,
                BLOCK_V,
                LOOP_STAGES,
                L2_HINTS,
            )
    else:
        _forward_token(
            tl.program_id(0).to(tl.int64),
            logits_ptr,
            stride_b,
            stride_t,
            ids_ptr,
            T,
            V,
            mask_ptr,
            adv_ptr,
            old_ptr,
            ref_ptr,
            iw_ptr,
            logp_out,
            entropy_out,
            lse_out,
            loss_out,
            dloss_out,
            kl_out,
            flags_out,
            sum_squares_out,
            kept_lse_ptr,
            kept_entropy_ptr,
            grad_weight_ptr,
            grad_logits_ptr,
            grad_stride_b,
            grad_stride_t,
            entropy_grad_ptr,
            inv_temperature,
            softcap,
            loss_scalars,
            LOSS_KIND,
            KL_KIND,
            LOSS_FLAGS,
            ROW_ALIGN,
            BLOCK_V,
            LOOP_STAGES,
            L2_HINTS,
        )


@triton.jit
def _write_row_gradient(
    row_ptr,
    out_ptr,
    V,
    lse,
    target,
    g,
    inv_temperature,
    softcap,
    h,
    entropy,
    BLOCK_V: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    L2_HINTS: tl.constexpr,
):
    """out = g * (onehot(target) - softmax(row / tau)) / tau over one row; a zero row, unread, if g == 0.

    The loop writes -g / tau * p for every column, one exp2 and one multiply a logit; the target's
    +g / tau is one scalar store after it (ordered after the loop's stores by a barrier), not a
    compare on every element.

    HAS_ENTROPY_GRAD adds h = dLoss/dH times the entropy's gradient, dH/dz_j = -p_j (log p_j + H):
    out_j = (g onehot_j + p_j (-g - h H - h log p_j)) / tau. With d = x2 - lse2 (base 2, so
    log p_j = d ln 2) that is p * (a d + b), a = -h ln2 / tau, b = (-g - h H) / tau: one FMA more a
    logit. The row is zero, unread, only if g and h are both 0. With a soft-cap every column's value
    is times its chain factor 1 - tanh^2 (``cap_slope``).

    L2_HINTS: this is the row's last read (evict_first) and the gradient is not read again here (streaming
    stores, ".cs"); the loops are pipelined over LOOP_STAGES stages.
    """
    READ: tl.constexpr = "evict_first" if L2_HINTS else ""
    WRITE: tl.constexpr = ".cs" if L2_HINTS else ""
    cols = tl.arange(0, BLOCK_V)
    out_dtype = out_ptr.dtype.element_ty
    full_end = (V // BLOCK_V) * BLOCK_V
    is_zero = g == 0.0
    if HAS_ENTROPY_GRAD:
        is_zero = is_zero & (h == 0.0)
    if is_zero:
        zeros = tl.zeros([BLOCK_V], dtype=out_dtype)
        for start in tl.range(0, full_end, BLOCK_V, num_stages=LOOP_STAGES):
            tl.store(out_ptr + start + cols, zeros, cache_modifier=WRITE)
        if full_end < V:
            tl.store(out_ptr + full_end + cols, zeros, mask=full_end + cols < V, cache_modifier=WRITE)
    elif HAS_ENTROPY_GRAD:
        c = inv_temperature * LOG2E
        lse2 = lse * LOG2E
        a = -h * LN2 * inv_temperature
        b = (-g - h * entropy) * inv_temperature
        # d is floored at FLOOR so that a -inf logit gives p = 0 times a finite a d + b, not 0 * inf = NaN;
        # a NaN still propagates (the row's log-sum-exp is NaN then anyway). The target is read before the
        # loop, which may write in place.
        x2_target = base2_logit(tl.load(row_ptr + target), c, softcap)
        d_target = tl.maximum(x2_target - lse2, FLOOR, propagate_nan=NAN)
        for start in tl.range(0, full_end, BLOCK_V, num_stages=LOOP_STAGES):
            x2 = base2_logit(tl.load(row_ptr + start + cols, eviction_policy=READ), c, softcap)
            d = tl.maximum(x2 - lse2, FLOOR, propagate_nan=NAN)
            tl.store(
                out_ptr + start + cols,
                chained(tl.exp2(d) * (a * d + b), x2, c, softcap).to(out_dtype),
                cache_modifier=WRITE,
            )
        if full_end < V:
            in_row = full_end + cols < V
            x2 = base2_logit(tl.load(row_ptr + full_end + cols, mask=in_row, other=float("-inf")), c, softcap)
            d = tl.maximum(x2 - lse2, FLOOR, propagate_nan=NAN)
            tl.store(
                out_ptr + full_end + cols,
                chained(tl.exp2(d) * (a * d + b), x2, c, softcap).to(out_dtype),
                mask=in_row,
                cache_modifier=WRITE,
            )
        tl.debug_barrier()
        at_target = g * inv_temperature + tl.exp2(d_target) * (a * d_target + b)
        tl.store(out_ptr + target, chained(at_target, x2_target, c, softcap).to(out_dtype))
    else:
        c = inv_temperature * LOG2E
        lse2 = lse * LOG2E
        minus_g = -g * inv_temperature
        # read before the loop: in place (out_ptr == row_ptr) the loop overwrites the logits
        x2_target = base2_logit(tl.load(row_ptr + target), c, softcap)
        p_target = tl.exp2(x2_target - lse2)
        for start in tl.range(0, full_end, BLOCK_V, num_stages=LOOP_STAGES):
            x2 = base2_logit(tl.load(row_ptr + start + cols, eviction_policy=READ), c, softcap)
            tl.store(
                out_ptr + start + cols,
                chained(minus_g * tl.exp2(x2 - lse2), x2, c, softcap).to(out_dtype),
                cache_modifier=WRITE,
            )
        if full_end < V:
            in_row = full_end + cols < V
            x2 = base2_logit(tl.load(row_ptr + full_end + cols, mask=in_row, other=float("-inf")), c, softcap)
            tl.store(
                out_ptr + full_end + cols,
                chained(minus_g * tl.exp2(x2 - lse2), x2, c, softcap).to(out_dtype),
                mask=in_row,
                cache_modifier=WRITE,
            )
        tl.debug_barrier()
        tl.store(out_ptr + target, chained(g * inv_temperature * (1.0 - p_target), x2_target, c, softcap).to(out_dtype))


@triton.jit(do_not_specialize=RUNTIME_INTS)
def logprob_backward_kernel(
    logits_ptr,
    stride_b,
    stride_t,
    ids_ptr,
    T,
    V,
    grad_logp_ptr,
    lse_ptr,
    grad_logits_ptr,
    grad_stride_b,
    grad_stride_t,
    grad_entropy_ptr,
    entropy_ptr,
    inv_temperature,
    softcap,
    ROW_ALIGN: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    L2_HINTS: tl.constexpr,
):
    """dlogits = g * (onehot - p) / tau (+ dLoss/dH times dH/dlogits with ``grad_entropy_ptr`` and
    ``entropy_ptr``, None without the entropy bonus), times the soft-cap's chain factor where ``softcap`` is a
    number; may write into the logits' own storage (in place). The row's loop as the one-pass gradient's
    (``_write_row_gradient``: pipelined over LOOP_STAGES, streaming hints where L2_HINTS)."""
    HAS_ENTROPY_GRAD: tl.constexpr = grad_entropy_ptr is not None
    pid = tl.program_id(0).to(tl.int64)
    g = tl.load(grad_logp_ptr + pid)
    h = 0.0
    entropy = 0.0
    if HAS_ENTROPY_GRAD:
        h = tl.load(grad_entropy_ptr + pid)
        entropy = tl.load(entropy_ptr + pid)
    row_ptr = row_pointer(logits_ptr, pid, T, stride_b, stride_t, ROW_ALIGN)
    out_ptr = row_pointer(grad_logits_ptr, pid, T, grad_stride_b, grad_stride_t, ROW_ALIGN)
    lse = tl.load(lse_ptr + pid)
    target = tl.load(ids_ptr + pid).to(tl.int64)
    _write_row_gradient(
        row_ptr,
        out_ptr,
        V,
        lse,
        target,
        g,
        inv_temperature,
        softcap,
        h,
        entropy,
        BLOCK_V,
        HAS_ENTROPY_GRAD,
        LOOP_STAGES,
        L2_HINTS,
    )


@triton.jit(do_not_specialize=["numel"])
def scale_in_place_kernel(x_ptr, scale_ptr, numel, BLOCK: tl.constexpr):
    """x *= scale over a contiguous buffer, by a grid of persistent programs.

    The scale is read on the device: when it is 1 (a plain ``loss.backward()``) every program
    returns at once, so the common case costs one small launch and no pass over x, and the
    host never waits for the value (no sync).
    """
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        cols = tl.arange(0, BLOCK)
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, numel, step):
            offsets = start + cols
            in_range = offsets < numel
            x = tl.load(x_ptr + offsets, mask=in_range)
            tl.store(x_ptr + offsets, (x.to(tl.float32) * scale).to(x_ptr.dtype.element_ty), mask=in_range)
