"""Models as training stacks hand them over: wrapped for data parallelism, and with adapters on the head.

Two things a fused lm_head loss needs from a model that a plain ``model(...)`` call never asks for:

- **Its forward, run by its wrapper** (``inside_forward``). DDP, FSDP2 and DeepSpeed act in the wrapped
  model's ``__call__``: DDP prepares its gradient reduction, FSDP2 all-gathers the root module's sharded
  parameters (the embedding and the lm_head), ZeRO-3 gathers its partitioned ones. A hidden-state pass
  and a loss on the head's weight called beside that (``model.get_decoder()(...)``,
  ``model.lm_head.weight``) see none of it: a DDP wrapper has no ``get_decoder``, FSDP2's parameters are
  still DTensor shards. So the whole computation runs as the inner model's forward, through the
  wrapper's own call (the forward-redirection pattern Lightning and TRL use for such calls).
- **The head's effective weight** (``output_layer``). A PEFT adapter on the output layer lives beside its
  base weight: ``head.weight`` is the base alone, and a loss on it silently drops the adapter. A LoRA
  adapter is folded in exactly (W + scaling * B @ A, differentiable in A and B); ``modules_to_save`` reads
  the active trained copy of the head, as its forward does; any other adapter state
  (DoRA, dropout on the adapter's input while training, several active adapters of other kinds) is
  refused with what to do instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

_MISSING = object()


def unwrapped_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP / DeepSpeed / FSDP1 wrapper (``.module``); the model itself otherwise (FSDP2's
    ``fully_shard`` and a bare model are their own wrappers)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def inside_forward(
    wrapper: torch.nn.Module, fn: Callable[..., Any], *args: Any, inner: torch.nn.Module | None = None, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` run as the forward of ``inner`` (default: ``unwrapped_model(wrapper)``), called
    through ``wrapper(*args, **kwargs)``, so that every hook a wrapper puts around the forward applies: DDP's
    gradient reduction, FSDP2's all-gather of the root's parameters (and the backward's hooks on what ``fn``
    returns: return the tensors to differentiate at the top level, e.g. ``(loss, details)``), DeepSpeed's
    gathered parameters. A bare model runs ``fn`` through its own ``__call__`` (its hooks included).

    ``inner.forward`` is replaced for the one call and restored before ``fn`` runs (so that ``fn`` may call
    the real forward) and, whatever happens, after it.
    """
    inner = unwrapped_model(wrapper) if inner is None else inner
    saved = inner.__dict__.get("forward", _MISSING)  # an instance forward (accelerate's autocast wrapper) or none

    def restore() -> None:
        if saved is _MISSING:
            inner.__dict__.pop("forward", None)
        else:
            inner.forward = saved

    def redirected(*call_args: Any, **call_kwargs: Any) -> Any:
        restore()
        return fn(*call_args, **call_kwargs)

    inner.forward = redirected
    try:
        return wrapper(*args, **kwargs)
    finally:
        restore()


