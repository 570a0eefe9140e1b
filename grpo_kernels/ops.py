"""Every ``torch.library`` custom op of the package, for ``torch.compile``.

Eager calls run ``torch_path`` and the launchers directly (no dispatcher hop: host time). Inside a
``torch.compile`` graph (a ``validation.Backend`` with ``in_graph``) the host functions (``passes.py``, and the
logits form's fused loss in ``from_logits.py``) call these ops instead: each is one opaque node with a fake (meta)
implementation, so dynamo neither unrolls the chunk loops (whose ``range`` would fix the completion length and
recompile for each new one) nor breaks the graph, and a step compiles once for every length (``dynamic=True``, or
dynamo's automatic dynamic shapes after the first new length).

Two kinds:

- the input forms' log-prob operations (the torch path's, the Triton path's log-prob kernels, the lm_head's):
  autograd stays with the package's ``autograd.Function``s (``from_logits.py``, ``from_hidden_states.py``), which
  dynamo traces, and these ops are their forward and backward primitives. They return new tensors (no argument
  mutated); the Functions' in-place and preallocated-gradient options copy the result where eager writes directly
  (compiled only). An absent optional output is an empty tensor (a custom op's schema has no optional outputs).
  The fused lm_head's loss runs its loss math as graph code on their log-probs (``pipeline.loss_in_torch``).
- the logits form's fused loss, one op for each of eager's schedules (``triton_one_pass_loss``,
  ``triton_two_pass_loss``, over the options' fields and ``GRPOOptions.runtime_scalars``), differentiable by
  ``register_autograd``: a compiled step reads the logits as eager's does (one-pass: 2 S).

Every op takes the float settings a step may change as tensors (the head's ``head_scalars``, the options' runtime
scalars), so that a new value is a new input, not a new graph.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import torch_path
from .kernels import fused_linear_launch, logits_launch
from .kernels.contracts import KernelLoss, LossTokens, Reduction, Sequences, TokenInputs
from .options import RUNTIME_SCALARS, GRPOOptions, kernel_loss_scalars, runtime_values

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
    fp32_logits: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(lse, logp, entropy or empty, Σπ² or empty), [N]: ``torch_path.linear_forward``."""
    temperature, softcap = head_floats(head)
    lse, logp, entropy, squares = torch_path.linear_forward(
        hidden, weight, bias, ids, temperature, compute_entropy, softcap, compute_sum_squares, fp32_logits
    )
    empty = lambda t: logp.new_empty(_NONE) if t is None else t  # noqa: E731
    return lse, logp, empty(entropy), empty(squares)


@torch_linear_logprobs.register_fake
def _(hidden, weight, bias, ids, head, compute_entropy, compute_sum_squares=False, fp32_logits=False):
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
    fp32_logits: bool = False,
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
        fp32_logits=fp32_logits,
    )
    empty = lambda t: dh.new_empty(_NONE) if t is None else t  # noqa: E731
    return dh, empty(dw), empty(db)


@torch_linear_backward.register_fake
def _(hidden, weight, bias, ids, lse, g, head, compute_weight_grad, grad_entropy, entropy, fp32_logits=False):
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
    fp32_logits: bool = False,
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
        fp32_logits=fp32_logits,
    )
    return _unaliased(r.lse, r.logp, r.entropy, r.sum_squares)


@triton_linear_logprobs.register_fake
def _(hidden, weight, bias, ids, head, compute_entropy, compute_sum_squares=False, fp32_logits=False):
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
    fp32_logits: bool = False,
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
        fp32_logits=fp32_logits,
    )
    empty = lambda t: dh.new_empty(_NONE) if t is None else t  # noqa: E731
    return dh, empty(dw), empty(db)


@triton_linear_backward.register_fake
def _(hidden, weight, bias, ids, lse, g, head, compute_weight_grad, grad_entropy, entropy, fp32_logits=False):
    f32 = dict(dtype=torch.float32)
    dh = hidden.new_empty(hidden.shape, **f32)
    dw = weight.new_empty(weight.shape if compute_weight_grad else _NONE, **f32)
    db = weight.new_empty((weight.shape[0],) if compute_weight_grad and bias is not None else _NONE, **f32)
    return dh, dw, db


