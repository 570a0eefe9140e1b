"""Triton kernels of the GRPO loss from hidden states: the lm_head fused in, no [N, V] logits in memory.

x = cap(h @ W^T + b) / tau is computed one [BLOCK_N, BLOCK_V] tile at a time with ``tl.dot``
(16-bit or fp32 inputs, fp32 accumulation); cap is the head's soft-cap, softcap * tanh(. / softcap), where
``softcap`` is a number (Gemma's), else nothing (compiled out), as in ``token_math.py``.

Forward (``linear_grpo_forward_kernel``, a grid over blocks of BLOCK_N tokens): stream
the vocabulary tiles, keeping per-token online log-sum-exp, the target logit and (when
asked) the entropy sums; then, on the block's [BLOCK_N] vectors, the per-token loss of
every loss_type and its derivative dloss/dlogp (``token_math.token_loss_and_grad``, the same
function the logits kernel runs). The logits are never written. A block whose tokens
are all masked skips the vocabulary loop. When there are too few token blocks to fill
the GPU, the grid gets a second axis of vocabulary splits (SPLIT_V): each program keeps
its split's log-sum-exp state in a small [4, splits, N] buffer and
``linear_grpo_combine_kernel`` merges the splits and computes the loss terms.

Backward, one chunk of C tokens at a time (C from the launcher's workspace budget, so
the only V-sized buffer is the [C, V] workspace):

1. ``linear_dlogits_kernel`` (a 2-D tile grid): recompute the logits tile and write
   ``dx = g * (onehot - p) / tau`` (``g = dLoss/dlogp``) into the workspace, in the
   input dtype. Tiles whose tokens all have g == 0 (masked) write zeros, no product.
2. ``matmul_kernel``: d hidden[chunk] = dx @ W, and d weight += dx^T @ h[chunk], fp32
   accumulators, d weight accumulated in fp32 across chunks in place (each program owns
   its output tile: no atomics). A frozen weight (LoRA) skips the second product.

Without a gradient (evaluation, old log-probs) the 3-product mode's forward takes each tile of cuBLAS logits
([chunk, tile] of the vocabulary, a bounded workspace) through ``logits_tile_state_kernel``: each token's
log-sum-exp state over the tile and its target logit if the tile holds it, into the same [4, tiles, N]
partials, which ``linear_grpo_combine_kernel`` merges.

UPCAST (set only under TRITON_INTERPRET with bf16 inputs): Triton's interpreter multiplies
the bit patterns of bf16 ``tl.dot`` operands (triton-lang/triton#11584, "not supported"),
so there the operands are converted to fp32 first; compiled kernels use bf16 tensor cores.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .logsumexp import finite_or_zero, merge_lse, merge_sum_squares
from .split_row import _chunk_state
from .token_math import C_LOSS_NONE, LN2, LOG2E, cap_slope, capped_logit, token_loss_and_grad

# N (tokens) changes every step: no recompile for it. V and H are fixed by the model and
# stay specialized, so that Triton knows the rows are 16-byte aligned and issues wide,
# asynchronous (cp.async) loads into shared memory for the tensor cores.
LINEAR_RUNTIME_INTS = ["N"]


@triton.jit
def _logits_tile(
    h_block,
    w_block,
    b_ptr,
    n_left,
    v0,
    V,
    H,
    inv_temperature,
    softcap,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUND_LOGITS: tl.constexpr,
):
    """x = cap(h @ W^T + b) / tau as fp32 [BLOCK_N, BLOCK_V] for one tile; out-of-range columns are -inf. With
    ``ROUND_LOGITS`` (16-bit inputs) h @ W^T + b is rounded to the inputs' dtype first, as an unfused head in that
    dtype computes its logits (fp32 accumulation, one rounding), before the cap and the temperature.

    ``h_block`` and ``w_block`` point at the tile's first row of h and of W (int64 scalars);
    offsets inside the tile are int32, which halves the registers of the pointer tensors.
    """
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_V)
    ks = tl.arange(0, BLOCK_H)
    in_v = v0 + c < V
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        k = k0 + ks
        h = tl.load(h_block + r[:, None] * H + k[None, :], mask=(r[:, None] < n_left) & (k[None, :] < H), other=0.0)
        w = tl.load(w_block + c[:, None] * H + k[None, :], mask=in_v[:, None] & (k[None, :] < H), other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + v0 + c, mask=in_v, other=0.0).to(tl.float32)[None, :]
    if ROUND_LOGITS:
        if w_block.dtype.element_ty == tl.bfloat16:
            acc = rounded_to_bf16(acc)
        else:  # fp16: the conversion rounds to nearest even on every backend
            acc = acc.to(w_block.dtype.element_ty).to(tl.float32)
    return tl.where(in_v[None, :], capped_logit(acc, softcap) * inv_temperature, float("-inf"))


@triton.jit
def rounded_to_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 value, ties to even, as fp32: an integer rounding of its bits (add half
    an ulp of bf16, plus the kept mantissa's lowest bit for a tie, then drop the low 16 bits), which gives the same
    answer on every backend. A conversion would not: a GPU rounds to nearest even, Triton's interpreter truncates
    toward zero whatever ``fp_downcast_rounding`` says. NaN stays NaN; a value past bf16's largest becomes inf, as the
    hardware's rounding makes it."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _finish_tokens(
    rows,
    active,
    running_max,
    sum_exp,
    sum_exp_x,
    sum_sq,
    target_x,
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
    loss_scalars,
    LOSS_KIND: tl.constexpr,
    KL_KIND: tl.constexpr,
    LOSS_FLAGS: tl.constexpr,
):
    """From a token block's log-sum-exp state: store lse, logp, entropy, Σπ², then the per-token loss terms."""
    COMPUTE_ENTROPY: tl.constexpr = entropy_out is not None
    # Inactive rows (sum_exp may be 0 there) are stored as 0; a 0 lse also keeps the
    # backward's exp(x - lse) finite for them.
    sum_exp = tl.where(active, sum_exp, 1.0)
    lse = tl.where(active, running_max + tl.log(sum_exp), 0.0)
    in_rows = rows < N
    entropy = lse - sum_exp_x / sum_exp
    logp_lse = lse
    if kept_lse_ptr is not None:  # the sampler's kept set: its log-sum-exp where the token uses it (else +inf)
        kept_lse = tl.load(kept_lse_ptr + rows, mask=in_rows, other=float("inf"))
        in_set = kept_lse < float("inf")
        logp_lse = tl.where(in_set, kept_lse, lse)
        if kept_entropy_ptr is not None:
            entropy = tl.where(in_set, tl.load(kept_entropy_ptr + rows, mask=in_rows, other=0.0), entropy)
    logp = tl.where(active, target_x - logp_lse, 0.0)
    tl.store(lse_out + rows, lse, mask=in_rows)
    tl.store(logp_out + rows, logp, mask=in_rows)
    if COMPUTE_ENTROPY:
        tl.store(entropy_out + rows, tl.where(active, entropy, 0.0), mask=in_rows)
    if sum_squares_out is not None:  # sum exp(2 (x - max)) over (sum exp(x - max))^2
        tl.store(sum_squares_out + rows, tl.where(active, sum_sq / (sum_exp * sum_exp), 0.0), mask=in_rows)

    if LOSS_KIND != C_LOSS_NONE:
        old = None
        ref = None
        iw = None
        if old_ptr is not None:
            old = tl.load(old_ptr + rows, mask=active, other=0.0)
        if ref_ptr is not None:
            ref = tl.load(ref_ptr + rows, mask=active, other=0.0)
        if iw_ptr is not None:
            iw = tl.load(iw_ptr + rows, mask=active, other=0.0)
        loss, dloss, kl, flags = token_loss_and_grad(
            logp,
            tl.load(adv_ptr + rows, mask=active, other=0.0),
            old,
            ref,
            iw,
            loss_scalars,
            LOSS_KIND,
            KL_KIND,
            LOSS_FLAGS,
        )
        if kl_out is not None:
            tl.store(kl_out + rows, tl.where(active, kl, 0.0), mask=in_rows)
        tl.store(loss_out + rows, tl.where(active, loss, 0.0), mask=in_rows)
        tl.store(dloss_out + rows, tl.where(active, dloss, 0.0), mask=in_rows)
        tl.store(flags_out + rows, tl.where(active, flags, 0).to(tl.int8), mask=in_rows)


