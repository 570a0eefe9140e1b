"""Megatron-core's tensor-parallel cross entropy and output layer on our kernels (the ``megatron`` extra).

Megatron trainers (verl's Megatron engine, slime, NeMo-RL, ROLL, Megatron-LM's RL) compute the policy's log-probs
over tensor-parallel vocabulary shards: each rank holds ``V / TP`` columns of the output layer
(``ColumnParallelLinear``) and of the logits. What they call, and what replaces it here:

- ``tensor_parallel.vocab_parallel_cross_entropy(logits, target, label_smoothing=0.0)``:
  ``vocab_parallel_cross_entropy`` below, the same signature, sign, shapes and process group (the tensor-parallel
  group of Megatron's parallel state), from one pass over this rank's logits in fp32 (no [.., V / TP] fp32 copy and
  no saved softmax: the backward recomputes it).
- log-probs and entropy from vocabulary-parallel logits (what RL trainers compute beside the loss):
  ``vocab_parallel_logprobs_and_entropy``, one pass for both.
- ``logits, _ = output_layer(hidden_states)`` followed by either of the above: ``output_layer_logprobs``, the
  output layer fused in (no logits at all), with the output layer's own gradient contract: d hidden summed over the
  tensor-parallel group as its input mapping sums it (``copy_to_tensor_model_parallel_region``'s all-reduce, or,
  with sequence parallelism, the reduce-scatter of Megatron's own ``gather_from_sequence_parallel_region``, which
  this function calls: the caller's collectives, not a copy of them).

The contract of each (which inputs, which group, who reduces which gradient) is tested against megatron-core's own
functions on gloo ranks (``tests/test_megatron.py``). Context parallelism: the per-token values need no exchange
(verl's engine all-gathers them over the CP group and takes its loss on whole sequences); a loss over a rank's own
chunks, whose sequence-level reductions span the CP group, is not supported yet."""

from __future__ import annotations

import torch

from .. import (
    linear_selective_log_softmax,
    linear_selective_log_softmax_and_entropy,
    selective_log_softmax,
    selective_log_softmax_and_entropy,
)
from ..argument_docs import ADAPTER_ARGUMENTS, document_public


def _tensor_parallel_group():
    """Megatron's tensor-parallel group, None on one rank (no collective to run)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def _as_one_row(t: torch.Tensor, target: torch.Tensor, name: str) -> torch.Tensor:
    """[*target.shape, X] as the package's one row [1, N, X] (a view where the layout allows)."""
    if t.shape[:-1] != target.shape:
        raise ValueError(
            f"{name} must be [*target.shape, ...] = [{', '.join(map(str, target.shape))}, ...] (Megatron's [s, b] "
            f"layout), got {tuple(t.shape)}"
        )
    return t.reshape(1, -1, t.shape[-1])


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing=0.0):
    """megatron-core's ``tensor_parallel.vocab_parallel_cross_entropy``: -log softmax(logits)[target] over the whole
    vocabulary, each rank holding its ``V / TP`` columns (``vocab_parallel_logits`` [*target.shape, V / TP], this
    rank's slice in Megatron's order: rank r holds ids [r V / TP, (r + 1) V / TP)); fp32, shaped as ``target``.
    d logits is this rank's slice (no collective in the backward, as Megatron's).

    Where it differs from Megatron's: the logits are read, never written (Megatron's subtracts the row maximum from
    fp32 logits in place: no caller reads them after the loss, and softmax consumers are unchanged by the shift);
    a target outside [0, V) is refused by name (Megatron's takes it as matching no column: the loss is the
    log-sum-exp); ``label_smoothing`` > 0 is refused (Megatron's smooths over each rank's own columns, ``V / TP``
    of them, not the vocabulary: a number we will not reproduce)."""
    if label_smoothing != 0.0:
        raise ValueError(
            f"label_smoothing={label_smoothing!r} is not supported: megatron-core's vocab_parallel_cross_entropy "
            "smooths over each rank's own V / TP columns; pass label_smoothing=0.0"
        )
    rows = _as_one_row(vocab_parallel_logits, target, "vocab_parallel_logits")
    logp = selective_log_softmax(rows, target.reshape(1, -1), vocab_parallel_group=_tensor_parallel_group())
    return -logp.view(target.shape)


