"""Triton kernels of the log-prob stage from hidden states: the lm_head fused in, no [N, V] logits in memory.

x = (h @ W^T + b) / tau is computed one [BLOCK_N, BLOCK_V] tile at a time with ``tl.dot``
(16-bit or fp32 inputs, fp32 accumulation) and never written out.

Forward (``linear_logprob_forward_kernel``, a 1-D grid over blocks of BLOCK_N tokens):
stream the vocabulary tiles, keeping per-token online log-sum-exp, the target logit and
(when asked) the entropy sums; write lse, logp and entropy in fp32.

Backward (``linear_logprob_backward_kernel``, a 1-D grid over (token block, vocabulary
block) tiles): recompute the tile's logits, ``dx = g * (onehot - p) / tau`` with
``g = dLoss/dlogp``, then add ``dx @ W`` into d hidden and ``dx^T @ h`` into d weight (and
``sum dx`` into d bias) with fp32 atomics, one BLOCK_H slice at a time. d weight is skipped
for a frozen weight (LoRA). Workspace: the fp32 gradient buffers, nothing of size N x V.

UPCAST (set only under TRITON_INTERPRET with bf16 inputs): Triton's interpreter multiplies
the bit patterns of bf16 ``tl.dot`` operands (triton-lang/triton#11584, "not supported"),
so there the operands are converted to fp32 first; compiled kernels use bf16 tensor cores.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .grpo import RUNTIME_INTS

LINEAR_RUNTIME_INTS = RUNTIME_INTS + ["N", "H"]


@triton.jit
def _logits_tile(h_block, w_block, b_ptr, n_left, v0, V, H, inv_temperature,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """x = (h @ W^T + b) / tau as fp32 [BLOCK_N, BLOCK_V] for one tile; out-of-range columns are -inf.

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
    return tl.where(in_v[None, :], acc * inv_temperature, float("-inf"))


@triton.jit(do_not_specialize=LINEAR_RUNTIME_INTS)
def linear_logprob_forward_kernel(
    h_ptr, w_ptr, b_ptr, ids_ptr, N, V, H,
    lse_out, logp_out, entropy_out, inv_temperature,
    HAS_BIAS: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    first = pid * BLOCK_N
    rows = first + tl.arange(0, BLOCK_N)
    in_rows = rows < N
    n_left = N - first
    h_block = h_ptr + first * H
    stride_w = tl.cast(H, tl.int64)  # V * H may pass 2^31
    target = tl.load(ids_ptr + rows, mask=in_rows, other=0).to(tl.int32)
    running_max = tl.full([BLOCK_N], float("-inf"), tl.float32)
    sum_exp = tl.zeros([BLOCK_N], dtype=tl.float32)
    sum_exp_x = tl.zeros([BLOCK_N], dtype=tl.float32)
    target_x = tl.zeros([BLOCK_N], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        x = _logits_tile(h_block, w_ptr + v0 * stride_w, b_ptr, n_left, v0, V, H, inv_temperature,
                         HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, UPCAST)  # [BLOCK_N, BLOCK_V]
        cols = v0 + tl.arange(0, BLOCK_V)
        target_x += tl.sum(tl.where(cols[None, :] == target[:, None], x, 0.0), axis=1)
        new_max = tl.maximum(running_max, tl.max(x, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(running_max - safe_max)
        e = tl.exp(x - safe_max[:, None])
        sum_exp = sum_exp * rescale + tl.sum(e, axis=1)
        if COMPUTE_ENTROPY:
            sum_exp_x = sum_exp_x * rescale + tl.sum(e * tl.where(e > 0.0, x, 0.0), axis=1)
        running_max = new_max
    lse = running_max + tl.log(sum_exp)
    tl.store(lse_out + rows, lse, mask=in_rows)
    tl.store(logp_out + rows, target_x - lse, mask=in_rows)
    if COMPUTE_ENTROPY:
        tl.store(entropy_out + rows, lse - sum_exp_x / sum_exp, mask=in_rows)


@triton.jit(do_not_specialize=LINEAR_RUNTIME_INTS)
def linear_logprob_backward_kernel(
    h_ptr, w_ptr, b_ptr, ids_ptr, N, V, H,
    lse_ptr, g_ptr, dh_ptr, dw_ptr, db_ptr, inv_temperature,
    HAS_BIAS: tl.constexpr, COMPUTE_DW: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    blocks_v = tl.cdiv(V, BLOCK_V)
    pid_n = pid // blocks_v
    first = pid_n * BLOCK_N
    v0 = (pid - pid_n * blocks_v) * BLOCK_V
    r = tl.arange(0, BLOCK_N)
    c = tl.arange(0, BLOCK_V)
    n_left = N - first
    in_rows = r < n_left
    in_v = v0 + c < V
    g = tl.load(g_ptr + first + r, mask=in_rows, other=0.0)
    if tl.max(tl.abs(g), axis=0) > 0.0:  # a block of masked tokens contributes nothing
        h_block = h_ptr + first * H
        w_block = w_ptr + v0 * H
        lse = tl.load(lse_ptr + first + r, mask=in_rows, other=0.0)
        target = tl.load(ids_ptr + first + r, mask=in_rows, other=-1).to(tl.int32)
        x = _logits_tile(h_block, w_block, b_ptr, n_left, v0, V, H, inv_temperature,
                         HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_H, DOT_PRECISION, UPCAST)
        p = tl.exp(x - lse[:, None])  # 0 in out-of-range columns (x = -inf)
        onehot = tl.where((v0 + c)[None, :] == target[:, None], 1.0, 0.0)
        dx = (g * inv_temperature)[:, None] * (onehot - p)  # [BLOCK_N, BLOCK_V] fp32
        dx = tl.where(in_rows[:, None] & in_v[None, :], dx, 0.0)
        dx_in = dx.to(h_ptr.dtype.element_ty)  # the products run in the input dtype, fp32 accumulation
        if UPCAST:
            dx_in = dx_in.to(tl.float32)
        ks = tl.arange(0, BLOCK_H)
        for k0 in range(0, H, BLOCK_H):
            k = k0 + ks
            in_k = k < H
            w = tl.load(w_block + c[:, None] * H + k[None, :], mask=in_v[:, None] & in_k[None, :], other=0.0)
            if UPCAST:
                w = w.to(tl.float32)
            dh = tl.dot(dx_in, w, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_H]
            tl.atomic_add(dh_ptr + first * H + r[:, None] * H + k[None, :], dh, mask=in_rows[:, None] & in_k[None, :])
            if COMPUTE_DW:
                h = tl.load(h_block + r[:, None] * H + k[None, :], mask=in_rows[:, None] & in_k[None, :], other=0.0)
                if UPCAST:
                    h = h.to(tl.float32)
                dw = tl.dot(tl.trans(dx_in), h, input_precision=DOT_PRECISION)  # [BLOCK_V, BLOCK_H]
                tl.atomic_add(dw_ptr + v0 * H + c[:, None] * H + k[None, :], dw, mask=in_v[:, None] & in_k[None, :])
        if HAS_BIAS and COMPUTE_DW:
            tl.atomic_add(db_ptr + v0 + c, tl.sum(dx, axis=0), mask=in_v)