@triton.jit
def _active_rows(rows, N, mask_ptr):
    """Rows inside [0, N) and not masked (``mask_ptr`` None: no mask): masked tokens are computed with their
    block but read as 0."""
    active = rows < N
    if mask_ptr is not None:
        active = active & (tl.load(mask_ptr + rows, mask=active, other=0.0) != 0.0)
    return active


@triton.jit(do_not_specialize=LINEAR_RUNTIME_INTS)
def linear_grpo_forward_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    ids_ptr,
    N,
    V,
    H,
    v_per_split,
    partials_ptr,
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
    inv_temperature,
    softcap,
    loss_scalars,
    LOSS_KIND: tl.constexpr,
    KL_KIND: tl.constexpr,
    LOSS_FLAGS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUND_LOGITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Grid (token blocks, vocabulary splits). With ``partials_ptr`` None one split covers V and the program
    finishes its tokens; else (SPLIT_V) it stores its split's (max, sum exp, sum exp * x, target x, and with Σπ²
    sum exp(2 (x - max))) in ``partials`` [4 or 5, splits, N] for ``linear_grpo_combine_kernel``. Optional tensors
    (``b_ptr`` the bias, the per-token inputs, ``entropy_out``, ``sum_squares_out``) are None where absent."""
    HAS_BIAS: tl.constexpr = b_ptr is not None
    SPLIT_V: tl.constexpr = partials_ptr is not None
    COMPUTE_ENTROPY: tl.constexpr = entropy_out is not None
    COMPUTE_SUMSQ: tl.constexpr = sum_squares_out is not None
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    first = pid * BLOCK_N
    rows = first + tl.arange(0, BLOCK_N)
    active = _active_rows(rows, N, mask_ptr)
    n_left = N - first
    h_block = h_ptr + first * H
    stride_w = tl.cast(H, tl.int64)  # V * H may pass 2^31
    target = tl.load(ids_ptr + rows, mask=active, other=0).to(tl.int32)
    running_max = tl.full([BLOCK_N], float("-inf"), tl.float32)
    sum_exp = tl.zeros([BLOCK_N], dtype=tl.float32)
    sum_exp_x = tl.zeros([BLOCK_N], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_N], dtype=tl.float32)
    target_x = tl.zeros([BLOCK_N], dtype=tl.float32)
    v_start = split * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    if tl.max(active.to(tl.int32), axis=0) > 0:  # a block of padding costs no products
        for v0 in range(v_start, v_end, BLOCK_V):
            x = _logits_tile(
                h_block,
                w_ptr + v0 * stride_w,
                b_ptr,
                n_left,
                v0,
                V,
                H,
                inv_temperature,
                softcap,
                HAS_BIAS,
                BLOCK_N,
                BLOCK_V,
                BLOCK_H,
                DOT_PRECISION,
                UPCAST,
                ROUND_LOGITS,
            )  # [BLOCK_N, BLOCK_V]
            cols = v0 + tl.arange(0, BLOCK_V)
            target_x += tl.sum(tl.where(cols[None, :] == target[:, None], x, 0.0), axis=1)
            new_max = tl.maximum(running_max, tl.max(x, axis=1))
            e = tl.exp(x - finite_or_zero(new_max)[:, None])  # the tile, already at the running max
            tile_x = tl.sum(e * tl.where(e > 0.0, x, 0.0), axis=1) if COMPUTE_ENTROPY else sum_exp_x
            if COMPUTE_SUMSQ:
                sum_sq = merge_sum_squares(running_max, sum_sq, new_max, tl.sum(e * e, axis=1))
            running_max, sum_exp, sum_exp_x = merge_lse(
                running_max, sum_exp, sum_exp_x, new_max, tl.sum(e, axis=1), tile_x, COMPUTE_ENTROPY, BASE2=False
            )
    if SPLIT_V:
        stride_split = tl.num_programs(1).to(tl.int64) * N
        out = partials_ptr + split.to(tl.int64) * N + rows
        in_rows = rows < N
        tl.store(out, running_max, mask=in_rows)
        tl.store(out + stride_split, sum_exp, mask=in_rows)
        tl.store(out + 2 * stride_split, sum_exp_x, mask=in_rows)
        tl.store(out + 3 * stride_split, target_x, mask=in_rows)
        if COMPUTE_SUMSQ:
            tl.store(out + 4 * stride_split, sum_sq, mask=in_rows)
    else:
        _finish_tokens(
            rows,
            active,
            running_max,
            sum_exp,
            sum_exp_x,
            sum_sq,
            target_x,
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
            loss_scalars,
            LOSS_KIND,
            KL_KIND,
            LOSS_FLAGS,
        )


@triton.jit(do_not_specialize=["N", "splits"])
def linear_grpo_combine_kernel(
    partials_ptr,
    N,
    splits,
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
    loss_scalars,
    LOSS_KIND: tl.constexpr,
    KL_KIND: tl.constexpr,
    LOSS_FLAGS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Merge the vocabulary splits' log-sum-exp states of a token block, then finish its tokens."""
    COMPUTE_ENTROPY: tl.constexpr = entropy_out is not None
    COMPUTE_SUMSQ: tl.constexpr = sum_squares_out is not None
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < N
    active = _active_rows(rows, N, mask_ptr)
    stride_split = tl.cast(splits, tl.int64) * N
    running_max = tl.full([BLOCK_N], float("-inf"), tl.float32)
    sum_exp = tl.zeros([BLOCK_N], dtype=tl.float32)
    sum_exp_x = tl.zeros([BLOCK_N], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_N], dtype=tl.float32)
    target_x = tl.zeros([BLOCK_N], dtype=tl.float32)
    for split in range(0, splits):
        part = partials_ptr + tl.cast(split, tl.int64) * N + rows
        part_x = tl.load(part + 2 * stride_split, mask=in_rows, other=0.0) if COMPUTE_ENTROPY else sum_exp_x
        part_max = tl.load(part, mask=in_rows, other=float("-inf"))
        if COMPUTE_SUMSQ:
            part_sq = tl.load(part + 4 * stride_split, mask=in_rows, other=0.0)
            sum_sq = merge_sum_squares(running_max, sum_sq, part_max, part_sq)
        running_max, sum_exp, sum_exp_x = merge_lse(
            running_max,
            sum_exp,
            sum_exp_x,
            part_max,
            tl.load(part + stride_split, mask=in_rows, other=0.0),
            part_x,
            COMPUTE_ENTROPY,
            BASE2=False,
        )
        target_x += tl.load(part + 3 * stride_split, mask=in_rows, other=0.0)  # 0 outside the target's split
    _finish_tokens(
        rows,
        active,
        running_max,
        sum_exp,
        sum_exp_x,
        sum_sq,
        target_x,
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
        loss_scalars,
        LOSS_KIND,
        KL_KIND,
        LOSS_FLAGS,
    )


