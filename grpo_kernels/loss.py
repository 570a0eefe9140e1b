"""The public face: the loss functions and Modules (from logits; from hidden states with the lm_head) and the log-prob
family. Each makes its input form's source (``from_logits.LogitsSource``, ``from_hidden_states.HiddenStatesSource``)
and its call (``inputs.LossCall`` with ``inputs.CallSettings``, or ``inputs.LogprobSettings``), and hands them to the
call pipeline (``pipeline.loss``, ``pipeline.logprobs``): prepare, correct and mask, reduce, launch.
"""

from __future__ import annotations

import torch
from torch import nn

from . import pipeline
from .from_hidden_states import HiddenStatesSource
from .from_logits import LogitsSource
from .inputs import CallSettings, LogprobSettings, LossCall, options_from
from .kept_set import KeptSet
from .objective import GRPOLossOutput
from .option_docs import HIDDEN_STATES_KEYWORDS, LOGITS_KEYWORDS, docstring_options
from .options import GRPOOptions
from .validation import check_backend, check_head_precision, check_lm_head_mode, check_options_or_keywords


def grpo_loss(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    normalizer=None,
    *,
    options: GRPOOptions | None = None,
    backend: str = "auto",
    in_place_backward: bool = False,
    check_ids: bool = True,
    one_pass: bool | None = None,
    loss_scale=1.0,
    drop_last_position: bool = False,
    sampling_logps: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    prompt_ids: torch.Tensor | None = None,
    kept_set: KeptSet | None = None,
    context_parallel_group=None,
    **option_kwargs,
) -> GRPOLossOutput:
    """The GRPO loss from logits [B, T, V]; ``logits[:, t]`` predicts ``completion_ids[:, t]``.

    Vocabulary parallelism: with ``vocab_parallel_group`` (a torch.distributed ProcessGroup), the
    logits are this rank's contiguous slice of the vocabulary [B, T, V / P] (Megatron's equal
    partitions, or starting at ``vocab_start_index``); the ids stay global. The ranks exchange
    O(B * T) values, never logits; the loss, log-probs and metrics are the unsharded ones on every
    rank, and each rank's gradient is its slice of the unsharded gradient (``vocab_parallel.py``).

    A packed (padding-free) batch: ``cu_seqlens`` [S + 1] (int32 / int64, flash-attention's
    convention: sequence s is tokens cu_seqlens[s] to cu_seqlens[s + 1]) with logits [total, V] or
    [1, total, V]; ids, mask and the per-token inputs [total] or [1, total]; advantages and
    importance weights per sequence [S] or per token. The loss, gradient and metrics are those of
    the padded layout for the same sequences.

    ``sampling_logps`` [B, T] (the sampler's log-probs, e.g. vLLM's) feed the off-policy mask
    (``off_policy_mask_threshold``; without them it uses ``old_logps``, as TRL does) and the
    ``rollout_correction`` (``rollout_correction.py``: verl's, TRL's or OpenRLHF's weights and rejections).

    ``kept_set`` (``KeptSet``): the sampler's kept ids of each token (top-k / top-p replay): the current policy's
    log-prob of a token is taken over its set (z_y / T - logsumexp of z / T over the set), its gradient zero outside
    the set. ``old_logps`` / ``ref_logps`` are the caller's: compute them over the same sets with
    ``token_logprobs(..., kept_set=)``. The conventions (a target outside its set, the entropy's distribution) are
    the set's (``kept_set.py``).

    ``prompt_ids`` [B] (a packed call's [S]), integers: each sequence's prompt, for ``aggregation="prompt_mean"``
    (SkyRL's prompt mean: each prompt's token mean, then the mean over the call's prompts). A prompt's sequences
    belong in one call; a step whose prompts span several calls passes ``loss_scale`` = this call's prompts / the
    step's (times the trainer's own scale) for the step's prompt mean.

    With ``drop_last_position=True``, ``logits`` is [B, T + 1, V], as a causal LM returns them
    with ``logits_to_keep = T + 1``: the last position predicts no completion token, is never
    read and gets a zero gradient. Passing that tensor rather than ``logits[:, :-1]`` lets the
    gradient be written at its full shape directly, where autograd would zero-fill a
    [B, T + 1, V] tensor and copy the view's [B, T, V] gradient into it (3 x S more bytes).

    Options come as ``options=GRPOOptions(...)`` or as keywords (TRL's names). See
    ``GRPOLoss`` for the arguments. ``loss_scale`` (a number or a 0-d tensor, e.g. 1 /
    gradient-accumulation steps) multiplies the returned loss; the one-pass kernel folds it
    into the gradient it writes, so ``out.loss.backward()`` then moves no extra byte.
    Context parallelism: with ``context_parallel_group`` (a torch.distributed ProcessGroup), each sequence is split
    over the group's ranks (Megatron's zigzag chunks, or any split: a token's place in its sequence changes nothing),
    and each rank passes its own tokens of every sequence, the same sequences in the same order: [B, T_part] rows, or
    a packed batch with this rank's ``cu_seqlens``; the per-sequence inputs (advantages [B], ``prompt_ids``) the same
    on every rank, a ``normalizer`` the whole batch's. Every rank returns the loss and metrics of the whole sequences,
    and the whole loss's gradient at its own tokens (``context_parallel.py``: a trainer that averages gradients over
    data x context ranks scales the loss by the group's size, as Megatron's own loss does).
    """
    source = LogitsSource(
        logits, drop_last_position=drop_last_position, in_place_backward=in_place_backward, one_pass=one_pass
    )
    call = LossCall(
        completion_ids,
        completion_mask,
        advantages,
        old_logps,
        ref_logps,
        importance_weights,
        normalizer,
        loss_scale,
        sampling_logps,
        cu_seqlens,
        prompt_ids,
        kept_set,
    )
    options = options_from(options, option_kwargs)
    return pipeline.loss(
        source,
        call,
        CallSettings(
            options, backend, check_ids, vocab_parallel_group, vocab_start_index,
            context_parallel_group=context_parallel_group,
        ),
    )  # fmt: skip


