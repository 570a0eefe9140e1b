"""The CPU path: token log-probs and their backward, a chunk of rows at a time.

The same two operations as the Triton kernels (``kernels.logits_launch.forward`` with no loss,
and ``kernels.logits_launch.backward``), in PyTorch, so that CPU tensors never materialize an
[N, V] fp32 tensor: the workspace is one chunk of rows, at most ``CHUNK_ELEMENTS`` fp32
values per temporary. The logits may be a strided view ([B, T, V] with a unit last
stride or not); the chunks are views into it. As the kernels, it reads raw logits x and computes
log softmax(cap(x) / temperature), cap(x) = softcap * tanh(x / softcap) with a head's soft-cap (softcap None:
cap(x) = x).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .kernels.contracts import fp32_products, rounds_head_logits

CHUNK_ELEMENTS = 1 << 21  # 8 MiB of fp32 per temporary


def _chunks(*tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """Yield (a [rows, t, V] view of each tensor, ..., the piece's index (rows, t) into the [B, T] token grid, or
    None where the piece is the whole of every tensor).

    The tensors are [B, T, V] alike in shape (the logits, and the gradient written beside them), any strides
    (``logits[:, :-1]`` included). Each piece holds at most CHUNK_ELEMENTS logits (one token at least): whole rows
    of T tokens where a row fits, so that a batch of short rows is one piece (one set of torch ops: at small shapes
    each op's fixed cost is the time, and a whole batch in one piece is the tensors themselves, no views), else a
    run of one row's tokens.
    """
    B, T, V = tensors[0].shape
    tokens = max(1, CHUNK_ELEMENTS // max(V, 1))
    if B * T <= tokens:
        yield (*tensors, None)
        return
    if T <= tokens:
        rows = tokens // max(T, 1)
        for b0 in range(0, B, rows):
            index = (slice(b0, min(b0 + rows, B)), slice(0, T))
            yield (*(t[index] for t in tensors), index)
        return
    for b in range(B):
        for t0 in range(0, T, tokens):
            index = (slice(b, b + 1), slice(t0, min(t0 + tokens, T)))
            yield (*(t[index] for t in tensors), index)


def _part(t: torch.Tensor, index) -> torch.Tensor:
    """A [B, T] tensor's part at a piece's index (``_chunks``): the whole where the piece is."""
    return t if index is None else t[index]


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the torch path computes in: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def capped(x: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(cap(x), d cap / dx) of raw logits already in the compute dtype: (softcap * tanh(x / softcap), 1 - tanh^2),
    or (x, None) without a cap. A new tensor with a cap (x is never written)."""
    if softcap is None:
        return x, None
    t = torch.tanh(x / softcap)
    return t * softcap, 1.0 - t * t


def _row_statistics(
    x: torch.Tensor,
    ids: torch.Tensor,
    compute_entropy: bool,
    inv_temperature: float = 1.0,
    dtype: torch.dtype = torch.float32,
    compute_sum_squares: bool = False,
):
    """(log-sum-exp, log-prob of ``ids``, entropy or None, sum of squared probabilities or None) of the rows of
    ``x * inv_temperature`` (``x`` [..., V] in any float dtype, never written; ``ids`` [...]), computed in ``dtype``.

    On the rows shifted by their maximum, y = x / tau - max (one op, in ``dtype``), and e = exp(y), the one exp a
    logit: lse = max + log sum e, log p = y[id] - log sum e, the entropy log sum e - sum(e y) / sum e, whose
    terms e y are at most 1/e in size (unshifted, lse - sum(p x) would be two terms of the largest logit's size,
    losing its low digits on a peaked row), and Σπ² = sum e^2 / (sum e)^2; a -inf logit's term is 0 (y clamped to
    the dtype's lowest, times e = 0). A row with a +inf logit or a NaN, or all -inf, is NaN in every statistic, as
    in the kernels. (torch's ``logsumexp`` and ``log_softmax`` take two exps a logit and more passes.)"""
    shift = x.amax(-1, keepdim=True).to(dtype) * inv_temperature
    y = torch.add(shift.neg(), x, alpha=inv_temperature)  # x / tau - max, promoted to ``dtype``
    target = y.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # before the clamp: a -inf target's log-prob is -inf
    if compute_entropy:
        e = torch.exp(y.clamp_min_(torch.finfo(dtype).min))
    else:
        e = y.exp_()
    total = e.sum(-1)
    log_total = total.log()
    lse = shift.squeeze(-1) + log_total
    logp = target - log_total
    entropy = log_total - torch.linalg.vecdot(e, y) / total if compute_entropy else None
    sum_squares = torch.linalg.vecdot(e, e) / (total * total) if compute_sum_squares else None
    return lse, logp, entropy, sum_squares


@fp32_products  # the row statistics' sums (vecdot) in fp32 under any autocast, as the kernels take them
def forward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    temperature: float,
    compute_entropy: bool,
    softcap: float | None = None,
    compute_sum_squares: bool = False,
) -> tuple:
    """log-probs, entropy (or None), log-sum-exp and Σπ² (or None) of cap(logits) / temperature, each fp32 [B, T]."""
    B, T, V = logits.shape
    dtype = compute_dtype(logits)
    inv_temperature = 1.0 / temperature
    logp = lse = entropy = sum_squares = None
    for piece, index in _chunks(logits):
        x = piece if softcap is None else capped(piece.to(dtype), softcap)[0]  # [rows, t, V]
        piece_lse, piece_logp, piece_entropy, piece_squares = _row_statistics(
            x, _part(ids, index).long(), compute_entropy, inv_temperature, dtype, compute_sum_squares
        )
        if index is None:  # one piece: its statistics are the outputs
            return piece_logp, piece_entropy, piece_lse, piece_squares
        if logp is None:  # the first of several pieces: the outputs to fill
            f32 = dict(device=logits.device, dtype=dtype)
            logp, lse = torch.empty(B, T, **f32), torch.empty(B, T, **f32)
            entropy = torch.empty(B, T, **f32) if compute_entropy else None
            sum_squares = torch.empty(B, T, **f32) if compute_sum_squares else None
        lse[index], logp[index] = piece_lse, piece_logp
        if compute_entropy:
            entropy[index] = piece_entropy
        if compute_sum_squares:
            sum_squares[index] = piece_squares
    return logp, entropy, lse, sum_squares