@triton.jit(do_not_specialize=["stride_n", "V", "v0", "state_stride"])
def logits_tile_state_kernel(
    logits_ptr,
    stride_n,
    ids_ptr,
    mask_ptr,
    V,
    v0,
    states_ptr,
    state_stride,
    inv_temperature,
    softcap,
    COMPUTE_ENTROPY: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """One program a token of a vocabulary tile of logits (``logits_ptr``: [chunk, V] rows ``stride_n`` apart, the
    tile's columns v0 .. v0 + V of the vocabulary): the token's log-sum-exp state over the tile in natural units
    (max, sum exp(x - max), sum exp(x - max) x of x = cap(logit) / tau) and its target's x where the tile holds the
    target (else 0), stored at ``states_ptr`` + token, the four ``state_stride`` apart (``linear_grpo_combine_kernel``'s
    partials at this tile). A masked token (``mask_ptr``, None: none) is not read: (-inf, 0, 0, 0)."""
    pid = tl.program_id(0).to(tl.int64)
    active = True
    if mask_ptr is not None:
        active = tl.load(mask_ptr + pid) != 0.0
    tile_max = float("-inf")
    sum_exp = 0.0
    sum_exp_x = 0.0
    target_x = 0.0
    if active:
        row_ptr = logits_ptr + tl.multiple_of(pid * stride_n, ROW_ALIGN)
        max2, sum_exp, sum_x2 = _chunk_state(row_ptr, 0, V, inv_temperature * LOG2E, softcap, BLOCK_V, COMPUTE_ENTROPY)
        tile_max = max2 * LN2  # base 2 to natural: 2^(x2 - max2) is exp(x - max), and x2 ln 2 is x
        sum_exp_x = sum_x2 * LN2
        local = tl.load(ids_ptr + pid).to(tl.int64) - v0
        if (local >= 0) & (local < V):
            target_x = capped_logit(tl.load(row_ptr + local), softcap) * inv_temperature
    out = states_ptr + pid
    tl.store(out, tile_max)
    tl.store(out + state_stride, sum_exp)
    tl.store(out + 2 * state_stride, sum_exp_x)
    tl.store(out + 3 * state_stride, target_x)


@triton.jit(do_not_specialize=LINEAR_RUNTIME_INTS)
def linear_dlogits_kernel(
    h_ptr,
    w_ptr,
    b_ptr,
    ids_ptr,
    N,
    V,
    H,
    lse_ptr,
    g_ptr,
    dx_ptr,
    inv_temperature,
    softcap,
    grad_entropy_ptr,
    entropy_ptr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUND_LOGITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """dx [N, V] (row stride V) = g * (onehot - softmax(x)) / tau, x recomputed, times the soft-cap's chain factor
    1 - tanh^2 where ``softcap`` is a number; N is one chunk's tokens.

    ``grad_entropy_ptr`` and ``entropy_ptr`` (None without the entropy bonus) add h = dLoss/dH (per token)
    times dH/dz = -p (log p + H), with the forward's entropy H: the entropy bonus's gradient. ``b_ptr`` is
    None without a bias.

    Programs run token blocks fastest, so the programs in flight share one W tile (read
    from HBM once) and re-read the chunk's hidden states from L2.
    """
    HAS_BIAS: tl.constexpr = b_ptr is not None
    HAS_ENTROPY_GRAD: tl.constexpr = grad_entropy_ptr is not None
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_N)
    pid_v = pid // blocks_n
    first = (pid - pid_v * blocks_n).to(tl.int64) * BLOCK_N
    v0 = pid_v.to(tl.int64) * BLOCK_V
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_V)
    n_left = N - first
    in_rows = r < n_left
    in_v = v0 + c < V
    g = tl.load(g_ptr + first + r, mask=in_rows, other=0.0)
    live = in_rows & (g != 0.0)
    h = tl.zeros([BLOCK_N], dtype=tl.float32)
    entropy = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_ENTROPY_GRAD:
        h = tl.load(grad_entropy_ptr + first + r, mask=in_rows, other=0.0)
        entropy = tl.load(entropy_ptr + first + r, mask=in_rows, other=0.0)
        live = in_rows & ((g != 0.0) | (h != 0.0))
    dx_block = dx_ptr + first * V + v0
    out_mask = in_rows[:, None] & in_v[None, :]
    if tl.max(live.to(tl.int32), axis=0) > 0:
        lse = tl.load(lse_ptr + first + r, mask=in_rows, other=0.0)
        target = tl.load(ids_ptr + first + r, mask=in_rows, other=-1).to(tl.int32)
        x = _logits_tile(
            h_ptr + first * H,
            w_ptr + v0 * H,
            b_ptr,
            n_left,
            v0,
            V,
            H,
            inv_temperature,
            softcap,
            HAS_BIAS,
            BLOCK_N,
            BLOCK_V,
            BLOCK_H,
            DOT_PRECISION,
            UPCAST,
            ROUND_LOGITS,
        )
        p = tl.exp(x - lse[:, None])  # 0 in out-of-range columns (x = -inf)
        onehot = tl.where((v0 + c)[None, :] == target[:, None], 1.0, 0.0)
        dx = (g * inv_temperature)[:, None] * (onehot - p)
        if HAS_ENTROPY_GRAD:  # p = 0 (a -inf or out-of-range column) adds 0, not 0 * -inf
            log_p = tl.where(p > 0.0, x - lse[:, None], 0.0)
            dx -= (h * inv_temperature)[:, None] * p * (log_p + entropy[:, None])
        if softcap is not None:  # out-of-range columns (x = -inf) turn NaN here; they are never stored
            dx = dx * cap_slope(x, inv_temperature, softcap)
        dx = tl.where(live[:, None], dx, 0.0)
        tl.store(dx_block + r[:, None] * V + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=out_mask)
    else:
        zeros = tl.zeros([BLOCK_N, BLOCK_V], dtype=dx_ptr.dtype.element_ty)
        tl.store(dx_block + r[:, None] * V + c[None, :], zeros, mask=out_mask)