def fused_linear_grpo_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    normalizer=None,
    *,
    bias: torch.Tensor | None = None,
    options: GRPOOptions | None = None,
    backend: str = "auto",
    check_ids: bool = True,
    loss_scale=1.0,
    lm_head_mode: str | None = None,
    sampling_logps: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    reduce_hidden_grad: bool = True,
    head_precision: str = "input",
    prompt_ids: torch.Tensor | None = None,
    kept_set: KeptSet | None = None,
    context_parallel_group=None,
    **option_kwargs,
) -> GRPOLossOutput:
    """The GRPO loss from hidden states [B, T, H] and the lm_head weight [V, H], never holding [N, V] logits.

    ``hidden_states[:, t]`` is the state whose logits predict ``completion_ids[:, t]``. Every
    option, output and metric is that of ``grpo_loss`` on ``hidden_states @ weight.T + bias``.
    A weight that does not require grad (a frozen lm_head, LoRA) gets no gradient pass. ``weight`` must
    be the head's effective weight: with an adapter on the head (PEFT LoRA on ``lm_head``),
    ``head.weight`` is the base alone; pass ``grpo_kernels.wrapped.output_layer(head)`` (the adapter
    folded in, differentiable in its weights). Under DDP / FSDP2 / DeepSpeed, compute the hidden states
    and this loss inside the wrapped model's forward (``grpo_kernels.wrapped.inside_forward``).

    ``lm_head_mode`` (Triton, token level): "recompute" (4 products: the backward recomputes
    each chunk's logits inside the kernels) or "three_products" (each chunk's logits computed
    once by cuBLAS, turned into dlogits in place by the one-pass kernel, both gradient products
    in the same loop; the backward only scales). Both keep one [chunk, V] workspace. None, the
    default, takes the device sweep's measured choice (``kernels/tuned.json``), else "recompute".

    ``head_precision``: "input" (the default) computes the logits as an unfused head in the operands' dtype does
    (16-bit operands on the tensor cores, fp32 accumulation, the logits rounded once to that dtype), in every mode
    and backend; "fp32_logits" takes the same operands and accumulation and keeps the fp32 accumulator as the logit,
    never rounded, as an fp32-output head computes it (a rollout engine that samples from fp32 logits of 16-bit
    operands; in the 3-product mode each chunk's product has an fp32 output and its dlogits are cast to the
    operands' dtype for the gradient products, as such a head's backward casts them); "fp32" casts
    hidden states, weight and bias to fp32 first (exact fp32 products and fp32 logits, as TRL's
    ``cast_lm_head_to_fp32`` and a head with fp32 weights), the gradients coming back in their dtypes.

    ``kept_set`` as in ``grpo_loss``: each kept logit is computed as its own dot product of the token's hidden state
    and the id's weight row (rounded as the head rounds its logits), beside the head's tiles, in every mode.

    ``vocab_parallel_group``: ``weight`` is this rank's rows of the head [V / P, H] (Megatron's column-parallel
    head), the ids global. ``reduce_hidden_grad`` says who sums d hidden over the group: True (the default), the
    hidden states are the same on every rank and nothing else reduces them, so this op all-reduces d hidden; False,
    the caller gathered them through a mapping whose backward sums over the group (Megatron's
    ``gather_from_sequence_parallel_region`` under sequence parallelism, ``copy_to_tensor_model_parallel_region``
    without it), so this op returns this rank's share and the mapping sums it (``docs/stacks.md``).

    ``context_parallel_group``: each sequence split over the group's ranks, as in ``grpo_loss``.
    """
    source = HiddenStatesSource(hidden_states, weight, bias, lm_head_mode, head_precision)
    call = LossCall(
        completion_ids,
        completion_mask,
        advantages,
        old_logps,
        ref_logps,
        importance_weights,
        normalizer,
        loss_scale,
        sampling_logps,
        cu_seqlens,
        prompt_ids,
        kept_set,
    )
    options = options_from(options, option_kwargs)
    return pipeline.loss(
        source,
        call,
        CallSettings(
            options, backend, check_ids, vocab_parallel_group, vocab_start_index, reduce_hidden_grad,
            context_parallel_group,
        ),
    )  # fmt: skip


