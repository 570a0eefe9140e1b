"""The split-row one-pass kernel: each token's row is cut into K contiguous chunks handled by K sibling
programs, so that a row's logits are read from HBM once and its gradient written once (2 S).

Why: the one-pass kernel (``logits.py``) reads each row twice, once for its log-sum-exp and once, for the
gradient, after it; with a program per row, hundreds of 297 KiB rows are in flight against a 60 MB L2
and the second read comes back from HBM (3 S). Here a chunk is V / K logits: the L2 working set is the
resident programs times a chunk, which K brings under the L2.

One work item is a (row, chunk). A program, for each of its items:

1. **publish**: folds its chunk into a log-sum-exp state (max, sum 2^(x - max), sum 2^(x - max) x, base
   2, as ``logits.py``'s lanes) and stores it in the row's scratch; then arrives on the row's counter
   (release);
2. **wait**: until the row's K siblings have arrived (acquire), a bounded spin;
3. **merge and write**: merges the K states into the row's log-sum-exp and entropy, reads the target
   logit, computes the loss terms and dLoss/dlogp (``token_math.token_loss_and_grad``, as every kernel does)
   and writes its chunk's gradient (chunk 0 also writes the token's outputs).

The K siblings of a row must be resident at once, or the wait never returns: the grid is persistent
(programs take items ``pid, pid + P, ...``, P a multiple of K, so a row's siblings are in the same
iteration of the same group of K programs), no larger than the GPU holds at once, and launched with
``launch_cooperative_grid=True`` so that the driver guarantees co-residency (or refuses the launch).

Two variants, chosen by the chunk's length: a chunk of several blocks is streamed twice, to publish and to
write, the second read from L2 (the working set is the resident programs' chunks); a chunk of one block
(``HOLD_CHUNK``) is loaded once and held in registers across the wait, so its gradient is computed from
them (no second read at all). K need not be a power of 2 (the merge masks its lanes): K chunks of whole
blocks cover the row, none empty.

Triton's interpreter runs programs one after another, so a wait there would never return: with
``PHASE`` = 1 and then 2 the kernel is launched twice, publish for every item, then merge and write,
the same device functions without the wait (``PHASE`` = 0: the single cooperative launch). Rows whose
mask is 0 are never read (every sibling skips the row, no wait): their gradient chunks are zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .logsumexp import rescale_lse
from .token_math import (
    FLOOR,
    LN2,
    LOG2E,
    NAN,
    RUNTIME_INTS,
    base2_logit,
    capped_logit,
    chained,
    lse_fold,
    padded_base2_logit,
    row_pointer,
    store_loss_terms,
    token_loss_at,
)

# the scratch's floats per (row, chunk): max, sum, entropy sum (base 2), one pad for 16-byte rows
STATE_WIDTH = 4
C_STATE_WIDTH = tl.constexpr(STATE_WIDTH)  # the same, as the kernels read it (the host allocates with STATE_WIDTH)


@triton.jit
def _chunk_state(row_ptr, c0, c1, c, softcap, BLOCK_V: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr):
    """(max, sum 2^(x2 - max), sum 2^(x2 - max) x2) of x2 = cap(logits) * c over columns [c0, c1); c0 is a
    multiple of BLOCK_V, so full blocks load unmasked (128-bit loads on aligned rows)."""
    HALF: tl.constexpr = BLOCK_V // 2
    cols = tl.arange(0, HALF)
    m = tl.full([HALF], FLOOR, tl.float32)
    s = tl.zeros([HALF], tl.float32)
    t = tl.zeros([HALF], tl.float32)
    full_end = c0 + ((c1 - c0) // BLOCK_V) * BLOCK_V
    for start in range(c0, full_end, BLOCK_V):
        low = base2_logit(tl.load(row_ptr + start + cols), c, softcap)
        high = base2_logit(tl.load(row_ptr + start + HALF + cols), c, softcap)
        m, s, t = lse_fold(low, m, s, t, COMPUTE_ENTROPY)
        m, s, t = lse_fold(high, m, s, t, COMPUTE_ENTROPY)
    for start in range(full_end, c1, HALF):  # the row's remainder (the last chunk only)
        in_chunk = start + cols < c1
        x2 = padded_base2_logit(
            tl.load(row_ptr + start + cols, mask=in_chunk, other=float("-inf")), in_chunk, c, softcap
        )
        m, s, t_folded = lse_fold(x2, m, s, t, COMPUTE_ENTROPY)
        t = tl.where(in_chunk, t_folded, t)
    chunk_max = tl.max(m, axis=0)
    s, t = rescale_lse(m, s, t, chunk_max, COMPUTE_ENTROPY, BASE2=True)
    sum_exp = tl.sum(s, axis=0)
    sum_x = 0.0
    if COMPUTE_ENTROPY:
        sum_x = tl.sum(t, axis=0)
        # a -inf logit adds 0 * -inf = NaN to t (as in logits.py): sum the chunk again, -inf adding 0
        if (sum_x != sum_x) & (sum_exp == sum_exp) & (tl.abs(chunk_max) < float("inf")):
            sum_x = _chunk_sum_x2(row_ptr, c0, c1, c, softcap, chunk_max, BLOCK_V)
    return chunk_max, sum_exp, sum_x


@triton.jit
def _chunk_sum_x2(row_ptr, c0, c1, c, softcap, chunk_max, BLOCK_V: tl.constexpr):
    """sum of 2^(x2 - chunk_max) x2 over [c0, c1), where -inf logits add 0: the entropy's slow path."""
    cols = tl.arange(0, BLOCK_V)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for start in range(c0, c1, BLOCK_V):
        in_chunk = start + cols < c1
        x2 = padded_base2_logit(
            tl.load(row_ptr + start + cols, mask=in_chunk, other=float("-inf")), in_chunk, c, softcap
        )
        e = tl.exp2(x2 - chunk_max)
        acc += tl.where(e > 0.0, e * x2, 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _merged_state(state_row, K: tl.constexpr, K_LANES: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr):
    """(lse, entropy) in nats of a row from its K chunks' published states (read as K_LANES >= K lanes, a
    power of 2; the lanes past K add nothing)."""
    k = tl.arange(0, K_LANES)
    published = k < K
    # from L2 (".cg"), never a line an earlier load left in this SM's L1: L2 is where siblings' stores meet
    maxes = tl.load(state_row + k * C_STATE_WIDTH, mask=published, other=float("-inf"), cache_modifier=".cg")
    sums = tl.load(state_row + k * C_STATE_WIDTH + 1, mask=published, other=0.0, cache_modifier=".cg")
    row_max = tl.max(maxes, axis=0)  # finite: a published max is at least FLOOR
    scale = tl.exp2(maxes - row_max)
    sum_exp = tl.sum(sums * scale, axis=0)
    lse2 = row_max + tl.log2(sum_exp)
    entropy = 0.0
    if COMPUTE_ENTROPY:
        sum_x = tl.sum(
            tl.load(state_row + k * C_STATE_WIDTH + 2, mask=published, other=0.0, cache_modifier=".cg") * scale, axis=0
        )
        entropy = LN2 * (lse2 - sum_x / sum_exp)
    return lse2 * LN2, entropy


@triton.jit
def _held_chunk(row_ptr, c0, n, active, BLOCK_V: tl.constexpr):
    """The chunk [c0, c0 + n), n <= BLOCK_V, as one [BLOCK_V] block in the logits' dtype, -inf past its end;
    a full chunk loads without a column mask (128-bit loads on aligned rows); a masked row reads nothing."""
    cols = tl.arange(0, BLOCK_V)
    x = tl.full([BLOCK_V], float("-inf"), row_ptr.dtype.element_ty)
    if active:
        if n == BLOCK_V:
            x = tl.load(row_ptr + c0 + cols)
        else:
            x = tl.load(row_ptr + c0 + cols, mask=cols < n, other=float("-inf"))
    return x


@triton.jit
def _held_state(x, n, c, softcap, BLOCK_V: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr):
    """(x2, e, max, sum e, sum e x2) of a held chunk of n logits: x2 = cap(x) * c, e = 2^(x2 - max) (-inf adds
    0). x2 and e stay in registers for the gradient: p = e 2^(max - lse), one multiply a logit, no second exp2."""
    x2 = padded_base2_logit(x, tl.arange(0, BLOCK_V) < n, c, softcap)
    chunk_max = tl.maximum(tl.max(x2, axis=0), FLOOR)  # at least FLOOR: a chunk of -inf has a finite max
    e = tl.exp2(x2 - chunk_max)
    sum_x = 0.0
    if COMPUTE_ENTROPY:
        sum_x = tl.sum(tl.where(e > 0.0, x2, 0.0) * e, axis=0)  # -inf: e = 0 adds 0, never 0 * -inf
    return x2, e, chunk_max, tl.sum(e, axis=0), sum_x


@triton.jit
def _held_row(sum_exp, sum_x, row_max, COMPUTE_ENTROPY: tl.constexpr):
    """(lse, entropy) in nats of a row held whole, from its state (``_held_state``'s sums and max)."""
    lse2 = row_max + tl.log2(sum_exp)
    entropy = 0.0
    if COMPUTE_ENTROPY:
        entropy = LN2 * (lse2 - sum_x / sum_exp)
    return lse2 * LN2, entropy


@triton.jit
def _write_held_gradient(
    x2,
    e,
    chunk_max,
    out_ptr,
    c0,
    n,
    lse,
    target,
    target_logit,
    g,
    inv_temperature,
    softcap,
    h,
    entropy,
    BLOCK_V: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
):
    """``_write_chunk_gradient`` from a held chunk (``_held_state``'s x2 and e): the same values, each logit's
    probability p = e 2^(max - lse) (a multiply, not an exp2); the target's own value (its capped logit passed
    in) stored after the block, where the target lies in the chunk, so that no logit pays a comparison with it."""
    cols = tl.arange(0, BLOCK_V)
    out_dtype = out_ptr.dtype.element_ty
    is_zero = g == 0.0
    if HAS_ENTROPY_GRAD:
        is_zero = is_zero & (h == 0.0)
    c = inv_temperature * LOG2E
    lse2 = lse * LOG2E
    to_p = tl.exp2(chunk_max - lse2)  # <= 1: the row's lse is at least its chunk's max
    if is_zero:
        grad = tl.zeros([BLOCK_V], dtype=out_dtype)
        at_target = 0.0
    elif HAS_ENTROPY_GRAD:
        a = -h * LN2 * inv_temperature
        b = (-g - h * entropy) * inv_temperature
        d = tl.maximum(x2 - lse2, FLOOR, propagate_nan=NAN)
        grad = chained((e * to_p) * (a * d + b), x2, c, softcap).to(out_dtype)
        d_target = tl.maximum(target_logit * c - lse2, FLOOR, propagate_nan=NAN)
        at_target = chained(g * inv_temperature + tl.exp2(d_target) * (a * d_target + b), target_logit * c, c, softcap)
    else:
        grad = chained(e * (-g * inv_temperature * to_p), x2, c, softcap).to(out_dtype)
        at_target = chained(
            g * inv_temperature * (1.0 - tl.exp2(target_logit * c - lse2)), target_logit * c, c, softcap
        )
    if n == BLOCK_V:
        tl.store(out_ptr + c0 + cols, grad)
    else:
        tl.store(out_ptr + c0 + cols, grad, mask=cols < n)
    tl.debug_barrier()  # the block's store, every thread's, before the target's
    if (target >= c0) & (target < c0 + n):
        tl.store(out_ptr + target, at_target.to(out_dtype))


@triton.jit
def _wait_for_siblings(counter, K: tl.constexpr, error_ptr, MAX_SPIN: tl.constexpr):
    """Spin until the row's counter reaches K (acquire), at most MAX_SPIN reads; a timeout (siblings not
    resident: the launch was not cooperative) is recorded in ``error_ptr``, never a hang."""
    arrived = tl.atomic_add(counter, 0, sem="acquire")
    spins = 0
    while (arrived < K) & (spins < MAX_SPIN):
        arrived = tl.atomic_add(counter, 0, sem="acquire")
        spins += 1
    if arrived < K:
        tl.atomic_xchg(error_ptr, 1)
    tl.debug_barrier()  # the acquiring thread's view, to the whole program


@triton.jit
def _write_chunk_gradient(
    row_ptr,
    out_ptr,
    c0,
    c1,
    lse,
    target,
    g,
    inv_temperature,
    softcap,
    h,
    entropy,
    BLOCK_V: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
):
    """``logits._write_row_gradient`` over columns [c0, c1) of the row: -g / tau p (plus the entropy term),
    and the target's +g / tau where the target lies in the chunk, times the soft-cap's chain factor where there
    is one; zeros, unread, if g (and h) are 0.

    A copy of the row version with a start and a target-ownership test, kept apart on purpose: one
    function for both (tried, AOT) cost the row kernels up to 0.25 instructions a logit and up to 17
    registers (sm_90 persistent bf16: 128 -> 145), which the AOT report must not lose."""
    cols = tl.arange(0, BLOCK_V)
    out_dtype = out_ptr.dtype.element_ty
    full_end = c0 + ((c1 - c0) // BLOCK_V) * BLOCK_V
    owns_target = (target >= c0) & (target < c1)
    is_zero = g == 0.0
    if HAS_ENTROPY_GRAD:
        is_zero = is_zero & (h == 0.0)
    if is_zero:
        zeros = tl.zeros([BLOCK_V], dtype=out_dtype)
        for start in range(c0, full_end, BLOCK_V):
            tl.store(out_ptr + start + cols, zeros)
        if full_end < c1:
            tl.store(out_ptr + full_end + cols, zeros, mask=full_end + cols < c1)
    elif HAS_ENTROPY_GRAD:
        c = inv_temperature * LOG2E
        lse2 = lse * LOG2E
        a = -h * LN2 * inv_temperature
        b = (-g - h * entropy) * inv_temperature
        x2_target = base2_logit(tl.load(row_ptr + target), c, softcap)
        d_target = tl.maximum(x2_target - lse2, FLOOR, propagate_nan=NAN)
        for start in range(c0, full_end, BLOCK_V):
            x2 = base2_logit(tl.load(row_ptr + start + cols), c, softcap)
            d = tl.maximum(x2 - lse2, FLOOR, propagate_nan=NAN)
            tl.store(out_ptr + start + cols, chained(tl.exp2(d) * (a * d + b), x2, c, softcap).to(out_dtype))
        if full_end < c1:
            in_chunk = full_end + cols < c1
            x2 = base2_logit(tl.load(row_ptr + full_end + cols, mask=in_chunk, other=float("-inf")), c, softcap)
            d = tl.maximum(x2 - lse2, FLOOR, propagate_nan=NAN)
            tl.store(
                out_ptr + full_end + cols,
                chained(tl.exp2(d) * (a * d + b), x2, c, softcap).to(out_dtype),
                mask=in_chunk,
            )
        tl.debug_barrier()
        if owns_target:
            at_target = g * inv_temperature + tl.exp2(d_target) * (a * d_target + b)
            tl.store(out_ptr + target, chained(at_target, x2_target, c, softcap).to(out_dtype))
    else:
        c = inv_temperature * LOG2E
        lse2 = lse * LOG2E
        minus_g = -g * inv_temperature
        x2_target = base2_logit(tl.load(row_ptr + target), c, softcap)
        p_target = tl.exp2(x2_target - lse2)
        for start in range(c0, full_end, BLOCK_V):
            x2 = base2_logit(tl.load(row_ptr + start + cols), c, softcap)
            tl.store(out_ptr + start + cols, chained(minus_g * tl.exp2(x2 - lse2), x2, c, softcap).to(out_dtype))
        if full_end < c1:
            in_chunk = full_end + cols < c1
            x2 = base2_logit(tl.load(row_ptr + full_end + cols, mask=in_chunk, other=float("-inf")), c, softcap)
            tl.store(
                out_ptr + full_end + cols,
                chained(minus_g * tl.exp2(x2 - lse2), x2, c, softcap).to(out_dtype),
                mask=in_chunk,
            )
        tl.debug_barrier()
        if owns_target:
            tl.store(
                out_ptr + target, chained(g * inv_temperature * (1.0 - p_target), x2_target, c, softcap).to(out_dtype)
            )


@triton.jit(do_not_specialize=RUNTIME_INTS + ["chunk_blocks"])
def split_row_forward_kernel(
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
    grad_weight_ptr,
    grad_logits_ptr,
    grad_stride_b,
    grad_stride_t,
    entropy_grad_ptr,
    state_ptr,
    counter_ptr,
    error_ptr,
    chunk_blocks,
    inv_temperature,
    softcap,
    loss_scalars,
    LOSS_KIND: tl.constexpr,
    KL_KIND: tl.constexpr,
    LOSS_FLAGS: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BLOCK_V: tl.constexpr,
    K: tl.constexpr,
    K_LANES: tl.constexpr,
    HOLD_CHUNK: tl.constexpr,
    PHASE: tl.constexpr,
    MAX_SPIN: tl.constexpr,
):
    """The one-pass loss (every output of ``logits.grpo_forward_kernel`` with its one-pass gradient) with each
    row split over K sibling programs: see the module's docstring. PHASE 0: the cooperative launch (publish,
    wait, merge and write); 1 and 2: the interpreter's two launches (publish; merge and write). Optional
    tensors are None where absent, as in ``grpo_forward_kernel``. HOLD_CHUNK: every chunk is one block
    (chunk_blocks is 1), held in registers from its load to its gradient; with K = 1 that block is the row
    (a program a row, which waits on nothing)."""
    HAS_MASK: tl.constexpr = mask_ptr is not None
    COMPUTE_ENTROPY: tl.constexpr = entropy_out is not None
    HAS_ENTROPY_GRAD: tl.constexpr = entropy_grad_ptr is not None
    # K = 1 with the row held: one program a row, no sibling, so no scratch, arrival or wait at all
    WHOLE_ROW: tl.constexpr = HOLD_CHUNK and K == 1
    c = inv_temperature * LOG2E
    for item in range(tl.program_id(0), N * K, tl.num_programs(0)):
        row = tl.cast(item // K, tl.int64)
        chunk = item - (item // K) * K
        # chunks are whole blocks: c0 is a multiple of BLOCK_V, which keeps aligned rows' loads 128-bit
        c0 = chunk * chunk_blocks * BLOCK_V
        c1 = tl.maximum(tl.minimum(c0 + chunk_blocks * BLOCK_V, V), c0)  # past the row's end: empty, [c0, c0)
        active = True
        if HAS_MASK:
            active = tl.load(mask_ptr + row) != 0.0
        row_ptr = row_pointer(logits_ptr, row, T, stride_b, stride_t, ROW_ALIGN)
        state_row = state_ptr + row * (K * C_STATE_WIDTH)
        if HOLD_CHUNK:  # loaded once, before the wait (the interpreter's second launch, PHASE 2, loads it again)
            x2, e, held_max, held_sum, held_sum_x = _held_state(
                _held_chunk(row_ptr, c0, c1 - c0, active, BLOCK_V), c1 - c0, c, softcap, BLOCK_V, COMPUTE_ENTROPY
            )
        if not WHOLE_ROW:
            if active & (PHASE != 2):
                if HOLD_CHUNK:
                    chunk_max, sum_exp, sum_x = held_max, held_sum, held_sum_x
                else:
                    chunk_max, sum_exp, sum_x = _chunk_state(row_ptr, c0, c1, c, softcap, BLOCK_V, COMPUTE_ENTROPY)
                tl.store(state_row + chunk * C_STATE_WIDTH, chunk_max)
                tl.store(state_row + chunk * C_STATE_WIDTH + 1, sum_exp)
                tl.store(state_row + chunk * C_STATE_WIDTH + 2, sum_x)
                if PHASE == 0:
                    tl.debug_barrier()  # every thread's stores before the release
                    tl.atomic_add(counter_ptr + row, 1, sem="release")
        if PHASE != 1:
            out_ptr = row_pointer(grad_logits_ptr, row, T, grad_stride_b, grad_stride_t, ROW_ALIGN)
            target = tl.load(ids_ptr + row).to(tl.int64)
            if active:
                if WHOLE_ROW:  # the row is this program's chunk: its state is the row's, nothing to publish
                    lse, entropy = _held_row(held_sum, held_sum_x, held_max, COMPUTE_ENTROPY)
                else:
                    if PHASE == 0:
                        _wait_for_siblings(counter_ptr + row, K, error_ptr, MAX_SPIN)
                    lse, entropy = _merged_state(state_row, K, K_LANES, COMPUTE_ENTROPY)
                target_logit = capped_logit(tl.load(row_ptr + target), softcap)
                logp = target_logit * inv_temperature - lse
            else:
                lse = 0.0
                entropy = 0.0
                target_logit = 0.0
                logp = 0.0
            loss, dloss, kl, flags = token_loss_at(
                row, logp, adv_ptr, old_ptr, ref_ptr, iw_ptr, loss_scalars, LOSS_KIND, KL_KIND, LOSS_FLAGS
            )
            if chunk == 0:
                tl.store(logp_out + row, logp)
                tl.store(lse_out + row, lse)
                if COMPUTE_ENTROPY:
                    tl.store(entropy_out + row, entropy)
                store_loss_terms(row, active, loss, dloss, kl, flags, loss_out, dloss_out, kl_out, flags_out)
            g = tl.where(active, dloss * tl.load(grad_weight_ptr + row), 0.0)
            h = 0.0
            if HAS_ENTROPY_GRAD:
                h = tl.where(active, tl.load(entropy_grad_ptr + row), 0.0)
            if HOLD_CHUNK:
                _write_held_gradient(
                    x2,
                    e,
                    held_max,
                    out_ptr,
                    c0,
                    c1 - c0,
                    lse,
                    target,
                    target_logit,
                    g,
                    inv_temperature,
                    softcap,
                    h,
                    entropy,
                    BLOCK_V,
                    HAS_ENTROPY_GRAD,
                )
            else:
                _write_chunk_gradient(
                    row_ptr,
                    out_ptr,
                    c0,
                    c1,
                    lse,
                    target,
                    g,
                    inv_temperature,
                    softcap,
                    h,
                    entropy,
                    BLOCK_V,
                    HAS_ENTROPY_GRAD,
                )
