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

The Triton path's ops here are its log-prob kernels (forward without a loss, backward; the lm_head's): the fused
lm_head's loss runs its loss math as graph code on their log-probs (``pipeline.loss_in_torch``). The logits form's
fused loss is a custom op of its own, one for each of eager's schedules (``from_logits.triton_one_pass_loss`` and
``triton_two_pass_loss``, over the options' fields and ``GRPOOptions.runtime_scalars``): a compiled step reads the
logits as eager's does (one-pass: 2 S). Every op takes the float settings a step may change as tensors (the head's
``head_scalars``, the options' runtime scalars), so that a new value is a new input, not a new graph.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import torch_path
from .kernels import fused_linear_launch, logits_launch
from .kernels.contracts import TokenInputs

_NONE = (0,)  # the shape of an absent output


def head_scalars(temperature, softcap) -> Tensor:
    """The head's (temperature, softcap) as an op takes them: a float64 CPU tensor [2], the soft-cap NaN where there
    is none. Inside a graph each is a number (a constant) or an option's element of ``GRPOOptions.runtime_scalars``
    (an input): a new value between steps is then a new input, not a new graph (an op's float argument is
    specialized, one graph per value)."""
    as_f64 = lambda v: torch.as_tensor(v, dtype=torch.float64).reshape(())  # noqa: E731
    return torch.stack([as_f64(temperature), as_f64(float("nan") if softcap is None else softcap)])


def head_floats(head: Tensor) -> Tuple[float, Optional[float]]:
    """``head_scalars`` inverted inside an op (a CPU tensor: no device sync)."""
    temperature, softcap = head.tolist()
    return temperature, None if softcap != softcap else softcap


def _dtype(t: Tensor) -> torch.dtype:
    return torch_path.compute_dtype(t)


@torch.library.custom_op("grpo_kernels::torch_logprobs", mutates_args=())
def torch_logprobs(
    logits: Tensor,
    ids: Tensor,
    head: Tensor,
    compute_entropy: bool,
    compute_sum_squares: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logp, entropy or empty, lse, Σπ² or empty), [B, T] fp32 (fp64 for fp64 logits): ``torch_path.forward``."""
    temperature, softcap = head_floats(head)
    logp, entropy, lse, squares = torch_path.forward(
        logits, ids, temperature, compute_entropy, softcap, compute_sum_squares
    )
    empty = lambda t: logp.new_empty(_NONE) if t is None else t  # noqa: E731
    return logp, empty(entropy), lse, empty(squares)


@torch_logprobs.register_fake
def _(logits, ids, head, compute_entropy, compute_sum_squares=False):
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
    head: Tensor,
    grad_entropy: Optional[Tensor],
    entropy: Optional[Tensor],
) -> Tensor:
    """dlogits [B, T, V] in the logits' dtype: ``torch_path.backward`` into a new tensor."""
    temperature, softcap = head_floats(head)
    return torch_path.backward(
        logits, ids, lse, grad_logp, temperature, grad_entropy=grad_entropy, entropy=entropy, softcap=softcap
    )