# ---- The log-prob family -------------------------------------------------------------------------------------
#
# One set of keywords: backend, check_ids (the ids' one host sync; False skips it), drop_last_position,
# cu_seqlens, vocab_parallel_group / vocab_start_index, logit_scale / logit_softcap (the head's output transform);
# in_place_backward where there is a backward. The ids
# are ``ids`` everywhere. token_entropy has no ids, so no check_ids (and no packing: its values are per
# position, whatever sequence a position belongs to).


@torch.no_grad()
def token_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    backend: str = "auto",
    check_ids: bool = True,
    drop_last_position: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    return_sum_pi_squared: bool = False,
    kept_set: KeptSet | None = None,
):
    """Per-token log softmax(logits / temperature)[ids] in fp32, shaped like ``ids``, without gradient.

    For a trainer's old and reference log-probs; the same kernel as the loss, one read of
    the logits. logits [B, T, V] (any leading dims [..., V]; [B, T + 1, V] with
    ``drop_last_position``, as in ``grpo_loss``), or a packed batch's [total, V] with ``cu_seqlens``
    (the result is then [total]: log-probs are per token, the sequences only need to be valid). With
    ``return_entropy`` returns ``(logps, entropy)``. With ``vocab_parallel_group``, ``logits`` is this
    rank's vocabulary slice and the ids are global, as in ``grpo_loss``. ``logit_scale`` and ``logit_softcap``:
    the logits are a head's raw outputs, transformed as the options of those names say (see ``GRPOLoss``).
    ``return_sum_pi_squared``: also each token's sum of squared probabilities Σπ² = sum_v softmax(...)_v^2, from
    the same pass (verl's ``calculate_sum_pi_squared_from_logits``, for its optimal token baseline), returned last.
    ``kept_set`` (``KeptSet``): each token's log-prob (Σπ², and the entropy where the set says so) over the ids its
    sampler kept, as in ``grpo_loss``: the old and reference log-probs of a top-k / top-p run.
    """
    source = LogitsSource(logits, drop_last_position=drop_last_position)
    settings = LogprobSettings.of(locals())
    results = pipeline.logprobs(source, ids, temperature, return_entropy, settings, return_sum_pi_squared)
    return _wanted(results, return_entropy, return_sum_pi_squared)


