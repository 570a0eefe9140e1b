"""The CPU path: token log-probs and their backward, a chunk of rows at a time.

The same two operations as the Triton kernels (``kernels.launch.forward`` with no loss,
and ``kernels.launch.backward``), in PyTorch, so that CPU tensors never materialize an
[N, V] fp32 tensor: the workspace is one chunk of rows, at most ``CHUNK_ELEMENTS`` fp32
values per temporary. The logits may be a strided view ([B, T, V] with a unit last
stride or not); the chunks are views into it. As the kernels, it reads raw logits x and computes
log softmax(cap(x) / temperature), cap(x) = softcap * tanh(x / softcap) with a head's soft-cap (softcap None:
cap(x) = x).
"""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch

from .kernels.contracts import fp32_products

CHUNK_ELEMENTS = 1 << 21  # 8 MiB of fp32 per temporary


def _one_run_of_rows(t: torch.Tensor) -> bool:
    B, T, _ = t.shape
    return t.stride(0) == T * t.stride(1) or B == 1


def _chunks(*tensors: torch.Tensor) -> Iterator[Tuple[torch.Tensor, ...]]:
    """Yield (a [rows, V] view of each tensor, ..., their slice of the flat token index [0, B*T)).

    The tensors are [B, T, V] alike in shape (the logits, and the gradient written beside
    them). Each piece holds at most CHUNK_ELEMENTS logits (one row at least). Where every
    tensor is one run of rows in memory the pieces run across rows, so many short rows do
    not mean many tiny chunks; a strided view such as ``logits[:, :-1]`` is cut row by row.
    """
    B, T, V = tensors[0].shape
    step = max(1, CHUNK_ELEMENTS // max(V, 1))
    if all(_one_run_of_rows(t) for t in tensors):
        rows = [t.view(B * T, V) if t.stride(0) == T * t.stride(1) else t[0] for t in tensors]
        for n0 in range(0, B * T, step):
            yield (*(r[n0 : n0 + step] for r in rows), slice(n0, min(n0 + step, B * T)))
        return
    for b in range(B):
        for t0 in range(0, T, step):
            t1 = min(t0 + step, T)
            yield (*(t[b, t0:t1] for t in tensors), slice(b * T + t0, b * T + t1))


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the torch path computes in: fp32, or fp64 for fp64 inputs (gradcheck)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _nan_if_inf(lse: torch.Tensor) -> torch.Tensor:
    """A +inf log-sum-exp (a +inf logit in the row) is NaN, as the kernels' inf - inf makes it: the
    row's softmax is undefined, and its log-probs must not read as a finite -inf."""
    return lse.masked_fill_(lse == float("inf"), float("nan"))


def capped(x: torch.Tensor, softcap: Optional[float]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(cap(x), d cap / dx) of raw logits already in the compute dtype: (softcap * tanh(x / softcap), 1 - tanh^2),
    or (x, None) without a cap. A new tensor with a cap (x is never written)."""
    if softcap is None:
        return x, None
    t = torch.tanh(x / softcap)
    return t * softcap, 1.0 - t * t


def _row_statistics(x: torch.Tensor, ids: torch.Tensor, compute_entropy: bool):
    """(log-sum-exp, log-prob of ``ids``, entropy or None) of the rows of ``x`` ([rows, V], overwritten).

    Computed on the rows shifted by their maximum: the entropy lse - sum(p x) as two terms of the size of the
    largest logit would lose its low digits on a peaked row (fp32 at x = 58: 1e-4); shifted, both terms are at
    most log V and the top token's term is exactly 0."""
    shift = x.amax(-1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, 0.0)  # a row all -inf (or with +inf) keeps its values
    x -= shift
    shifted_lse = _nan_if_inf(torch.logsumexp(x, dim=-1))  # a +inf logit: NaN in every statistic of its row
    lse = shifted_lse + shift.squeeze(-1)
    logp = x.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - shifted_lse
    if not compute_entropy:
        return lse, logp, None
    p = torch.exp(x - shifted_lse.unsqueeze(-1))
    return lse, logp, shifted_lse - (p * torch.where(p > 0, x, 0.0)).sum(-1)


def forward(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, compute_entropy: bool,
    softcap: Optional[float] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """log-probs, entropy (or None) and log-sum-exp of cap(logits) / temperature, each fp32 [B, T]."""
    B, T, V = logits.shape
    f32 = dict(device=logits.device, dtype=compute_dtype(logits))
    logp, lse = torch.empty(B * T, **f32), torch.empty(B * T, **f32)
    entropy = torch.empty(B * T, **f32) if compute_entropy else None
    flat_ids = ids.reshape(-1).long()
    inv_temperature = 1.0 / temperature
    for piece, n in _chunks(logits):
        x = capped(piece.to(f32["dtype"]), softcap)[0] * inv_temperature  # [rows, V]
        lse[n], logp[n], piece_entropy = _row_statistics(x, flat_ids[n], compute_entropy)
        if compute_entropy:
            entropy[n] = piece_entropy
    as_bt = lambda t: None if t is None else t.view(B, T)  # noqa: E731
    return as_bt(logp), as_bt(entropy), as_bt(lse)


def _softmax_gradient(log_p: torch.Tensor, g: torch.Tensor, h: Optional[torch.Tensor] = None,
                      entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gradient of g logp_target + h H over the logits, without the target's one-hot term g: -g p, plus
    h dH/dz = -h p (log p + H) with the entropy. fp32 [rows, V] from log p [rows, V] and g, h, H [rows, 1]
    (g and h already divided by the temperature). A -inf logit (p = 0, log p = -inf) gets 0, not 0 * -inf.
    Without h it is computed in place in one [rows, V] buffer."""
    if h is None:
        return torch.exp(log_p).mul_(-g)
    p = torch.exp(log_p)
    return p * torch.where(p > 0, -g - h * (log_p + entropy), 0.0)


def backward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
    temperature: float,
    *,
    in_place: bool = False,
    out: Optional[torch.Tensor] = None,
    grad_entropy: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """dlogits = g * (onehot - softmax(cap(logits) / tau)) / tau (times d cap / dx with a soft-cap), in the logits'
    dtype.

    ``grad_logp`` (g) and ``lse`` are fp32 [B, T]. ``in_place`` writes into ``logits``;
    ``out`` ([B, T, V]) is written and returned instead of a new tensor. ``grad_entropy`` (h =
    dLoss/dH) with the forward's ``entropy`` (H), both fp32 [B, T], adds h dH/dlogits, where
    dH/dz_j = -p_j (log p_j + H): the row becomes (g onehot + p (-g - h H - h log p)) / tau.
    """
    B, T, V = logits.shape
    grad = logits if in_place else out if out is not None else torch.empty(
        (B, T, V), device=logits.device, dtype=logits.dtype)
    flat_ids, flat_lse = ids.reshape(-1).long(), lse.reshape(-1)
    inv_temperature = 1.0 / temperature
    flat_g = grad_logp.reshape(-1) * inv_temperature
    flat_h = None if grad_entropy is None else grad_entropy.reshape(-1) * inv_temperature
    for piece, grad_piece, n in _chunks(logits, grad):
        g = flat_g[n].unsqueeze(-1)  # [rows, 1]
        x, slope = capped(piece.to(flat_lse.dtype), softcap)
        log_p = x * inv_temperature - flat_lse[n].unsqueeze(-1)
        h = None if flat_h is None else flat_h[n].unsqueeze(-1)
        piece_grad = _softmax_gradient(log_p, g, h, None if h is None else entropy.reshape(-1)[n].unsqueeze(-1))
        zero_rows = g == 0 if h is None else (g == 0) & (h == 0)
        piece_grad.scatter_add_(-1, flat_ids[n].unsqueeze(-1), g)
        if slope is not None:
            piece_grad.mul_(slope)
        # a masked token is a zero row whatever its logits hold: 0 * exp(NaN or inf) is NaN
        piece_grad.masked_fill_(zero_rows, 0.0)
        grad_piece.copy_(piece_grad)  # cast to the logits' dtype
    return grad


def linear_chunk_rows(V: int) -> int:
    """Tokens per chunk of the fused lm_head path: CHUNK_ELEMENTS logits at a time."""
    return max(1, CHUNK_ELEMENTS // max(V, 1))


def _chunk_logits(hidden_chunk, weight, bias, inv_temperature, softcap):
    """(cap(hidden @ weight^T + bias) / tau, d cap / dx or None) of one chunk of tokens, [chunk, V]."""
    dtype = compute_dtype(hidden_chunk)
    x = hidden_chunk.to(dtype) @ weight.to(dtype).T
    if bias is not None:
        x += bias.to(dtype)
    x, slope = capped(x, softcap)
    return x * inv_temperature, slope


@fp32_products
def linear_forward(hidden, weight, bias, ids, temperature: float, compute_entropy: bool,
                   softcap: Optional[float] = None):
    """lse, logp, entropy (fp32 [N]) of the lm_head logits cap(hidden @ weight^T + bias) / temperature, a chunk of
    tokens at a time."""
    N = hidden.shape[0]
    f32 = dict(device=hidden.device, dtype=compute_dtype(hidden))
    lse, logp = torch.empty(N, **f32), torch.empty(N, **f32)
    entropy = torch.empty(N, **f32) if compute_entropy else None
    step, inv_temperature, flat_ids = linear_chunk_rows(weight.shape[0]), 1.0 / temperature, ids.long()
    for n0 in range(0, N, step):
        n = slice(n0, min(n0 + step, N))
        x = _chunk_logits(hidden[n], weight, bias, inv_temperature, softcap)[0]  # [chunk, V], the only V-sized one
        lse[n], logp[n], chunk_entropy = _row_statistics(x, flat_ids[n], compute_entropy)
        if compute_entropy:
            entropy[n] = chunk_entropy
    return lse, logp, entropy


@fp32_products
def linear_backward(hidden, weight, bias, ids, lse, g, temperature: float, compute_weight_grad: bool,
                    grad_entropy=None, entropy=None, softcap: Optional[float] = None):
    """d hidden, d weight (or None), d bias (or None) in fp32 (fp64 for fp64 inputs), recomputing each
    chunk's logits; with ``grad_entropy`` (h = dLoss/dH) and the forward's ``entropy``, the entropy's
    gradient too."""
    N, H = hidden.shape
    dtype = compute_dtype(hidden)
    dh = torch.empty(N, H, device=hidden.device, dtype=dtype)
    dw = torch.zeros_like(weight, dtype=dtype) if compute_weight_grad else None
    db = (torch.zeros(weight.shape[0], device=hidden.device, dtype=dtype) if compute_weight_grad and bias is not None
          else None)
    step, inv_temperature, flat_ids = linear_chunk_rows(weight.shape[0]), 1.0 / temperature, ids.long()
    w32 = weight.to(dtype)
    for n0 in range(0, N, step):
        n = slice(n0, min(n0 + step, N))
        x, slope = _chunk_logits(hidden[n], weight, bias, inv_temperature, softcap)
        gs = (g[n] * inv_temperature).unsqueeze(-1)
        hs = None if grad_entropy is None else (grad_entropy[n] * inv_temperature).unsqueeze(-1)
        dx = _softmax_gradient(x - lse[n].unsqueeze(-1), gs, hs, None if hs is None else entropy[n].unsqueeze(-1))
        dx.scatter_add_(-1, flat_ids[n].unsqueeze(-1), gs)
        if slope is not None:
            dx.mul_(slope)
        dh[n] = dx @ w32
        if dw is not None:
            dw.addmm_(dx.T, hidden[n].to(dtype))
        if db is not None:
            db += dx.sum(0)
    return dh, dw, db