@triton.jit(do_not_specialize=["M", "K"])  # the chunk's token count is M or K; strides of 1 specialize
def matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    ACCUMULATE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """c [M, N] (fp32, contiguous) = (c if ACCUMULATE else 0) + a [M, K] @ b [K, N], fp32 accumulation.

    a and b are read through their strides (d weight reads the workspace transposed).
    Programs go in groups of GROUP_M row blocks so that neighbours share b tiles in L2.
    Each program owns its output tile, so accumulating into c needs no atomics.
    """
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    blocks_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * blocks_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * blocks_n)) % group_size
    pid_n = (pid % (GROUP_M * blocks_n)) // group_size
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # int64 strides: the pointers step by BLOCK_K * stride, which passes 2^31 elements at V * H
    a_tile = a_ptr + m[:, None].to(tl.int64) * stride_am + ks[None, :].to(tl.int64) * stride_ak
    b_tile = b_ptr + ks[:, None].to(tl.int64) * stride_bk + n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_tile, mask=(m[:, None] < M) & (k0 + ks[None, :] < K), other=0.0)
        b = tl.load(b_tile, mask=(k0 + ks[:, None] < K) & (n[None, :] < N), other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_tile += BLOCK_K * stride_ak
        b_tile += BLOCK_K * stride_bk
    c_tile = c_ptr + m[:, None].to(tl.int64) * N + n[None, :]
    out_mask = (m[:, None] < M) & (n[None, :] < N)
    if ACCUMULATE:
        acc += tl.load(c_tile, mask=out_mask, other=0.0)
    tl.store(c_tile, acc, mask=out_mask)