def _wanted(results: tuple, entropy: bool, sum_squares: bool):
    """A log-prob call's return: the log-probs alone, or a tuple with the entropy and Σπ² where asked for."""
    chosen = (results[0],) + ((results[1],) if entropy else ()) + ((results[2],) if sum_squares else ())
    return chosen if len(chosen) > 1 else chosen[0]


@torch.no_grad()
def linear_token_logprobs(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    backend: str = "auto",
    check_ids: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    head_precision: str = "input",
    return_sum_pi_squared: bool = False,
    kept_set: KeptSet | None = None,
):
    """``token_logprobs`` of ``hidden_states @ weight.T + bias`` without the [N, V] logits: the old and reference
    log-probs of a fused lm_head user (the lm_head forward kernel, a tile of logits at a time; the torch
    path a chunk of tokens at a time). hidden_states [B, T, H] (any leading dims [..., H]; a packed
    batch's [total, H] with ``cu_seqlens``), weight [V, H] (with ``vocab_parallel_group``: this rank's
    shard [V / P, H], the ids global), bias [V] or None. No gradient (``linear_selective_log_softmax`` and
    ``linear_selective_log_softmax_and_entropy`` have one). ``weight`` must be the head's effective weight (an
    adapter on the head: ``grpo_kernels.wrapped.output_layer``), and ``logit_scale`` / ``logit_softcap`` its output
    transform (a model's: ``grpo_kernels.heads.head_transform(model).options``); ``head_precision`` as in
    ``fused_linear_grpo_loss``; ``return_sum_pi_squared`` and ``kept_set`` as in ``token_logprobs`` (each kept logit
    its own dot product: still no [N, V] tensor)."""
    return _linear_logprobs(locals(), return_entropy, return_sum_pi_squared)


def linear_selective_log_softmax(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    *,
    backend: str = "auto",
    check_ids: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    reduce_hidden_grad: bool = True,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    head_precision: str = "input",
    kept_set: KeptSet | None = None,
) -> torch.Tensor:
    """Differentiable log softmax(cap(hidden_states @ weight.T + bias) / temperature)[ids] in fp32, the fused head as
    an op: the gradient reaches ``hidden_states``, ``weight`` (unless it does not require one: a frozen head) and
    ``bias`` in their dtypes, and no [N, V] tensor is ever held (the backward recomputes the logits a tile at a
    time). For a trainer that computes its own loss on log-probs (verl's ``use_fused_kernels``, NeMo-RL, SkyRL).
    The arguments are ``linear_token_logprobs``'s, and ``reduce_hidden_grad`` (with ``vocab_parallel_group``: who
    sums d hidden over the group, this op or the caller's mapping; see ``fused_linear_grpo_loss``)."""
    return _linear_logprobs(locals(), False)


