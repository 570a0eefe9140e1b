"""Each log-prob pass on the call's backend (``validation.Backend``, chosen once by ``inputs.prepare_inputs``): the
Triton launchers (``kernels.logits_launch``, ``kernels.fused_linear_launch``), the chunked torch path
(``torch_path``), or inside a torch.compile graph one of ``ops.py``'s custom ops. The input forms' Functions call
these with plain tensors, from logits (``logprobs_fwd`` / ``logprobs_bwd``) and from hidden states with the head
(``linear_logprobs_fwd`` / ``linear_logprobs_bwd``). The entries' passes (``sparse_entries.kept_terms``,
``kept_gradient``; from the head, ``from_hidden_states.linear_kept_terms``, ``kept_entries``) read the same value.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import ops, torch_path
from .kernels import fused_linear_launch, logits_launch
from .kernels.contracts import KeptTerms, TokenInputs
from .sparse_entries import with_kept_set
from .validation import Backend


class LogprobResult(NamedTuple):
    logp: torch.Tensor  # fp32 [N], 0 at masked tokens
    entropy: torch.Tensor | None  # fp32 [N] (0 at masked tokens) or None
    lse: torch.Tensor  # fp32 [N], what the backward reads
    sum_squares: torch.Tensor | None = None  # fp32 [N]: Σπ², where a log-prob pass asked for it


def aligned(logits: torch.Tensor, drop_last_position: bool) -> torch.Tensor:
    """The [B, T, V] logits that predict the completion: ``logits[:, :-1]`` of a [B, T + 1, V] input
    (the model's last position predicts no completion token), else the input itself."""
    return logits[:, :-1] if drop_last_position else logits


# ---- From logits [B, T, V] ---------------------------------------------------------------------------------------


def logprobs_fwd(
    logits,
    ids,
    temperature: float,
    mask: torch.Tensor | None,
    compute_entropy: bool,
    softcap: float | None,
    backend: Backend,
    drop_last_position: bool = False,
    compute_sum_squares: bool = False,
    kept: KeptTerms | None = None,
) -> LogprobResult:
    """log softmax(cap(logits) / temperature)[ids] (and the entropy, and Σπ²) of the logits that predict the
    completion, fp32 [N]; ``mask`` fp32 [N] or None (every token read): 0 where it is 0. ``kept``: each token's kept
    set (``kept_terms``): its log-prob (and, where the entropy is the set's, its entropy) over the set where it uses
    one; ``lse`` stays the whole vocabulary's."""
    if kept is not None and not backend.kernels:
        r = logprobs_fwd(
            logits, ids, temperature, mask, compute_entropy, softcap, backend, drop_last_position, compute_sum_squares
        )
        return with_kept_set(r, kept)
    if backend.kernels:
        if backend.in_graph:  # one opaque op in the graph (ops.py)
            logp, entropy, lse, squares = ops.triton_logprobs(
                aligned(logits, drop_last_position),
                ids,
                ops.head_scalars(temperature, softcap),
                mask,
                compute_entropy,
                compute_sum_squares,
            )
            present = ops.present
            return LogprobResult(logp, present(entropy, compute_entropy), lse, present(squares, compute_sum_squares))
        tokens = (
            TokenInputs(mask=mask) if kept is None else TokenInputs(mask, kept_lse=kept.lse, kept_entropy=kept.entropy)
        )
        r = logits_launch.forward(
            logits,
            ids,
            temperature=temperature,
            softcap=softcap,
            tokens=tokens,
            compute_entropy=compute_entropy,
            compute_sum_squares=compute_sum_squares,
        )
        r = LogprobResult(r.logp, r.entropy, r.lse, r.sum_squares)  # the kernels never read a masked row's id
        return r if kept is None else with_kept_set(r, kept)  # (the set's Σπ² where a token uses its set)
    logits = aligned(logits, drop_last_position)
    B, T, _ = logits.shape
    active = None if mask is None else (mask != 0).view(B, T)
    if active is not None:  # masked ids may be anything (-100): gather and scatter get 0 there
        ids = torch.where(active, ids, 0)
    if backend.in_graph:  # one opaque op in the graph (ops.py): no unrolled chunk loop
        logp, entropy, lse, squares = ops.torch_logprobs(
            logits, ids, ops.head_scalars(temperature, softcap), compute_entropy, compute_sum_squares
        )
        entropy, squares = ops.present(entropy, compute_entropy), ops.present(squares, compute_sum_squares)
    else:
        logp, entropy, lse, squares = torch_path.forward(
            logits, ids, temperature, compute_entropy, softcap, compute_sum_squares
        )
    if active is not None:
        logp = torch.where(active, logp, 0.0)
        entropy = None if entropy is None else torch.where(active, entropy, 0.0)
        squares = None if squares is None else torch.where(active, squares, 0.0)
    flat = lambda t: None if t is None else t.reshape(-1)  # noqa: E731
    return LogprobResult(logp.reshape(-1), flat(entropy), lse.reshape(-1), flat(squares))


def logprobs_bwd(
    logits,
    ids,
    lse,
    g,
    temperature: float,
    softcap: float | None,
    drop_last_position: bool,
    backend: Backend,
    *,
    out: torch.Tensor,
    grad_entropy: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """dlogits of g = dLoss/dlogp (and h = dLoss/dH, with the forward's entropy) written into ``out`` (the logits'
    shape: with ``drop_last_position`` its first T positions). Masked positions' ids must be in range here (the
    torch path scatters into them; the kernels never read them)."""
    written = aligned(out, drop_last_position)
    if backend.kernels:
        flat = lambda t: None if t is None else t.reshape(-1).float().contiguous()  # noqa: E731
        if backend.in_graph:  # (the launcher reads the same fp32 [N] values: ``logits_launch.backward``)
            ops.triton_logprobs_backward(
                aligned(logits, drop_last_position),
                ids,
                lse.reshape(-1),
                flat(g),
                ops.head_scalars(temperature, softcap),
                written,
                flat(grad_entropy),
                flat(entropy) if grad_entropy is not None else None,
            )
            return out
        logits_launch.backward(
            logits, ids, lse, g, temperature, softcap=softcap, out=out, grad_entropy=grad_entropy, entropy=entropy
        )
        return out
    logits = aligned(logits, drop_last_position)
    B, T, _ = logits.shape
    as_bt = lambda t: None if t is None else t.to(lse.dtype).reshape(B, T)  # noqa: E731  (fp32, or fp64)
    if backend.in_graph:
        written.copy_(
            ops.torch_logprobs_backward(
                logits,
                ids,
                lse.reshape(B, T),
                as_bt(g),
                ops.head_scalars(temperature, softcap),
                as_bt(grad_entropy),
                as_bt(entropy),
            )
        )
    else:
        torch_path.backward(
            logits,
            ids,
            lse.reshape(B, T),
            as_bt(g),
            temperature,
            out=written,
            grad_entropy=as_bt(grad_entropy),
            entropy=as_bt(entropy),
            softcap=softcap,
        )
    return out


# ---- From hidden states [N, H] and the lm_head ------------------------------------------------------------------


def linear_logprobs_fwd(
    hidden,
    weight,
    bias,
    ids,
    temperature: float,
    compute_entropy: bool,
    softcap: float | None,
    backend: Backend,
    compute_sum_squares: bool = False,
    fp32_logits: bool = False,
) -> LogprobResult:
    """log softmax(cap(hidden [N, H] @ weight [V, H]^T + bias) / temperature)[ids] (and the entropy, and Σπ²), a tile
    or a chunk of tokens at a time: fp32 [N] (fp64 for fp64 inputs on the torch path). ``fp32_logits``: 16-bit
    inputs' logits are the products' fp32 accumulator, not rounded to 16 bits (head_precision="fp32_logits")."""
    if backend.eager_kernels:
        r = fused_linear_launch.linear_forward(
            hidden,
            weight,
            bias,
            ids,
            temperature=temperature,
            softcap=softcap,
            compute_entropy=compute_entropy,
            compute_sum_squares=compute_sum_squares,
            fp32_logits=fp32_logits,
        )
        return LogprobResult(r.logp, r.entropy, r.lse, r.sum_squares)
    if backend.in_graph:  # one opaque op in the graph (ops.py)
        op = ops.triton_linear_logprobs if backend.kernels else ops.torch_linear_logprobs
        head = ops.head_scalars(temperature, softcap)
        lse, logp, entropy, squares = op(
            hidden, weight, bias, ids, head, compute_entropy, compute_sum_squares, fp32_logits
        )
        present = ops.present
        return LogprobResult(logp, present(entropy, compute_entropy), lse, present(squares, compute_sum_squares))
    lse, logp, entropy, squares = torch_path.linear_forward(
        hidden, weight, bias, ids, temperature, compute_entropy, softcap, compute_sum_squares, fp32_logits
    )
    return LogprobResult(logp, entropy, lse, squares)


def linear_logprobs_bwd(
    hidden,
    weight,
    bias,
    ids,
    lse,
    g,
    temperature: float,
    softcap: float | None,
    backend: Backend,
    compute_weight_grad: bool,
    grad_entropy=None,
    entropy=None,
    write_entries=None,
    fp32_logits: bool = False,
) -> tuple:
    """(d hidden, d weight or None, d bias or None), fp32, from g = dLoss/dlogp (and h = dLoss/dH with the
    forward's entropy), the logits recomputed a chunk at a time (``fp32_logits`` as in ``linear_logprobs_fwd``);
    ``write_entries(tile, first token, first column)`` writes sparse entries over each tile's dense gradient (a kept
    set's, ``kept_entries``; never inside a graph)."""
    if backend.in_graph:
        op = ops.triton_linear_backward if backend.kernels else ops.torch_linear_backward
        dh, dw, db = op(
            hidden, weight, bias, ids, lse, g, ops.head_scalars(temperature, softcap), compute_weight_grad,
            grad_entropy, entropy, fp32_logits,
        )  # fmt: skip
        return dh, ops.present(dw, compute_weight_grad), ops.present(db, compute_weight_grad and bias is not None)
    # the launcher and the torch path take the same arguments
    eager = fused_linear_launch.linear_backward if backend.kernels else torch_path.linear_backward
    return eager(
        hidden,
        weight,
        bias,
        ids,
        lse,
        g,
        temperature,
        compute_weight_grad,
        grad_entropy=grad_entropy,
        entropy=entropy,
        softcap=softcap,
        write_entries=write_entries,
        fp32_logits=fp32_logits,
    )