def vocab_parallel_logprobs_and_entropy(vocab_parallel_logits, target, temperature: float = 1.0) -> tuple:
    """(log softmax(logits / temperature)[target], the entropy of that distribution), each fp32 and shaped as
    ``target``, both differentiable, over the whole vocabulary from each rank's ``V / TP`` columns
    (``vocab_parallel_logits`` as in ``vocab_parallel_cross_entropy``), in one pass."""
    rows = _as_one_row(vocab_parallel_logits, target, "vocab_parallel_logits")
    logp, entropy = selective_log_softmax_and_entropy(
        rows, target.reshape(1, -1), temperature, vocab_parallel_group=_tensor_parallel_group()
    )
    return logp.view(target.shape), entropy.view(target.shape)


def output_layer_logprobs(
    output_layer,
    hidden_states: torch.Tensor,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    weight: torch.Tensor | None = None,
    compute_entropy: bool = False,
):
    """log softmax(output_layer(hidden_states)[0] / temperature)[target], the output layer fused in (no logits
    tensor); with ``compute_entropy``, (log-probs, entropy). fp32, shaped as ``target`` ([s, b]).

    ``output_layer``: Megatron's ``ColumnParallelLinear`` (the model's output layer: this rank's ``V / TP`` rows of the
    weight, its bias unless ``skip_bias_add``); ``weight``: a weight to use instead of its own (a model with tied
    embeddings passes the embedding's, as ``GPTModel`` does). ``hidden_states`` [s, b, H] as the output layer takes
    them: with sequence parallelism this rank's [s / TP, b, H], gathered here with Megatron's own
    ``gather_from_sequence_parallel_region`` (whose backward reduce-scatters d hidden); without, the whole sequence,
    d hidden all-reduced over the group by the op (the output layer's ``copy_to_tensor_model_parallel_region``).
    d weight (and d bias) reach the parameters' ``.grad``, which Megatron's DDP adds to ``main_grad`` (the
    gradient-accumulation fusion's direct write is not used)."""
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    if getattr(output_layer, "explicit_expert_comm", False):
        raise ValueError("output_layer is an expert layer (explicit_expert_comm): not an output layer this replaces")
    if getattr(output_layer.config, "defer_embedding_wgrad_compute", False):
        raise ValueError(
            "output_layer.config.defer_embedding_wgrad_compute=True defers the weight's gradient to Megatron's own "
            "GEMM; the fused output layer computes it in the backward: turn it off to use output_layer_logprobs"
        )
    weight = output_layer.weight if weight is None else weight
    bias = None if output_layer.skip_bias_add else output_layer.bias
    group = _tensor_parallel_group()
    reduce_hidden_grad = True
    if group is not None and output_layer.sequence_parallel:
        hidden_states = gather_from_sequence_parallel_region(hidden_states, True, group=output_layer.tp_group)
        reduce_hidden_grad = False  # the gather's backward reduce-scatters: the caller's mapping sums d hidden
    elif output_layer.disable_grad_reduce:
        reduce_hidden_grad = False  # the layer's owner reduces d hidden itself
    rows = _as_one_row(hidden_states, target, "hidden_states")
    fused = linear_selective_log_softmax_and_entropy if compute_entropy else linear_selective_log_softmax
    out = fused(
        rows,
        weight,
        target.reshape(1, -1),
        bias,
        temperature,
        vocab_parallel_group=group,
        reduce_hidden_grad=reduce_hidden_grad,
    )
    if compute_entropy:
        return out[0].view(target.shape), out[1].view(target.shape)
    return out.view(target.shape)


# the arguments' descriptions appended to the docstrings (the API reference's; argument_docs.py)
document_public(
    globals(),
    ["vocab_parallel_cross_entropy", "vocab_parallel_logprobs_and_entropy", "output_layer_logprobs"],
    ADAPTER_ARGUMENTS,
)
