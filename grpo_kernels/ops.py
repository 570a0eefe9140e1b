"""The input forms' log-prob operations as ``torch.library`` custom ops, for ``torch.compile``.

Eager calls run ``torch_path`` and the launchers directly (no dispatcher hop: host time). Inside a
``torch.compile`` graph (``torch.compiler.is_compiling()``) the host functions (``from_logits.py``,
``from_hidden_states.py``) call these ops instead: each is one opaque node with a fake (meta) implementation,
so dynamo neither unrolls the chunk loops (whose ``range`` would fix the completion length and recompile for
each new one) nor breaks the graph, and a step compiles once for every length (``dynamic=True``, or dynamo's
automatic dynamic shapes after the first new length).

Autograd stays with the package's ``autograd.Function``s (``from_logits.py``, ``from_hidden_states.py``), which
dynamo traces: the ops are their forward and backward primitives. They return new tensors (no argument
mutated); the Functions' in-place and preallocated-gradient options copy the result where eager writes directly
(compiled only).
An absent optional output is an empty tensor here (a custom op's schema has no optional outputs).

The Triton path's ops are its log-prob kernels (forward without a loss, backward; the lm_head's): inside a
graph the loss math runs as graph code on their log-probs (``loss.compute_loss``), since the fused loss
kernels (the per-token loss inside the logits pass, the one-pass schedule) take the options object, which a
custom op's schema cannot carry. So a compiled step reads the logits twice (3 S, the two-pass schedule),
where eager's default one-pass reads them once and writes the gradient in the same pass (2 S).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import torch_path
from .kernels import fused_linear_launch, launch
from .kernels.contracts import TokenInputs

_NONE = (0,)  # the shape of an absent output


def _dtype(t: Tensor) -> torch.dtype:
    return torch_path.compute_dtype(t)


@torch.library.custom_op("grpo_kernels::torch_logprobs", mutates_args=())
def torch_logprobs(
    logits: Tensor,
    ids: Tensor,
    temperature: float,
    softcap: Optional[float],
    compute_entropy: bool,
    compute_sum_squares: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logp, entropy or empty, lse, Σπ² or empty), [B, T] fp32 (fp64 for fp64 logits): ``torch_path.forward``."""
    logp, entropy, lse, squares = torch_path.forward(
        logits, ids, temperature, compute_entropy, softcap, compute_sum_squares
    )
    empty = lambda t: logp.new_empty(_NONE) if t is None else t  # noqa: E731
    return logp, empty(entropy), lse, empty(squares)


@torch_logprobs.register_fake
def _(logits, ids, temperature, softcap, compute_entropy, compute_sum_squares=False):
    B, T, _ = logits.shape
    new = lambda *shape: logits.new_empty(shape, dtype=_dtype(logits))  # noqa: E731
    optional = lambda wanted: new(B, T) if wanted else new(*_NONE)  # noqa: E731
    return new(B, T), optional(compute_entropy), new(B, T), optional(compute_sum_squares)


@torch.library.custom_op("grpo_kernels::torch_logprobs_backward", mutates_args=())
def torch_logprobs_backward(
    logits: Tensor,
    ids: Tensor,
    lse: Tensor,
    grad_logp: Tensor,
    temperature: float,
    softcap: Optional[float],
    grad_entropy: Optional[Tensor],
    entropy: Optional[Tensor],
) -> Tensor:
    """dlogits [B, T, V] in the logits' dtype: ``torch_path.backward`` into a new tensor."""
    return torch_path.backward(
        logits, ids, lse, grad_logp, temperature, grad_entropy=grad_entropy, entropy=entropy, softcap=softcap
    )


@torch_logprobs_backward.register_fake
def _(logits, ids, lse, grad_logp, temperature, softcap, grad_entropy, entropy):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("grpo_kernels::torch_linear_logprobs", mutates_args=())
def torch_linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    ids: Tensor,
    temperature: float,
    softcap: Optional[float],
    compute_entropy: bool,
    compute_sum_squares: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(lse, logp, entropy or empty, Σπ² or empty), [N]: ``torch_path.linear_forward``."""
    lse, logp, entropy, squares = torch_path.linear_forward(
        hidden, weight, bias, ids, temperature, compute_entropy, softcap, compute_sum_squares
    )
    empty = lambda t: logp.new_empty(_NONE) if t is None else t  # noqa: E731
    return lse, logp, empty(entropy), empty(squares)


@torch_linear_logprobs.register_fake
def _(hidden, weight, bias, ids, temperature, softcap, compute_entropy, compute_sum_squares=False):
    new = lambda *shape: hidden.new_empty(shape, dtype=_dtype(hidden))  # noqa: E731
    N = hidden.shape[0]
    return (
        new(N),
        new(N),
        (new(N) if compute_entropy else new(*_NONE)),
        (new(N) if compute_sum_squares else new(*_NONE)),
    )


@torch.library.custom_op("grpo_kernels::torch_linear_backward", mutates_args=())
def torch_linear_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    ids: Tensor,
    lse: Tensor,
    g: Tensor,
    temperature: float,
    softcap: Optional[float],
    compute_weight_grad: bool,
    grad_entropy: Optional[Tensor],
    entropy: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor]:
    """(d hidden, d weight or empty, d bias or empty): ``torch_path.linear_backward``."""
    dh, dw, db = torch_path.linear_backward(
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
    )
    empty = lambda t: dh.new_empty(_NONE) if t is None else t  # noqa: E731
    return dh, empty(dw), empty(db)


@torch_linear_backward.register_fake
def _(hidden, weight, bias, ids, lse, g, temperature, softcap, compute_weight_grad, grad_entropy, entropy):
    dtype = _dtype(hidden)
    dh = hidden.new_empty(hidden.shape, dtype=dtype)
    dw = weight.new_empty(weight.shape if compute_weight_grad else _NONE, dtype=dtype)
    db = weight.new_empty((weight.shape[0],) if compute_weight_grad and bias is not None else _NONE, dtype=dtype)
    return dh, dw, db


# ----- the Triton path's log-prob kernels (launch.forward without a loss, launch.backward; the lm_head's) -----


def _unaliased(*outputs: Optional[Tensor]) -> Tuple[Tensor, ...]:
    """The launchers' [N] outputs are rows of one buffer (one allocation a call); an op's outputs may not alias
    each other, so each is its own tensor here (O(N), only inside a graph). None becomes the empty placeholder."""
    first = next(t for t in outputs if t is not None)
    return tuple(first.new_empty(_NONE) if t is None else t.clone() for t in outputs)


@torch.library.custom_op("grpo_kernels::triton_logprobs", mutates_args=())
def triton_logprobs(
    logits: Tensor,
    ids: Tensor,
    temperature: float,
    softcap: Optional[float],
    mask: Optional[Tensor],
    compute_entropy: bool,
    compute_sum_squares: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logp, entropy or empty, lse, Σπ² or empty), fp32 [N]: the forward kernel without a loss (``launch.forward``)."""
    r = launch.forward(
        logits,
        ids,
        temperature=temperature,
        softcap=softcap,
        tokens=TokenInputs(mask=mask),
        compute_entropy=compute_entropy,
        compute_sum_squares=compute_sum_squares,
    )
    return _unaliased(r.logp, r.entropy, r.lse, r.sum_squares)