def present(t: Tensor, wanted: bool) -> Optional[Tensor]:
    """An op's optional output: the tensor where it was asked for, None where it is the empty placeholder."""
    return t if wanted else None


# ---- Inside a torch.compile graph: the same two schedules as custom ops ------------------------------------------
#
# A graph cannot carry the options object or the call's NamedTuples into an opaque op, so each schedule is a
# ``torch.library`` custom op over their fields (``graph_args``: tensors, numbers and lists; rebuilt inside by
# ``_from_graph_args``), differentiable by ``register_autograd``: the one-pass op returns the gradient it wrote,
# which its backward scales in place (``triton_scale_``, reinplaced by inductor: no copy); the two-pass op returns
# what its backward kernel reads. Eager calls run from_logits.py's autograd Functions (no dispatcher hop).


def graph_loss(source, ids, loss_tokens: LossTokens, opts: GRPOOptions, one_pass: bool) -> tuple:
    """(loss, metrics vector, log-probs) of a fused loss inside a graph, on its schedule's op."""
    flat = graph_args(loss_tokens, opts)
    if one_pass:
        loss, metrics, logp, _ = triton_one_pass_loss(source.tensor, ids, *flat, source.drop_last_position)
    else:
        # (in a graph the gradient is a buffer of its own: the compiler manages memory, in_place_backward is eager's)
        loss, metrics, logp, *_ = triton_two_pass_loss(source.tensor, ids, *flat, source.drop_last_position)
    return loss, metrics, logp


def graph_args(loss_tokens: LossTokens, opts: GRPOOptions) -> tuple:
    """A fused loss's call as a custom op's arguments: the per-token tensors, the sequences, the reduction (a number
    or a tensor for each of its divisor and loss scale), the loss's constants, and its float options as the
    options' ``runtime_scalars`` tensor (a graph input: a new value is no new graph). ``_from_graph_args``
    inverts."""
    t, (S, T, cu_seqlens), r = loss_tokens
    kernel_loss = opts.kernel_loss
    tensor_or_none = lambda v: v if isinstance(v, torch.Tensor) else None  # noqa: E731
    number = lambda v: 1.0 if isinstance(v, torch.Tensor) or v is None else float(v)  # noqa: E731
    args = kernel_loss.args
    return (
        t.mask,
        t.advantages,
        t.old_logps,
        t.ref_logps,
        t.importance_weights,
        cu_seqlens,
        [S, T],
        r.divisor_kind,
        number(r.divisor),
        tensor_or_none(r.divisor),
        number(r.loss_scale),
        tensor_or_none(r.loss_scale),
        opts.has_entropy_bonus,
        r.bonus_mask,
        r.entropy_as_loss,
        opts.runtime_scalars,
        [
            args["LOSS_KIND"],
            args["KL_KIND"],
            args["LOSS_FLAGS"],
            kernel_loss.clip_metrics,
            kernel_loss.clip_metric_count,
        ],
        kernel_loss.compute_entropy,
        kernel_loss.with_kl,
    )


def _from_graph_args(mask, advantages, old, ref, iw, cu_seqlens, sequences, divisor_kind, divisor, divisor_tensor,
                     loss_scale, loss_scale_tensor, entropy_bonus, bonus_mask, entropy_as_loss, scalars, loss_ints,
                     compute_entropy, with_kl) -> tuple:  # fmt: skip
    """(``LossTokens``, ``KernelLoss``) of ``graph_args``."""
    kind, kl_kind, flags, clip_metrics, clip_metric_count = loss_ints
    values = runtime_values(scalars)
    kernel_loss = KernelLoss(
        {
            "loss_scalars": kernel_loss_scalars(values.get),
            "LOSS_KIND": kind,
            "KL_KIND": kl_kind,
            "LOSS_FLAGS": flags,
        },
        values["temperature"],
        values["kernel_temperature"],
        values["kernel_softcap"],
        compute_entropy,
        with_kl,
        clip_metrics,
        clip_metric_count,
    )
    reduction = Reduction(
        divisor_kind,
        divisor if divisor_tensor is None else divisor_tensor,
        loss_scale if loss_scale_tensor is None else loss_scale_tensor,
        values["entropy_coef"] if entropy_bonus else 0.0,
        bonus_mask,
        entropy_as_loss,
    )
    tokens = TokenInputs(mask, advantages, old, ref, iw)
    return LossTokens(tokens, Sequences(sequences[0], sequences[1], cu_seqlens), reduction), kernel_loss