def zero3_partitioned(model: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 has partitioned the model's parameters (each a ``ds_id``; outside its owning
    module's forward a parameter is an empty placeholder)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def whole_parameters(model: torch.nn.Module):
    """A context in which every parameter of ``model`` is whole: ZeRO-3's ``GatheredParameters`` (read only)
    where DeepSpeed partitioned them, else nothing. For a forward outside the engine (a probe).

    One ``GatheredParameters`` a parameter: given several, DeepSpeed 0.19 launches an async all-gather for each
    and waits for the last alone, which gloo (CPU ranks) may finish before the others, so their buffers are read
    uninitialized now and then; one at a time, each all-gather is waited for."""
    if not zero3_partitioned(model):
        return contextlib.nullcontext()
    return _gathered_one_by_one(list(model.parameters()))


def zero3_gloo_hazard(deepspeed_config: dict | None, backend: str | None) -> str | None:
    """What to say where ZeRO-3 runs over gloo without ``stage3_allgather_sequential`` (None otherwise): DeepSpeed's
    gather of several parameters at once (TRL's generation, the step's re-gather of persistent parameters, the
    state dict) then reads some of them before their all-gather arrives. NCCL finishes a stream's collectives in
    order, so GPU runs are not affected."""
    zero = (deepspeed_config or {}).get("zero_optimization", {})
    if backend != "gloo" or zero.get("stage") != 3 or zero.get("stage3_allgather_sequential", False):
        return None
    return (
        "DeepSpeed ZeRO-3 over gloo gathers several parameters at once by waiting for the last all-gather "
        "alone; gloo finishes them out of order, so parameters are read before they arrive now and then "
        '(wrong numbers). Set "stage3_allgather_sequential": true in zero_optimization'
    )


@contextlib.contextmanager
def _gathered_one_by_one(parameters):
    import deepspeed

    with contextlib.ExitStack() as stack:
        for parameter in parameters:
            stack.enter_context(deepspeed.zero.GatheredParameters([parameter], modifier_rank=None))
        yield


def gathered_with(module: torch.nn.Module, parameters: Iterable[torch.Tensor | None]) -> None:
    """Have ZeRO-3 gather ``parameters`` (owned by other modules: the lm_head's, read by a fused loss that never
    calls the lm_head) in ``module``'s forward and backward, and reduce their gradients, as its own
    (``deepspeed.zero.register_external_parameter``). Nothing without ZeRO-3 partitioning."""
    partitioned = [p for p in parameters if p is not None and hasattr(p, "ds_id")]
    if not partitioned:
        return
    import deepspeed

    for parameter in partitioned:
        deepspeed.zero.register_external_parameter(module, parameter)


def _lora_delta(head: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor | None:
    """The summed delta of the active LoRA adapters of a PEFT ``lora.Linear`` (None when none is active)."""
    if getattr(head, "merged", False):  # merged into the base weight: the weight is already the effective one
        return None
    if getattr(head, "disable_adapters", False):
        return None
    active = getattr(head, "active_adapters", None) or []
    delta = None
    for name in active:
        if name not in getattr(head, "lora_A", {}):
            continue
        if getattr(head, "use_dora", {}).get(name, False):
            raise ValueError(
                f"the lm_head has a DoRA adapter ({name!r}), which the fused lm_head cannot fold in: "
                "merge it (merge_adapter()) or use the logits path (fused_lm_head=False)"
            )
        dropout = head.lora_dropout[name] if name in getattr(head, "lora_dropout", {}) else None
        if head.training and isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
            raise ValueError(
                f"the lm_head's LoRA adapter {name!r} has lora_dropout={dropout.p} on its input, which "
                "a weight cannot express while training: set lora_dropout=0 for the head, or use the "
                "logits path (fused_lm_head=False)"
            )
        if getattr(head.lora_B[name], "bias", None) is not None:
            raise ValueError(
                f"the lm_head's LoRA adapter {name!r} has a bias (lora_bias=True), which the fused "
                "lm_head does not fold in: use the logits path (fused_lm_head=False)"
            )
        a, b = head.lora_A[name].weight, head.lora_B[name].weight
        term = (b.to(torch.float32) @ a.to(torch.float32)) * float(head.scaling[name])
        delta = term if delta is None else delta + term
    if delta is None:
        return None
    if getattr(head, "fan_in_fan_out", False):
        delta = delta.T
    return delta.to(weight.dtype)


def output_layer(head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [V, H], bias [V] or None) of an output layer as its forward applies them: a plain Linear's own,
    or a PEFT LoRA layer's base weight plus its active adapters' delta (differentiable in the adapters'
    weights). Adapters a weight cannot express are refused (see the module docstring)."""
    copies = getattr(head, "modules_to_save", None)
    if copies is not None and hasattr(head, "original_module"):  # PEFT modules_to_save: a trained copy of the head
        active = [] if getattr(head, "disable_adapters", False) else list(getattr(head, "active_adapters", []))
        return output_layer(copies[active[0]] if active and active[0] in copies else head.original_module)
    base = getattr(head, "base_layer", None)
    if base is None:
        if hasattr(head, "lora_A") or hasattr(head, "adapter_layer_names"):
            raise ValueError(
                f"the lm_head is an adapter layer ({type(head).__name__}) without a base_layer: the "
                "fused lm_head cannot read its effective weight; use the logits path"
            )
        return head.weight, getattr(head, "bias", None)
    if not hasattr(head, "lora_A"):
        raise ValueError(
            f"the lm_head carries an adapter of type {type(head).__name__}, which the fused lm_head "
            "cannot fold into a weight: merge it first, or use the logits path (fused_lm_head=False)"
        )
    while getattr(base, "base_layer", None) is not None:  # stacked tuner layers
        base = base.base_layer
    weight = base.weight
    delta = _lora_delta(head, weight)
    return (weight if delta is None else weight + delta), getattr(base, "bias", None)
