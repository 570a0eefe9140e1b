"""Triton kernels of the sampler's kept set (top-k / top-p replay): each generated token's log-prob renormalized over
the vocabulary ids the sampler's truncation kept, log softmax over the set of x = cap(logits) / tau.

The set is an input of every log-prob pass, beside the logits' full pass, never a mask over the [N, V] logits. Each
token's set is given either as CSR (``kept_ids`` [nnz], ``kept_offsets`` [N + 1]: vLLM's form) or padded
(``kept_ids`` [N, K], a negative id for no entry: prime-rl's form). Two kernels, a program a token, each reading
only the set's O(K) entries:

- ``kept_state_kernel``: gathers the set's logits from the token's row (the ids that fall in this process's
  vocabulary slice ``[col0, col0 + width)``), or from hidden states computes each as the dot product of the token's
  hidden state and the entry's weight row (length H, rounded as the head rounds its logits: no [N, V]); stores each
  entry's x (``kept_x``: -inf for no entry) and the set's log-sum-exp state (max, sum exp(x - max), sum exp(x - max)
  x, sum exp(2 (x - max))), the count of its entries here, whether the target is among them, and the target's own x
  where this slice holds it.
- ``kept_gradient_kernel``: after the dense gradient was written with the policy term's (and, where the entropy is
  the set's, the entropy's) share taken out for a set's token, writes each entry's final gradient,
  (g (onehot - q) + the entropy terms) / tau, q = exp(x - lse over the set), at its column (if the slice holds it).

The per-token state is finished on the host (``kept_set.finish``: the set's log-sum-exp, entropy and Σπ², after an
all-reduce across a vocabulary split), so that one kernel serves one process and a vocabulary split alike.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fused_linear import rounded_to_bf16
from .logsumexp import finite_or_zero
from .token_math import capped_logit

# The entries a program takes at a time (a token's set: tens to thousands of ids)
KEPT_BLOCK = tl.constexpr(64)
KEPT_RUNTIME_INTS = ["T", "H", "N", "stride_b", "stride_t", "col0", "width", "n0"]


@triton.jit
def _entries(pid, offsets_ptr, WIDTH: tl.constexpr):
    """(first entry, end) of token ``pid``'s set: a CSR row, or the padded form's row of WIDTH entries."""
    if offsets_ptr is not None:
        return tl.load(offsets_ptr + pid).to(tl.int64), tl.load(offsets_ptr + pid + 1).to(tl.int64)
    return pid * WIDTH, pid * WIDTH + WIDTH


@triton.jit
def _fold_block(x, m, s, t, q, COMPUTE_ENTROPY: tl.constexpr, COMPUTE_SUMSQ: tl.constexpr):
    """A block of entries' x (-inf: no entry) folded into the set's running state (natural units)."""
    new_max = tl.maximum(m, tl.max(x, axis=0))
    offset = finite_or_zero(new_max)
    e = tl.exp(x - offset)
    scale = tl.exp(m - offset)  # (0 while m is -inf)
    s = s * scale + tl.sum(e, axis=0)
    if COMPUTE_ENTROPY:
        t = t * scale + tl.sum(e * tl.where(e > 0.0, x, 0.0), axis=0)  # (0 * -inf is nan: x is 0 there)
    if COMPUTE_SUMSQ:
        q = q * scale * scale + tl.sum(e * e, axis=0)
    return new_max, s, t, q


@triton.jit
def _store_state(
    pid, N, state_ptr, m, s, t, q, count, found, target_x, COMPUTE_ENTROPY: tl.constexpr, COMPUTE_SUMSQ: tl.constexpr
):
    """The token's state in ``state_ptr``'s rows ([7, N] fp32): max, sum exp(x - max), sum exp(x - max) x, sum
    exp(2 (x - max)), the entries here, whether the target is among them (0 / 1), the target's x where this slice
    holds it (else 0)."""
    tl.store(state_ptr + pid, m)
    tl.store(state_ptr + N + pid, s)
    if COMPUTE_ENTROPY:
        tl.store(state_ptr + 2 * N + pid, t)
    if COMPUTE_SUMSQ:
        tl.store(state_ptr + 3 * N + pid, q)
    tl.store(state_ptr + 4 * N + pid, count)
    tl.store(state_ptr + 5 * N + pid, found)
    tl.store(state_ptr + 6 * N + pid, target_x)


@triton.jit
def _head_logits(h_row, w_ptr, b_ptr, v, here, H, BLOCK_H: tl.constexpr, ROUND_LOGITS: tl.constexpr):
    """cap-free logits h . W[v] + b[v] of a block of entries (fp32 accumulation, rounded as the head rounds them)."""
    ks = tl.arange(0, BLOCK_H)
    acc = tl.zeros([KEPT_BLOCK], tl.float32)
    for k0 in range(0, H, BLOCK_H):
        k = k0 + ks
        h = tl.load(h_row + k, mask=k < H, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + v[:, None] * H + k[None, :], mask=here[:, None] & (k[None, :] < H), other=0.0)
        acc += tl.sum(w.to(tl.float32) * h[None, :], axis=1)
    if b_ptr is not None:
        acc += tl.load(b_ptr + v, mask=here, other=0.0).to(tl.float32)
    if ROUND_LOGITS:
        if w_ptr.dtype.element_ty == tl.bfloat16:
            acc = rounded_to_bf16(acc)
        else:
            acc = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
    return acc


@triton.jit
def _entry_x(row_ptr, h_row, w_ptr, b_ptr, local, here, H, inv_temperature, softcap, BLOCK_H: tl.constexpr,
             ROUND_LOGITS: tl.constexpr):  # fmt: skip
    """x = cap(logit) / tau of a block of entries (local columns ``local`` where ``here``, else -inf): gathered from
    the token's row of logits, or, with a head (``w_ptr``), each its own dot product."""
    if w_ptr is not None:
        raw = _head_logits(h_row, w_ptr, b_ptr, local, here, H, BLOCK_H, ROUND_LOGITS)
    else:
        raw = tl.load(row_ptr + local, mask=here, other=0.0)
    return tl.where(here, capped_logit(raw, softcap) * inv_temperature, float("-inf"))