def _metric_count(loss_ints, compute_entropy: bool, with_kl: bool) -> int:
    return int(with_kl) + int(compute_entropy) + loss_ints[4]


@torch.library.custom_op("grpo_kernels::triton_one_pass_loss", mutates_args=())
def triton_one_pass_loss(
    logits: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    advantages: Optional[torch.Tensor],
    old_logps: Optional[torch.Tensor],
    ref_logps: Optional[torch.Tensor],
    importance_weights: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    sequences: List[int],
    divisor_kind: int,
    divisor: float,
    divisor_tensor: Optional[torch.Tensor],
    loss_scale: float,
    loss_scale_tensor: Optional[torch.Tensor],
    entropy_bonus: bool,
    bonus_mask: Optional[torch.Tensor],
    entropy_as_loss: bool,
    scalars: torch.Tensor,
    loss_ints: List[int],
    compute_entropy: bool,
    with_kl: bool,
    drop_last_position: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``from_logits.one_pass_fwd`` as an op: (loss, metrics vector, log-probs shaped as the ids, the gradient at
    the logits' shape)."""
    loss_tokens, kernel_loss = _from_graph_args(*_graph_fields(locals()))
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    r = logits_launch.loss_forward(  # (from_logits.one_pass_fwd's launches: a graph has no kept set)
        logits,
        ids,
        kernel_loss=kernel_loss,
        loss_tokens=loss_tokens,
        gradient_out=grad,
        dropped_gradient=grad if drop_last_position else None,
    )
    return r.loss, r.metrics, r.result.logp.reshape(ids.shape).clone(), grad  # (the log-probs: a shared buffer's)


def _graph_fields(namespace: dict) -> tuple:
    """An op's ``graph_args`` fields, by name, from its arguments (its ``locals()``)."""
    return tuple(namespace[name] for name in _GRAPH_FIELDS)


_GRAPH_FIELDS = (
    "mask",
    "advantages",
    "old_logps",
    "ref_logps",
    "importance_weights",
    "cu_seqlens",
    "sequences",
    "divisor_kind",
    "divisor",
    "divisor_tensor",
    "loss_scale",
    "loss_scale_tensor",
    "entropy_bonus",
    "bonus_mask",
    "entropy_as_loss",
    "scalars",
    "loss_ints",
    "compute_entropy",
    "with_kl",
)


@triton_one_pass_loss.register_fake
def _(logits, ids, mask, *args):
    fields = dict(zip(_GRAPH_FIELDS[1:], args, strict=False))
    f32 = dict(device=logits.device, dtype=torch.float32)
    count = _metric_count(fields["loss_ints"], fields["compute_entropy"], fields["with_kl"])
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    return torch.empty((), **f32), torch.empty(count, **f32), torch.empty(ids.shape, **f32), grad


def _one_pass_setup(ctx, inputs, output):
    ctx.save_for_backward(output[3])


def _one_pass_backward(ctx, grad_loss, *unused):
    (grad,) = ctx.saved_tensors
    triton_scale_(grad, grad_loss)
    return (grad,) + (None,) * (len(_GRAPH_FIELDS) + 2)  # (logits; ids, the fields, drop_last_position)


torch.library.register_autograd("grpo_kernels::triton_one_pass_loss", _one_pass_backward, setup_context=_one_pass_setup)


@torch.library.custom_op("grpo_kernels::triton_scale_", mutates_args=("x",))
def triton_scale_(x: torch.Tensor, scale: torch.Tensor) -> None:
    """``from_logits.one_pass_bwd`` as an op: x *= scale in place, read on the device (nothing moves when it is 1)."""
    logits_launch.scale_in_place(x, scale)


@triton_scale_.register_fake
def _(x, scale):
    return None


@torch.library.custom_op("grpo_kernels::triton_two_pass_loss", mutates_args=())
def triton_two_pass_loss(
    logits: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    advantages: Optional[torch.Tensor],
    old_logps: Optional[torch.Tensor],
    ref_logps: Optional[torch.Tensor],
    importance_weights: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    sequences: List[int],
    divisor_kind: int,
    divisor: float,
    divisor_tensor: Optional[torch.Tensor],
    loss_scale: float,
    loss_scale_tensor: Optional[torch.Tensor],
    entropy_bonus: bool,
    bonus_mask: Optional[torch.Tensor],
    entropy_as_loss: bool,
    scalars: torch.Tensor,
    loss_ints: List[int],
    compute_entropy: bool,
    with_kl: bool,
    drop_last_position: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``from_logits.two_pass_fwd`` as an op: (loss, metrics vector, log-probs shaped as the ids, and what the
    backward reads: g = dLoss/dlogp times each token's weight [N], the entropy bonus's (weight, entropy) [2, N] or
    empty without one, the log-sum-exp [N])."""
    loss_tokens, kernel_loss = _from_graph_args(*_graph_fields(locals()))
    r = logits_launch.loss_forward(logits, ids, kernel_loss=kernel_loss, loss_tokens=loss_tokens)
    g = r.weights.weight * r.result.dloss_dlogp
    bonus = r.weights.entropy_weight
    entropy_terms = g.new_empty((0,)) if bonus is None else torch.stack([bonus, r.result.entropy])
    logp = r.result.logp.reshape(ids.shape).clone()  # (rows of a shared buffer: an op's outputs are its own)
    return r.loss, r.metrics, logp, g, entropy_terms, r.result.lse.clone()


@triton_two_pass_loss.register_fake
def _(logits, ids, mask, *args):
    fields = dict(zip(_GRAPH_FIELDS[1:], args, strict=False))
    f32 = dict(device=logits.device, dtype=torch.float32)
    count = _metric_count(fields["loss_ints"], fields["compute_entropy"], fields["with_kl"])
    N = ids.numel()
    bonus = (2, N) if fields["entropy_bonus"] else (0,)
    return (
        torch.empty((), **f32),
        torch.empty(count, **f32),
        torch.empty(ids.shape, **f32),
        torch.empty(N, **f32),
        torch.empty(bonus, **f32),
        torch.empty(N, **f32),
    )


def _two_pass_setup(ctx, inputs, output):
    logits, ids = inputs[0], inputs[1]
    fields = dict(zip(_GRAPH_FIELDS, inputs[2:], strict=False))
    ctx.save_for_backward(logits, ids, output[3], output[4], output[5])
    scalars = fields["scalars"]  # the head's (temperature, soft-cap) for the backward's op, sliced in the graph
    ctx.head = scalars[[RUNTIME_SCALARS.index("kernel_temperature"), RUNTIME_SCALARS.index("kernel_softcap")]]


def _two_pass_backward(ctx, grad_loss, *unused):
    logits, ids, g, entropy_terms, lse = ctx.saved_tensors
    h = entropy = None
    if entropy_terms.numel():
        h, entropy = grad_loss * entropy_terms[0], entropy_terms[1]
    # the gradient at the logits' shape: the T positions the ids predict written, a [B, T + 1, V] input's last one
    # (drop_last_position) zeroed, as from_logits.gradient_buffer makes it eagerly
    T = ids.shape[1]
    grad = torch.empty(logits.shape, device=logits.device, dtype=logits.dtype)
    grad[:, T:].zero_()
    triton_logprobs_backward(logits[:, :T], ids, lse, grad_loss * g, ctx.head, grad[:, :T], h, entropy)
    return (grad,) + (None,) * (len(_GRAPH_FIELDS) + 2)


torch.library.register_autograd("grpo_kernels::triton_two_pass_loss", _two_pass_backward, setup_context=_two_pass_setup)