def _softmax_gradient(
    log_p: torch.Tensor, g: torch.Tensor, h: torch.Tensor | None = None, entropy: torch.Tensor | None = None
) -> torch.Tensor:
    """The gradient of g logp_target + h H over the logits, without the target's one-hot term g: -g p, plus
    h dH/dz = -h p (log p + H) with the entropy. fp32 [rows, V] from log p [rows, V] and g, h, H [rows, 1]
    (g and h already divided by the temperature). A -inf logit (p = 0, log p = -inf) gets 0, not 0 * -inf.
    Without h it is computed in place, in ``log_p``'s buffer (each caller's own temporary)."""
    if h is None:
        return log_p.exp_().mul_(-g)
    p = torch.exp(log_p)
    return p * torch.where(p > 0, -g - h * (log_p + entropy), 0.0)


@fp32_products
def backward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    temperature: float,
    *,
    in_place: bool = False,
    out: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """dlogits = g * (onehot - softmax(cap(logits) / tau)) / tau (times d cap / dx with a soft-cap), in the logits'
    dtype.

    ``grad_logp`` (g) and ``lse`` are fp32 [B, T]. ``in_place`` writes into ``logits``;
    ``out`` ([B, T, V]) is written and returned instead of a new tensor. ``grad_entropy`` (h =
    dLoss/dH) with the forward's ``entropy`` (H), both fp32 [B, T], adds h dH/dlogits, where
    dH/dz_j = -p_j (log p_j + H): the row becomes (g onehot + p (-g - h H - h log p)) / tau.
    """
    B, T, V = logits.shape
    grad = (
        logits
        if in_place
        else out
        if out is not None
        else torch.empty((B, T, V), device=logits.device, dtype=logits.dtype)
    )
    inv_temperature = 1.0 / temperature
    g_all = grad_logp.view(B, T) * inv_temperature
    h_all = None if grad_entropy is None else grad_entropy.view(B, T) * inv_temperature
    # Without the entropy's term the gradient is computed in place, and in the gradient's own buffer where it has
    # the compute dtype: no [rows, V] temporary, no copy (at small shapes an op less, at large ones a pass less)
    # (not where autograd records these ops: torch.func.grad differentiates a backward, and an op with out= has none)
    in_buffer = (
        grad.dtype == lse.dtype
        and h_all is None
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (logits, lse, grad_logp)))
    )
    for piece, grad_piece, index in _chunks(logits, grad):
        g = _part(g_all, index).unsqueeze(-1)  # [rows, t, 1]
        x, slope = capped(piece.to(lse.dtype), softcap)
        # x / tau - lse in one op (x may be grad_piece itself, in place: each element read before it is written)
        log_p = torch.add(
            _part(lse, index).unsqueeze(-1).neg(), x, alpha=inv_temperature, out=grad_piece if in_buffer else None
        )
        h = None if h_all is None else _part(h_all, index).unsqueeze(-1)
        entropy_piece = None if h is None else _part(entropy.view(B, T), index).unsqueeze(-1)
        piece_grad = _softmax_gradient(log_p, g, h, entropy_piece)
        zero_rows = g == 0 if h is None else (g == 0) & (h == 0)
        piece_grad.scatter_add_(-1, _part(ids, index).long().unsqueeze(-1), g)
        if slope is not None:
            piece_grad.mul_(slope)
        # a masked token is a zero row whatever its logits hold: 0 * exp(NaN or inf) is NaN
        piece_grad.masked_fill_(zero_rows, 0.0)
        if piece_grad is not grad_piece:
            grad_piece.copy_(piece_grad)  # cast to the logits' dtype
    return grad