@triton_logprobs.register_fake
def _(logits, ids, temperature, softcap, mask, compute_entropy, compute_sum_squares=False):
    N = logits.shape[0] * logits.shape[1]
    new = lambda *shape: logits.new_empty(shape, dtype=torch.float32)  # noqa: E731
    optional = lambda wanted: new(N) if wanted else new(*_NONE)  # noqa: E731
    return new(N), optional(compute_entropy), new(N), optional(compute_sum_squares)


@torch.library.custom_op("grpo_kernels::triton_logprobs_backward", mutates_args=("out",))
def triton_logprobs_backward(
    logits: Tensor,
    ids: Tensor,
    lse: Tensor,
    grad_logp: Tensor,
    temperature: float,
    softcap: Optional[float],
    out: Tensor,
    grad_entropy: Optional[Tensor],
    entropy: Optional[Tensor],
) -> None:
    """dlogits written into ``out`` ([B, T, V], a unit last stride): the backward kernel (``launch.backward``)."""
    launch.backward(
        logits, ids, lse, grad_logp, temperature, softcap=softcap, out=out, grad_entropy=grad_entropy, entropy=entropy
    )


@triton_logprobs_backward.register_fake
def _(logits, ids, lse, grad_logp, temperature, softcap, out, grad_entropy, entropy):
    return None


@torch.library.custom_op("grpo_kernels::triton_linear_logprobs", mutates_args=())
def triton_linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    ids: Tensor,
    temperature: float,
    softcap: Optional[float],
    compute_entropy: bool,
    compute_sum_squares: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(lse, logp, entropy or empty, Σπ² or empty), fp32 [N]: the lm_head forward kernel without a loss."""
    r = fused_linear_launch.linear_forward(
        hidden,
        weight,
        bias,
        ids,
        temperature=temperature,
        softcap=softcap,
        compute_entropy=compute_entropy,
        compute_sum_squares=compute_sum_squares,
    )
    return _unaliased(r.lse, r.logp, r.entropy, r.sum_squares)


@triton_linear_logprobs.register_fake
def _(hidden, weight, bias, ids, temperature, softcap, compute_entropy, compute_sum_squares=False):
    N = hidden.shape[0]
    new = lambda *shape: hidden.new_empty(shape, dtype=torch.float32)  # noqa: E731
    optional = lambda wanted: new(N) if wanted else new(*_NONE)  # noqa: E731
    return new(N), new(N), optional(compute_entropy), optional(compute_sum_squares)


@torch.library.custom_op("grpo_kernels::triton_linear_backward", mutates_args=())
def triton_linear_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    ids: Tensor,
    lse: Tensor,
    g: Tensor,
    temperature: float,
    softcap: Optional[float],
    compute_weight_grad: bool,
    grad_entropy: Optional[Tensor],
    entropy: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor]:
    """(d hidden, d weight or empty, d bias or empty), fp32: the lm_head's chunked backward."""
    dh, dw, db = fused_linear_launch.linear_backward(
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
    )
    empty = lambda t: dh.new_empty(_NONE) if t is None else t  # noqa: E731
    return dh, empty(dw), empty(db)


@triton_linear_backward.register_fake
def _(hidden, weight, bias, ids, lse, g, temperature, softcap, compute_weight_grad, grad_entropy, entropy):
    f32 = dict(dtype=torch.float32)
    dh = hidden.new_empty(hidden.shape, **f32)
    dw = weight.new_empty(weight.shape if compute_weight_grad else _NONE, **f32)
    db = weight.new_empty((weight.shape[0],) if compute_weight_grad and bias is not None else _NONE, **f32)
    return dh, dw, db


def present(t: Tensor, wanted: bool) -> Optional[Tensor]:
    """An op's optional output: the tensor where it was asked for, None where it is the empty placeholder."""
    return t if wanted else None