def linear_selective_log_softmax_and_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    *,
    backend: str = "auto",
    check_ids: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    reduce_hidden_grad: bool = True,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    head_precision: str = "input",
    kept_set: KeptSet | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear_selective_log_softmax(...), the entropy of the same distribution)``, both fp32 and differentiable
    (an entropy bonus's gradient, dH/dz = -p (log p + H), runs in the same backward), from one pass of the head."""
    return _linear_logprobs(locals(), True)


def _linear_logprobs(settings: dict, return_entropy: bool, sum_squares: bool = False):
    """The one body of the hidden-states log-prob family: the head in its precision, then ``pipeline.logprobs``
    (``settings``: the public function's arguments)."""
    source = HiddenStatesSource(
        settings["hidden_states"], settings["weight"], settings["bias"], head_precision=settings["head_precision"]
    )
    results = pipeline.logprobs(
        source, settings["ids"], settings["temperature"], return_entropy, LogprobSettings.of(settings), sum_squares
    )
    return _wanted(results, return_entropy, sum_squares)


def selective_log_softmax(
    logits: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    backend: str = "auto",
    check_ids: bool = True,
    in_place_backward: bool = False,
    drop_last_position: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    kept_set: KeptSet | None = None,
) -> torch.Tensor:
    """Differentiable ``log_softmax(logits / temperature).gather(-1, ids)`` in fp32, on the fused kernel.

    logits [..., V] (any leading dims, e.g. verl's packed [N, V]); ids [...]. The gradient
    is written in the logits' dtype without materializing the log-softmax: a drop-in for
    TRL's ``selective_log_softmax`` and verl's ``logprobs_from_logits``. With ``vocab_parallel_group``
    the logits are this rank's vocabulary slice and the ids global (Megatron's layout, as in
    ``grpo_loss``): a drop-in for verl's ``vocab_parallel_log_probs_from_logits``. ``kept_set``: the log-probs
    over each token's kept set (``grpo_loss``), their gradient only over the set.
    """
    source = LogitsSource(logits, drop_last_position=drop_last_position, in_place_backward=in_place_backward)
    return pipeline.logprobs(source, ids, temperature, False, LogprobSettings.of(locals()))[0]


def token_entropy(
    logits: torch.Tensor,
    temperature: float = 1.0,
    *,
    backend: str = "auto",
    in_place_backward: bool = False,
    drop_last_position: bool = False,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Differentiable entropy of softmax(logits / temperature) over the last dim, fp32 [...], on the fused kernel.

    One read of the logits in the forward, one more in the backward, which writes
    dH/dlogits = -p (log p + H) / tau scaled by the incoming gradient, in the logits' dtype; no
    fp32 [N, V] softmax is materialized. A drop-in for verl's ``entropy_from_logits`` (and, with
    ``vocab_parallel_group``, on this rank's vocabulary slice, for ``vocab_parallel_entropy``).
    """
    source = LogitsSource(logits, drop_last_position=drop_last_position, in_place_backward=in_place_backward)
    return pipeline.logprobs(source, None, temperature, True, LogprobSettings.of(locals()))[1]


def selective_log_softmax_and_entropy(
    logits: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    backend: str = "auto",
    check_ids: bool = True,
    in_place_backward: bool = False,
    drop_last_position: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    kept_set: KeptSet | None = None,
):
    """``(selective_log_softmax(...), token_entropy(...))`` from one pass over the logits, both differentiable
    (the backward is one pass too, whichever of the two the loss uses). fp32, shapes ``ids.shape``."""
    source = LogitsSource(logits, drop_last_position=drop_last_position, in_place_backward=in_place_backward)
    return pipeline.logprobs(source, ids, temperature, True, LogprobSettings.of(locals()))


# ---- The Modules -----------------------------------------------------------------------------------------------


class _LossModule(nn.Module):
    """What both loss Modules hold: the options (``options=``, or keywords with an optional ``preset=``), the
    backend, the ids check and the vocabulary-parallel group. Each Module adds its own input form's keywords."""

    def __init__(
        self,
        *,
        backend: str,
        check_ids: bool,
        options: GRPOOptions | None,
        preset: str | None,
        vocab_parallel_group,
        vocab_start_index: int | None,
        context_parallel_group,
        option_kwargs: dict,
    ):
        super().__init__()
        check_options_or_keywords(options, option_kwargs, preset)
        if options is None:
            options = (
                GRPOOptions.from_preset(preset, **option_kwargs) if preset is not None else GRPOOptions(**option_kwargs)
            )
        self.options = options
        check_backend(backend)
        self.backend = backend
        self.check_ids = check_ids
        self.vocab_parallel_group, self.vocab_start_index = vocab_parallel_group, vocab_start_index
        self.context_parallel_group = context_parallel_group

    @classmethod
    def from_trl_config(cls, config, **kwargs):
        """This Module with a TRL ``GRPOConfig``'s loss options (TRL's conventions); the Module's own keywords
        (``backend``, ...) pass through."""
        own = set(LOGITS_KEYWORDS) | {
            "lm_head_mode", "head_precision", "vocab_parallel_group", "vocab_start_index", "reduce_hidden_grad",
            "context_parallel_group",
        }  # fmt: skip
        module_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in own}
        return cls(options=GRPOOptions.from_trl_config(config, **kwargs), **module_kwargs)

    def update(self, **changes):
        """Change options between steps (e.g. a beta or temperature schedule)."""
        self.options = self.options.replace(**changes)
        return self

    def extra_repr(self) -> str:
        return f"{self.options}, backend={self.backend!r}"

    def _settings(self) -> CallSettings:
        return CallSettings(
            self.options,
            self.backend,
            self.check_ids,
            self.vocab_parallel_group,
            self.vocab_start_index,
            getattr(self, "reduce_hidden_grad", True),
            self.context_parallel_group,
        )


class GRPOLoss(_LossModule):
    """Drop-in GRPO loss from logits, fused in Triton on CUDA (chunked torch on CPU).

    {options}

    Call: ``loss_fn(logits, completion_ids, completion_mask, advantages, old_logps=None,
    ref_logps=None, importance_weights=None, normalizer=None, loss_scale=1.0, sampling_logps=None,
    cu_seqlens=None, prompt_ids=None)``

    - logits [B, T, V] (fp32 / bf16 / fp16; a view with unit last stride is read in place), or
      [B, T + 1, V] as the model returns them with ``drop_last_position=True`` (the last
      position is ignored; this saves the copy autograd makes of a ``logits[:, :-1]`` view's
      gradient)
    - completion_ids [B, T] integers in [0, V); completion_mask [B, T] bool / int / float
    - advantages [B] or [B, T]; old_logps [B, T] or None (on-policy, ratio 1);
      ref_logps [B, T] when beta > 0; importance_weights [B], [B, 1] or [B, T]
    - normalizer: token count for dapo / cispo / vespo (default: local active tokens)
    - prompt_ids [B] integers: each row's prompt, for ``aggregation="prompt_mean"``

    Returns ``GRPOLossOutput(loss, metrics, per_token_logps)``. Per-step values may change
    between calls (``loss_fn.update(beta=0.02)``) without recompiling a kernel.
    """

    KEYWORDS = LOGITS_KEYWORDS

    def __init__(
        self,
        *,
        backend: str = "auto",
        in_place_backward: bool = False,
        check_ids: bool = True,
        one_pass: bool | None = None,
        options: GRPOOptions | None = None,
        preset: str | None = None,
        drop_last_position: bool = False,
        vocab_parallel_group=None,
        vocab_start_index: int | None = None,
        context_parallel_group=None,
        **option_kwargs,
    ):
        super().__init__(
            backend=backend,
            check_ids=check_ids,
            options=options,
            preset=preset,
            vocab_parallel_group=vocab_parallel_group,
            vocab_start_index=vocab_start_index,
            context_parallel_group=context_parallel_group,
            option_kwargs=option_kwargs,
        )
        self.in_place_backward = in_place_backward
        self.one_pass = one_pass
        self.drop_last_position = drop_last_position

    def forward(
        self,
        logits,
        completion_ids,
        completion_mask,
        advantages,
        old_logps=None,
        ref_logps=None,
        importance_weights=None,
        normalizer=None,
        loss_scale=1.0,
        sampling_logps=None,
        cu_seqlens=None,
        prompt_ids=None,
        kept_set=None,
    ) -> GRPOLossOutput:
        source = LogitsSource(
            logits,
            drop_last_position=self.drop_last_position,
            in_place_backward=self.in_place_backward,
            one_pass=self.one_pass,
        )
        call = LossCall(
            completion_ids,
            completion_mask,
            advantages,
            old_logps,
            ref_logps,
            importance_weights,
            normalizer,
            loss_scale,
            sampling_logps,
            cu_seqlens,
            prompt_ids,
            kept_set,
        )
        return pipeline.loss(source, call, self._settings())


class FusedLinearGRPOLoss(_LossModule):
    """``GRPOLoss`` from hidden states and the lm_head weight: the [N, V] logits are never materialized.

    {options}

    Same options and outputs as ``GRPOLoss``; call with
    ``(hidden_states [B, T, H], weight [V, H], completion_ids, completion_mask, advantages,
    old_logps=None, ref_logps=None, importance_weights=None, normalizer=None, bias=None,
    loss_scale=1.0, sampling_logps=None, cu_seqlens=None, prompt_ids=None)``. ``lm_head_mode``, ``head_precision``,
    the effective weight with an adapter on the head, wrapped models: see ``fused_linear_grpo_loss``.
    """

    KEYWORDS = HIDDEN_STATES_KEYWORDS

    def __init__(
        self,
        *,
        backend: str = "auto",
        check_ids: bool = True,
        lm_head_mode: str | None = None,
        head_precision: str = "input",
        options: GRPOOptions | None = None,
        preset: str | None = None,
        vocab_parallel_group=None,
        vocab_start_index: int | None = None,
        reduce_hidden_grad: bool = True,
        context_parallel_group=None,
        **option_kwargs,
    ):
        for name in set(LOGITS_KEYWORDS) - set(HIDDEN_STATES_KEYWORDS):  # a GRPOLoss keyword given here by mistake
            if option_kwargs.get(name):
                raise ValueError(
                    f"{name}={option_kwargs[name]!r} applies to GRPOLoss on logits; FusedLinearGRPOLoss "
                    "takes hidden states and never holds logits (its modes: lm_head_mode=)"
                )
            option_kwargs.pop(name, None)
        super().__init__(
            backend=backend,
            check_ids=check_ids,
            options=options,
            preset=preset,
            vocab_parallel_group=vocab_parallel_group,
            vocab_start_index=vocab_start_index,
            context_parallel_group=context_parallel_group,
            option_kwargs=option_kwargs,
        )
        check_lm_head_mode(lm_head_mode)
        check_head_precision(head_precision)
        self.lm_head_mode, self.head_precision = lm_head_mode, head_precision
        self.reduce_hidden_grad = reduce_hidden_grad

    def forward(
        self,
        hidden_states,
        weight,
        completion_ids,
        completion_mask,
        advantages,
        old_logps=None,
        ref_logps=None,
        importance_weights=None,
        normalizer=None,
        bias=None,
        loss_scale=1.0,
        sampling_logps=None,
        cu_seqlens=None,
        prompt_ids=None,
        kept_set=None,
    ) -> GRPOLossOutput:
        source = HiddenStatesSource(hidden_states, weight, bias, self.lm_head_mode, self.head_precision)
        call = LossCall(
            completion_ids,
            completion_mask,
            advantages,
            old_logps,
            ref_logps,
            importance_weights,
            normalizer,
            loss_scale,
            sampling_logps,
            cu_seqlens,
            prompt_ids,
            kept_set,
        )
        return pipeline.loss(source, call, self._settings())


GRPOLoss.__doc__ = GRPOLoss.__doc__.replace("{options}", docstring_options(LOGITS_KEYWORDS))
FusedLinearGRPOLoss.__doc__ = FusedLinearGRPOLoss.__doc__.replace(
    "{options}", docstring_options(HIDDEN_STATES_KEYWORDS)
)