def linear_chunk_rows(V: int) -> int:
    """Tokens per chunk of the fused lm_head path: CHUNK_ELEMENTS logits at a time."""
    return max(1, CHUNK_ELEMENTS // max(V, 1))


def _chunk_logits(hidden_chunk, weight, bias, inv_temperature, softcap, fp32_logits: bool = False):
    """(cap(hidden @ weight^T + bias) / tau, d cap / dx or None) of one chunk of tokens, [chunk, V]. 16-bit inputs'
    hidden @ weight^T + bias is rounded to their dtype first, as an unfused head in that dtype computes its logits
    (the products themselves in fp32, as the kernels' are)."""
    dtype = compute_dtype(hidden_chunk)
    x = hidden_chunk.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        x += bias.to(dtype)
    if rounds_head_logits(hidden_chunk.dtype, fp32_logits):
        x = x.to(hidden_chunk.dtype).to(dtype)
    x, slope = capped(x, softcap)
    return x * inv_temperature, slope


@fp32_products
def linear_forward(
    hidden,
    weight,
    bias,
    ids,
    temperature: float,
    compute_entropy: bool,
    softcap: float | None = None,
    compute_sum_squares: bool = False,
    fp32_logits: bool = False,
):
    """lse, logp, entropy (or None), Σπ² (or None), each fp32 [N], of the lm_head logits cap(hidden @ weight^T + bias)
    / temperature, a chunk of tokens at a time (``fp32_logits``: 16-bit inputs' logits left unrounded)."""
    N = hidden.shape[0]
    f32 = dict(device=hidden.device, dtype=compute_dtype(hidden))
    lse, logp = torch.empty(N, **f32), torch.empty(N, **f32)
    entropy = torch.empty(N, **f32) if compute_entropy else None
    sum_squares = torch.empty(N, **f32) if compute_sum_squares else None
    step, inv_temperature, flat_ids = linear_chunk_rows(weight.shape[0]), 1.0 / temperature, ids.long()
    for n0 in range(0, N, step):
        n = slice(n0, min(n0 + step, N))
        x = _chunk_logits(hidden[n], weight, bias, inv_temperature, softcap, fp32_logits)[0]  # the only V-sized one
        lse[n], logp[n], chunk_entropy, chunk_squares = _row_statistics(
            x, flat_ids[n], compute_entropy, dtype=x.dtype, compute_sum_squares=compute_sum_squares
        )
        if compute_entropy:
            entropy[n] = chunk_entropy
        if compute_sum_squares:
            sum_squares[n] = chunk_squares
    return lse, logp, entropy, sum_squares


@fp32_products
def linear_backward(
    hidden,
    weight,
    bias,
    ids,
    lse,
    g,
    temperature: float,
    compute_weight_grad: bool,
    grad_entropy=None,
    entropy=None,
    softcap: float | None = None,
    write_entries=None,
    fp32_logits: bool = False,
):
    """d hidden, d weight (or None), d bias (or None) in fp32 (fp64 for fp64 inputs), recomputing each
    chunk's logits; with ``grad_entropy`` (h = dLoss/dH) and the forward's ``entropy``, the entropy's
    gradient too; ``write_entries(chunk, first token, first column)`` as in ``fused_linear_launch.linear_backward``."""
    N, H = hidden.shape
    dtype = compute_dtype(hidden)
    dh = torch.empty(N, H, device=hidden.device, dtype=dtype)
    dw = torch.zeros_like(weight, dtype=dtype) if compute_weight_grad else None
    db = (
        torch.zeros(weight.shape[0], device=hidden.device, dtype=dtype)
        if compute_weight_grad and bias is not None
        else None
    )
    step, inv_temperature, flat_ids = linear_chunk_rows(weight.shape[0]), 1.0 / temperature, ids.long()
    w32 = weight.to(dtype)
    for n0 in range(0, N, step):
        n = slice(n0, min(n0 + step, N))
        x, slope = _chunk_logits(hidden[n], weight, bias, inv_temperature, softcap, fp32_logits)
        gs = (g[n] * inv_temperature).unsqueeze(-1)
        hs = None if grad_entropy is None else (grad_entropy[n] * inv_temperature).unsqueeze(-1)
        dx = _softmax_gradient(x - lse[n].unsqueeze(-1), gs, hs, None if hs is None else entropy[n].unsqueeze(-1))
        dx.scatter_add_(-1, flat_ids[n].unsqueeze(-1), gs)
        if slope is not None:
            dx.mul_(slope)
        if write_entries is not None:
            write_entries(dx, n0, 0)
        dh[n] = dx @ w32
        if dw is not None:
            dw.addmm_(dx.T, hidden[n].to(dtype))
        if db is not None:
            db += dx.sum(0)
    return dh, dw, db