@torch_logprobs_backward.register_fake
def _(logits, ids, lse, grad_logp, head, grad_entropy, entropy):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("grpo_kernels::torch_linear_logprobs", mutates_args=())
def torch_linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    ids: Tensor,
    head: Tensor,
    compute_entropy: bool,
    compute_sum_squares: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(lse, logp, entropy or empty, Σπ² or empty), [N]: ``torch_path.linear_forward``."""
    temperature, softcap = head_floats(head)
    lse, logp, entropy, squares = torch_path.linear_forward(
        hidden, weight, bias, ids, temperature, compute_entropy, softcap, compute_sum_squares
    )
    empty = lambda t: logp.new_empty(_NONE) if t is None else t  # noqa: E731
    return lse, logp, empty(entropy), empty(squares)


@torch_linear_logprobs.register_fake
def _(hidden, weight, bias, ids, head, compute_entropy, compute_sum_squares=False):
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
    head: Tensor,
    compute_weight_grad: bool,
    grad_entropy: Optional[Tensor],
    entropy: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor]:
    """(d hidden, d weight or empty, d bias or empty): ``torch_path.linear_backward``."""
    temperature, softcap = head_floats(head)
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
def _(hidden, weight, bias, ids, lse, g, head, compute_weight_grad, grad_entropy, entropy):
    dtype = _dtype(hidden)
    dh = hidden.new_empty(hidden.shape, dtype=dtype)
    dw = weight.new_empty(weight.shape if compute_weight_grad else _NONE, dtype=dtype)
    db = weight.new_empty((weight.shape[0],) if compute_weight_grad and bias is not None else _NONE, dtype=dtype)
    return dh, dw, db


# ----- the Triton path's log-prob kernels (logits_launch.forward without a loss, logits_launch.backward; the lm_head's)


def _unaliased(*outputs: Optional[Tensor]) -> Tuple[Tensor, ...]:
    """The launchers' [N] outputs are rows of one buffer (one allocation a call); an op's outputs may not alias
    each other, so each is its own tensor here (O(N), only inside a graph). None becomes the empty placeholder."""
    first = next(t for t in outputs if t is not None)
    return tuple(first.new_empty(_NONE) if t is None else t.clone() for t in outputs)


@torch.library.custom_op("grpo_kernels::triton_logprobs", mutates_args=())
def triton_logprobs(
    logits: Tensor,
    ids: Tensor,
    head: Tensor,
    mask: Optional[Tensor],
    compute_entropy: bool,
    compute_sum_squares: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logp, entropy or empty, lse, Σπ² or empty), fp32 [N]: the forward kernel without a loss
    (``logits_launch.forward``)."""
    temperature, softcap = head_floats(head)
    r = logits_launch.forward(
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
def _(logits, ids, head, mask, compute_entropy, compute_sum_squares=False):
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
    head: Tensor,
    out: Tensor,
    grad_entropy: Optional[Tensor],
    entropy: Optional[Tensor],
) -> None:
    """dlogits written into ``out`` ([B, T, V], a unit last stride): the backward kernel
    (``logits_launch.backward``)."""
    temperature, softcap = head_floats(head)
    logits_launch.backward(
        logits, ids, lse, grad_logp, temperature, softcap=softcap, out=out, grad_entropy=grad_entropy, entropy=entropy
    )


@triton_logprobs_backward.register_fake
def _(logits, ids, lse, grad_logp, head, out, grad_entropy, entropy):
    return None


@torch.library.custom_op("grpo_kernels::triton_linear_logprobs", mutates_args=())
def triton_linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    ids: Tensor,
    head: Tensor,
    compute_entropy: bool,
    compute_sum_squares: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(lse, logp, entropy or empty, Σπ² or empty), fp32 [N]: the lm_head forward kernel without a loss."""
    temperature, softcap = head_floats(head)
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
def _(hidden, weight, bias, ids, head, compute_entropy, compute_sum_squares=False):
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
    head: Tensor,
    compute_weight_grad: bool,
    grad_entropy: Optional[Tensor],
    entropy: Optional[Tensor],
) -> Tuple[Tensor, Tensor, Tensor]:
    """(d hidden, d weight or empty, d bias or empty), fp32: the lm_head's chunked backward."""
    temperature, softcap = head_floats(head)
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
def _(hidden, weight, bias, ids, lse, g, head, compute_weight_grad, grad_entropy, entropy):
    f32 = dict(dtype=torch.float32)
    dh = hidden.new_empty(hidden.shape, **f32)
    dw = weight.new_empty(weight.shape if compute_weight_grad else _NONE, **f32)
    db = weight.new_empty((weight.shape[0],) if compute_weight_grad and bias is not None else _NONE, **f32)
    return dh, dw, db


def present(t: Tensor, wanted: bool) -> Optional[Tensor]:
    """An op's optional output: the tensor where it was asked for, None where it is the empty placeholder."""
    return t if wanted else None