@triton.jit(do_not_specialize=KEPT_RUNTIME_INTS)
def kept_state_kernel(
    logits_ptr,
    stride_b,
    stride_t,
    T,
    h_ptr,
    w_ptr,
    b_ptr,
    H,
    N,
    ids_ptr,
    mask_ptr,
    kept_ids_ptr,
    kept_offsets_ptr,
    kept_x_ptr,
    state_ptr,
    col0,
    width,
    inv_temperature,
    softcap,
    WIDTH: tl.constexpr,
    COMPUTE_ENTROPY: tl.constexpr,
    COMPUTE_SUMSQ: tl.constexpr,
    ROUND_LOGITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """A program a token: its set's state (``_store_state``) and each entry's x, from logits [B, T, width] (strides
    ``stride_b``, ``stride_t``, 1; a vocabulary slice from global id ``col0``), or, with the head (``w_ptr``: the
    weight [width, H] of that slice, ``h_ptr`` the hidden states [N, H], ``b_ptr`` the bias or None; ``logits_ptr``
    None), each entry's logit its own dot product: never an [N, V] tensor. A masked token (``mask_ptr``) is not
    read: an empty state, its entries' x the launcher's -inf."""
    pid = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr
    h_row = h_ptr
    if w_ptr is not None:
        h_row = h_ptr + pid * H
    else:
        b = pid // T
        row_ptr = logits_ptr + b * stride_b + (pid - b * T) * stride_t
    first, end = _entries(pid, kept_offsets_ptr, WIDTH)
    target = tl.load(ids_ptr + pid).to(tl.int64)
    owned = (target >= col0) & (target < col0 + width)
    if mask_ptr is not None:
        if tl.load(mask_ptr + pid) == 0.0:  # a masked token is not read (its entries' x stay the launcher's -inf)
            end = first
            owned = False
    lanes = tl.arange(0, KEPT_BLOCK)
    m = float("-inf")
    s = 0.0
    t = 0.0
    q = 0.0
    count = 0
    found = 0
    for start in range(first, end, KEPT_BLOCK):
        e = start + lanes
        in_set = e < end
        v = tl.load(kept_ids_ptr + e, mask=in_set, other=-1).to(tl.int64)
        here = in_set & (v >= col0) & (v < col0 + width)
        x = _entry_x(
            row_ptr, h_row, w_ptr, b_ptr, tl.where(here, v - col0, 0), here, H, inv_temperature, softcap, BLOCK_H,
            ROUND_LOGITS,
        )  # fmt: skip
        tl.store(kept_x_ptr + e, x, mask=in_set)
        m, s, t, q = _fold_block(x, m, s, t, q, COMPUTE_ENTROPY, COMPUTE_SUMSQ)
        count += tl.sum(here.to(tl.int32), axis=0)
        found = tl.maximum(found, tl.max((here & (v == target)).to(tl.int32), axis=0))
    target_x = 0.0
    if owned:  # the target's own x, in lane 0 of a block
        one = lanes == 0
        x = _entry_x(
            row_ptr, h_row, w_ptr, b_ptr, tl.where(one, target - col0, 0), one, H, inv_temperature, softcap, BLOCK_H,
            ROUND_LOGITS,
        )  # fmt: skip
        target_x = tl.sum(tl.where(one, x, 0.0), axis=0)
    _store_state(pid, N, state_ptr, m, s, t, q, count, found, target_x, COMPUTE_ENTROPY, COMPUTE_SUMSQ)


@triton.jit
def _entry_gradient(x, lead, g, h, lse, entropy, kept_lse, kept_entropy, inv_temperature, softcap,
                    HAS_H: tl.constexpr, KEPT_ENTROPY: tl.constexpr):  # fmt: skip
    """The gradient at an entry of logit x (natural units, already / tau): (lead - g q + the entropy terms) / tau,
    q = exp(x - kept_lse), times the soft-cap's chain factor. A kept set's entry: lead = g onehot (so g (onehot - q)),
    kept_lse the set's; a top-k entry (distillation): lead the entry's own sum, kept_lse the whole vocabulary's. The
    entropy's terms are the full distribution's (p = exp(x - lse), -h p (log p + H)) or, with KEPT_ENTROPY, the
    set's (-h q (log q + H_set))."""
    q = tl.exp(x - kept_lse)
    value = lead - g * q
    if HAS_H:
        if KEPT_ENTROPY:
            value -= h * q * tl.where(q > 0.0, x - kept_lse + kept_entropy, 0.0)
        else:
            p = tl.exp(x - lse)
            value -= h * p * tl.where(p > 0.0, x - lse + entropy, 0.0)
    value = value * inv_temperature
    if softcap is not None:
        capped = x / inv_temperature
        value = value * (1.0 - (capped / softcap) * (capped / softcap))
    return value


@triton.jit(do_not_specialize=KEPT_RUNTIME_INTS)
def kept_gradient_kernel(
    out_ptr,
    stride_b,
    stride_t,
    T,
    n0,
    ids_ptr,
    kept_ids_ptr,
    kept_offsets_ptr,
    kept_x_ptr,
    kept_lse_ptr,
    target_x_ptr,
    found_ptr,
    g_ptr,
    h_ptr,
    lse_ptr,
    entropy_ptr,
    kept_entropy_ptr,
    lead_ptr,
    col0,
    width,
    inv_temperature,
    softcap,
    WIDTH: tl.constexpr,
    ADD_TARGET: tl.constexpr,
    KEPT_ENTROPY: tl.constexpr,
):
    """A program a row of the gradient ``out`` ([rows, width] by (stride_b, stride_t) as [B, T] rows; its token
    ``n0 + row``; columns from global id ``col0``): where the token's set is used (``kept_lse`` finite) its
    entries' final gradient overwrites the dense one (``_entry_gradient``), and with ADD_TARGET the target's where
    the set lacks it. The gradient's own per-token inputs are the rows' (``g``; ``h``, the entropy bonus's dLoss/dH,
    None without one; the full distribution's ``lse`` and ``entropy``, read where the entropy term is the full
    distribution's), the set's terms the tokens' (``ids``, the sets, ``kept_*``, ``target_x``, ``found``). With
    ``lead_ptr`` (one float an entry) an entry's gradient is (lead - g q) / tau, q over ``kept_lse`` (the top-k
    distillation's: ``kept_lse`` the whole vocabulary's log-sum-exp, ``lead`` the sum of dLoss/dlog q over the
    token's entries with that id)."""
    HAS_H: tl.constexpr = h_ptr is not None
    row = tl.program_id(0).to(tl.int64)
    pid = n0 + row
    kept_lse = tl.load(kept_lse_ptr + pid)
    if kept_lse < float("inf"):
        b = row // T
        out_row = out_ptr + b * stride_b + (row - b * T) * stride_t
        target = tl.load(ids_ptr + pid).to(tl.int64)
        g = tl.load(g_ptr + row)
        h = 0.0
        lse = 0.0
        entropy = 0.0
        kept_entropy = 0.0
        if HAS_H:
            h = tl.load(h_ptr + row)
            if KEPT_ENTROPY:
                kept_entropy = tl.load(kept_entropy_ptr + pid)
            else:
                lse = tl.load(lse_ptr + row)
                entropy = tl.load(entropy_ptr + row)
        first, end = _entries(pid, kept_offsets_ptr, WIDTH)
        lanes = tl.arange(0, KEPT_BLOCK)
        for start in range(first, end, KEPT_BLOCK):
            e = start + lanes
            in_set = e < end
            v = tl.load(kept_ids_ptr + e, mask=in_set, other=-1).to(tl.int64)
            here = in_set & (v >= col0) & (v < col0 + width)
            x = tl.load(kept_x_ptr + e, mask=here, other=float("-inf"))
            if lead_ptr is not None:
                lead = tl.load(lead_ptr + e, mask=here, other=0.0)
            else:
                lead = g * tl.where(v == target, 1.0, 0.0)
            value = _entry_gradient(
                x, lead, g, h, lse, entropy, kept_lse, kept_entropy, inv_temperature, softcap, HAS_H, KEPT_ENTROPY
            )
            tl.store(out_row + (v - col0), value.to(out_ptr.dtype.element_ty), mask=here)
        if ADD_TARGET:
            if (tl.load(found_ptr + pid) == 0) & (target >= col0) & (target < col0 + width):
                x = tl.load(target_x_ptr + pid)
                value = _entry_gradient(
                    x, g, g, h, lse, entropy, kept_lse, kept_entropy, inv_temperature, softcap, HAS_H, KEPT_ENTROPY
                )
                tl.store(out_row + (target - col0), value.to(out_ptr.dtype.element_ty))
