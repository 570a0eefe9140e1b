"""The call pipeline behind every public loss and log-prob function (``loss.py``), in the order a call runs it.

A loss call is four steps, each one function called once, from ``loss`` below:

1. **prepare** (``inputs.prepare_inputs``): every check, the packing layout, the vocabulary shard and the backend,
   into one frozen ``LossInputs`` that carries the call (its source included); a context-parallel call's then made
   the call on the whole sequences (``context_parallel.whole_sequences``: this rank's log-prob pass, the per-token
   values exchanged), whose loss math runs in torch;
2. **correct and mask** (``corrected_and_masked``): the rollout correction's weights and rejections, then TRL's
   policy-term masks, each from a gradient-free log-prob pass where it needs one (the only step that may read the
   logits before the loss);
3. **reduce** (``loss_tokens``): each token's inputs and its weight in the reduced loss, as the token-weights kernel
   computes them (``kernel_reduction``: the options' reduction as the kernels' ``Reduction``);
4. **launch**: the input form's fused loss (``source.fused_loss``: one-pass or two-pass, recompute or 3-product),
   where the kernels compute the loss (the Triton backend, a token-level loss, one device's vocabulary); else the
   source's differentiable log-probs and the loss math in torch (``loss_in_torch``).

A log-prob call (``logprobs``) is the first step and the source's log-prob pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .context_parallel import whole_sequences
from .inputs import (
    CallSettings,
    LogprobSettings,
    LossCall,
    LossInputs,
    active_tokens,
    compacted,
    prepare_inputs,
    prepare_logprob_inputs,
)
from .kernels.contracts import (
    DIVISOR_GIVEN,
    DIVISOR_ROW,
    DIVISOR_SEQUENCE,
    DIVISOR_TOTAL,
    LossTokens,
    Reduction,
    TokenInputs,
)
from .objective import GRPOLossOutput, entropy_divisor, loss_from_logps, policy_masks, prompt_divisors
from .options import GRPOOptions, option_value
from .rollout_correction import check_call, reads_current
from .validation import check_teacher_topk, checked_teacher_topk


class PolicyTerms(NamedTuple):
    """What TRL's policy-term masks make of a call (``corrected_and_masked``): the importance weights, a separate
    policy mask where the loss math runs in torch (else folded into the weights), and the tokens the entropy bonus
    acts on."""

    importance_weights: torch.Tensor | None
    policy_mask: torch.Tensor | None
    bonus_mask: torch.Tensor


def loss(source, call: LossCall, settings: CallSettings) -> GRPOLossOutput:
    """A loss call on its input form's ``source``: prepare, correct and mask, reduce, launch (the module's
    docstring)."""
    inputs = prepare_inputs(source, call, settings)
    on_active = compacted(inputs, call, settings)
    if on_active is not None:  # the active tokens alone, packed: the same loss, metrics and gradients
        active_source, active_call, active_settings, positions = on_active
        out = loss(active_source, active_call, active_settings)
        return GRPOLossOutput(out.loss, out.metrics, _scattered(out.per_token_logps, positions, inputs))
    if settings.context_parallel_group is not None:  # each sequence split over ranks: the call on the whole ones
        inputs = whole_sequences(inputs, settings.context_parallel_group)
    opts = inputs.options
    first_pass = correction = policy = None
    if opts.rollout_correction is not None or opts.masks_tokens:
        inputs, first_pass, correction, policy = corrected_and_masked(inputs)
    fused = inputs.backend.kernels and opts.loss_in_kernel and inputs.vocab_shard is None
    if fused and (inputs.source.fused_in_graph or not inputs.backend.in_graph):
        out = inputs.source.fused_loss(inputs, loss_tokens(inputs, policy))
        out = out if inputs.caller_shape is None else inputs.as_called(out)
    else:
        logp, entropy = inputs.source.logprobs(inputs, opts.compute_entropy, final=True)
        out = loss_in_torch(
            inputs, logp, entropy, policy or PolicyTerms(inputs.importance_weights, None, inputs.mask_seq)
        )
    if opts.has_entropy_bonus:
        out.metrics["policy_loss"] = policy_loss_before_bonus(inputs, out, policy, first_pass)
    if correction is not None:
        out.metrics.update(correction.metrics)
    return out


def _scattered(per_token: torch.Tensor, positions: torch.Tensor, inputs: LossInputs) -> torch.Tensor:
    """A compacted call's per-token values [n] at their positions of the whole call's tokens, 0 elsewhere (and no
    gradient there), shaped as the call's ids."""
    whole = per_token.new_zeros(inputs.ids.numel()).index_put((positions,), per_token.reshape(-1))
    return whole.reshape(inputs.caller_shape if inputs.caller_shape is not None else inputs.ids.shape)


def logprobs(
    source, ids, temperature: float, compute_entropy: bool, settings: LogprobSettings, sum_squares: bool = False
) -> tuple:
    """(log-probs, entropy or None) in fp32, shaped like the ids, differentiable where autograd records; ``ids``
    None: the entropy alone. With ``sum_squares`` (no gradient) a third, each token's Σπ², from the same pass. The
    one body of the log-prob family (``loss.token_logprobs`` and the rest)."""
    inputs = prepare_logprob_inputs(source, ids, temperature, settings)
    if sum_squares:
        results = inputs.source.sum_squares(inputs, compute_entropy)
    else:
        results = inputs.source.logprobs(inputs, compute_entropy, final=True)
    if inputs.caller_shape is None:
        return results
    return tuple(None if t is None else t.reshape(inputs.caller_shape) for t in results)


def sequence_logprobs(source, ids, mask, temperature: float, settings: LogprobSettings) -> tuple:
    """The method family's log-prob pass (``methods.py``): (its ``LossInputs``, the differentiable log-probs in the
    sequence layout [S, T_max], 0 where no token counts; the mask there). Masked tokens are not read."""
    inputs = prepare_logprob_inputs(source, ids, temperature, settings, mask=mask)
    active = active_tokens(inputs, settings.check_ids)
    if active is None:
        logp, _ = inputs.source.logprobs(inputs, False, final=True)
        return inputs, inputs.layout.seq(logp), inputs.mask_seq
    positions, cu_seqlens, gathered = active  # the active tokens alone, packed: the same log-probs
    on_rows = settings._replace(cu_seqlens=cu_seqlens, check_ids=False, drop_last_position=False)
    ids_active = inputs.ids.reshape(-1)[positions]
    active_inputs = prepare_logprob_inputs(inputs.source.on_rows(gathered), ids_active, temperature, on_rows)
    logp_active, _ = active_inputs.source.logprobs(active_inputs, False, final=True)
    return inputs, inputs.layout.seq(_scattered(logp_active, positions, inputs)), inputs.mask_seq


def logprobs_at_ids(source, teacher_ids, teacher_logps, mask, temperature: float, settings: LogprobSettings) -> tuple:
    """The top-k distillation's log-prob pass (``distillation.py``): (its ``LossInputs``, the student's differentiable
    log-probs at the teacher's K ids a token, the teacher's log-probs; both [B, T, K], a packed call's [1, total, K]).
    The first of each token's ids is the pass's target; masked tokens are not read, and where they are most of the
    call the pass runs on the active tokens alone (``inputs.active_tokens``), 0 at the others as everywhere."""
    check_teacher_topk(teacher_ids, teacher_logps, mask)
    token_shape, first = teacher_ids.shape[:-1], teacher_ids[..., 0]
    # the teacher's K ids are checked together below (the first of them is the pass's target)
    inputs = prepare_logprob_inputs(source, first, temperature, settings._replace(check_ids=False), mask=mask)
    V = inputs.vocab_shard.vocab_size if inputs.vocab_shard is not None else inputs.source.logits_shape(inputs.ids)[-1]
    ids_k, logps = checked_teacher_topk(
        teacher_ids, teacher_logps, token_shape, tuple(inputs.ids.shape), V, inputs.ids.device, inputs.mask,
        settings.check_ids,
    )  # fmt: skip
    active = active_tokens(inputs, settings.check_ids)
    if active is None:
        return inputs, inputs.source.logprobs_at_ids(inputs, ids_k), logps
    positions, cu_seqlens, gathered = active  # the active tokens alone, packed: the same log-probs at their ids
    K = ids_k.shape[-1]
    ids_active = ids_k.reshape(-1, K)[positions]
    on_rows = settings._replace(cu_seqlens=cu_seqlens, check_ids=False, drop_last_position=False)
    active_inputs = prepare_logprob_inputs(inputs.source.on_rows(gathered), ids_active[:, 0], temperature, on_rows)
    ids_per_token = ids_active.view(*active_inputs.ids.shape, K)
    rows = active_inputs.source.logprobs_at_ids(active_inputs, ids_per_token).reshape(-1, K)
    logq = rows.new_zeros(inputs.ids.numel(), K).index_put((positions,), rows).view(ids_k.shape)
    return inputs, logq, logps


# ---- 2. Correct and mask ------------------------------------------------------------------------------------------


def corrected_and_masked(inputs: LossInputs) -> tuple:
    """(the call with its rollout correction applied, this call's gradient-free (log-probs, entropy) where a step
    needed them, the correction's result or None, the ``PolicyTerms`` of TRL's masks or None)."""
    opts = inputs.options
    correction, first_pass, policy = opts.rollout_correction, None, None
    if correction is not None:
        check_call(correction, inputs.sampling_logps, inputs.importance_weights, inputs.old_logps)
    if opts.masks_tokens or (correction is not None and reads_current(correction, inputs.old_logps)):
        with torch.no_grad():  # this call's log-probs / entropies first: one more read of the logits
            first_pass = inputs.source.logprobs(inputs, opts.masks_high_entropy)
    if correction is not None:  # the correction's weights and rejections, then the masks on top of them
        inputs, correction = with_rollout_correction(inputs, first_pass)
    if opts.masks_tokens:
        policy = with_policy_masks(inputs, first_pass)
    return inputs, first_pass, correction, policy


def with_rollout_correction(inputs: LossInputs, first_pass) -> tuple[LossInputs, object]:
    """The call with its rollout correction applied (``rollout_correction.py``): the weights as its importance
    weights, the rejected tokens out of its mask, in bypass mode the sampler's log-probs as the old ones; and the
    correction (its metrics). Computed in the sequence layout from detached fp32 log-probs: the old ones, or this
    call's own (``first_pass``, token layout) where there are none or the correction compares the current
    policy."""
    correction, L = inputs.options.rollout_correction, inputs.layout
    sampling = L.seq(inputs.sampling_logps).detach().float()
    if reads_current(correction, inputs.old_logps):
        old = L.seq(first_pass[0])
    else:
        old = L.seq(inputs.old_logps)
    mask_seq = inputs.mask_seq if inputs.mask_seq is not None else torch.ones_like(sampling)
    with torch.no_grad():
        result = correction.compute(old.detach().float(), sampling, mask_seq)

    def token_layout(t):  # a [S, T_max] result of a packed call as its tokens, one row [1, total]
        if t is None or not L.packed or t.shape[-1] == 1:
            return t
        return L.from_seq(t).reshape(1, L.N)

    mask = token_layout(result.mask).contiguous()
    inputs = inputs._replace(
        mask=mask,
        mask_seq=result.mask if L.packed else mask,
        importance_weights=token_layout(result.weights),
        old_logps=inputs.sampling_logps if correction.old_is_sampler() else inputs.old_logps,
    )
    return inputs, result


def with_policy_masks(inputs: LossInputs, first_pass) -> PolicyTerms:
    """TRL's policy-term masks from a first, gradient-free pass's (log-probs, entropy) in the token layout
    (0 at masked tokens): the masks need every token's entropy (the top-entropy quantile, gathered across
    processes) or each row's mean log-prob gap (the off-policy mask) before any gradient is final. They
    are computed in the sequence layout.

    Where the kernels compute the loss, the masks are folded into the importance weights (sequence
    layout), which multiply the policy term only, as TRL's masks do: so the one-pass kernel still writes
    the gradient in its single pass. Where the loss math runs in torch, the mask stays separate (vespo
    takes the importance weights into its sequence weight instead of the loss)."""
    opts, L, mask_seq = inputs.options, inputs.layout, inputs.mask_seq
    logp, entropy = (L.seq(t) for t in first_pass)
    sampling = inputs.old_logps if inputs.sampling_logps is None else inputs.sampling_logps
    policy_mask, entropy_mask = policy_masks(
        logp, entropy, mask_seq, L.seq(inputs.advantages).detach().float(), L.seq(sampling), opts
    )
    bonus_mask = mask_seq if entropy_mask is None else mask_seq * entropy_mask
    importance_weights = L.seq(inputs.importance_weights)
    if not opts.loss_in_kernel:
        return PolicyTerms(importance_weights, policy_mask, bonus_mask)
    if importance_weights is not None:
        policy_mask = importance_weights.detach().float() * policy_mask
    return PolicyTerms(policy_mask.expand_as(mask_seq), None, bonus_mask)


# ---- 3. Reduce ----------------------------------------------------------------------------------------------------


def loss_tokens(inputs: LossInputs, policy: PolicyTerms | None) -> LossTokens:
    """The per-token side of a fused loss launch (``kernels.contracts.LossTokens``), with the importance weights
    and the entropy bonus's tokens the policy masks left (without masks: the call's own, and its mask): the tensors
    as the caller gave them where the kernels can read them so (no copy), the reduction as the token-weights kernel
    computes it."""
    L, o = inputs.layout, inputs.options
    importance_weights, bonus_mask = (
        (inputs.importance_weights, inputs.mask_seq)
        if policy is None
        else (policy.importance_weights, policy.bonus_mask)
    )
    bonus = None if bonus_mask is inputs.mask_seq else L.token_layout(bonus_mask).float().contiguous()
    tokens = TokenInputs(
        mask=inputs.mask,
        advantages=_counted_apart(inputs.advantages, L),
        old_logps=_fp32_tokens(inputs.old_logps),
        ref_logps=_fp32_tokens(inputs.ref_logps) if o.uses_kl else None,
        importance_weights=_counted_apart(L.token_layout(importance_weights) if L.packed else importance_weights, L),
    )
    divisors = None if inputs.prompt_ids is None else prompt_divisors(inputs.mask_seq, inputs.prompt_ids)
    reduction = kernel_reduction(o, L.S, inputs.normalizer, inputs.loss_scale, bonus, divisors)
    return LossTokens(tokens, L.sequences, reduction)


def _counted_apart(t: torch.Tensor | None, L) -> torch.Tensor | None:
    """A per-sequence or per-token input as the kernels tell them apart, by their count: where a packed call has as
    many sequences as tokens (some empty, some longer), its per-sequence [S, 1] given to its tokens (a per-token one
    is [1, N] there: ``SequenceLayout.check_per_sequence_or_token``)."""
    if t is None or not L.packed or L.S != L.N or not L.per_sequence(t):
        return t
    return L.tokens(t)


def _fp32_tokens(t: torch.Tensor | None) -> torch.Tensor | None:
    """A per-token tensor as the kernels read it, at its pointer, token n at element n: fp32 and contiguous (the
    tensor itself when it is; its shape kept)."""
    if t is None or (t.dtype is torch.float32 and t.is_contiguous()):
        return t
    return t.float().contiguous()


def kernel_reduction(
    opts: GRPOOptions,
    S: int,
    normalizer,
    loss_scale,
    bonus_mask: torch.Tensor | None = None,
    sequence_divisors: torch.Tensor | None = None,
) -> Reduction:
    """``objective.reduction_weights`` (times ``loss_scale``) as the token-weights kernel computes them
    (``kernels/reduce.py``), over S sequences.

    ``normalizer``: None, a number or a 0-d tensor (token_count); ``loss_scale``: a float or a 0-d tensor;
    ``sequence_divisors``: each sequence's divisor in the prompt mean (``objective.prompt_divisors``, fp32 [S])."""
    kind = opts.reduction
    divisor_kind, divisor = DIVISOR_GIVEN, 1.0
    if kind == "prompt_mean":
        divisor_kind, divisor = DIVISOR_SEQUENCE, sequence_divisors
    elif kind == "row_token_mean":
        divisor_kind = DIVISOR_ROW
    elif kind == "batch_token_mean" or (kind == "token_count" and normalizer is None):
        divisor_kind = DIVISOR_TOTAL
    elif kind == "constant":
        divisor = float(S * opts.max_completion_length)
    elif kind == "rows":
        divisor = float(S)
    elif isinstance(normalizer, torch.Tensor):  # token_count: read on the device (no host sync)
        divisor = normalizer
    else:  # a number (0 divides as 1 where the kernel is launched: no token is active then)
        divisor = float(normalizer)
    # (inside a graph the option's runtime scalar: reading the float there would guard on its value)
    entropy_coef = option_value(opts, "entropy_coef") if torch.compiler.is_compiling() else opts.entropy_coef
    return Reduction(divisor_kind, divisor, loss_scale, entropy_coef, bonus_mask, opts.entropy_reduction == "loss")


# ---- 4. Launch: the loss math in torch where the kernels do not compute the loss ----------------------------------


def loss_in_torch(inputs: LossInputs, logp, entropy, policy: PolicyTerms) -> GRPOLossOutput:
    """The loss math in torch on differentiable log-probs (and entropy) of the token layout: every
    per-token input taken to the sequence layout, the output given back as the caller shaped it."""
    seq = inputs.layout.seq
    per_token = TokenInputs(
        mask=inputs.mask_seq,
        advantages=seq(inputs.advantages),
        old_logps=seq(inputs.old_logps),
        ref_logps=seq(inputs.ref_logps),
        importance_weights=seq(policy.importance_weights),
    )
    out = loss_from_logps(
        seq(logp),
        seq(entropy),
        per_token,
        inputs.normalizer,
        inputs.options,
        inputs.loss_scale,
        policy.bonus_mask,
        policy.policy_mask,
        inputs.prompt_ids,
    )
    return inputs.as_called(out, seq_layout=True)


def policy_loss_before_bonus(inputs: LossInputs, out: GRPOLossOutput, policy, first_pass) -> torch.Tensor:
    """TRL's ``policy_loss`` metric, logged where the entropy bonus is on: the reduced loss before the bonus is
    subtracted and before ``loss_scale`` (0-d, detached; NaN with a loss_scale of 0, which leaves no loss to read
    it from). The bonus's entropy is the mean over its tokens: the call's mask, or the high-entropy tokens."""
    opts = inputs.options
    if policy is None or policy.bonus_mask is inputs.mask_seq:  # the entropy metric is the bonus tokens' mean
        tokens = inputs.mask_seq
        total = out.metrics["entropy"] * tokens.sum().clamp(min=1.0)
    else:
        entropy, tokens = inputs.layout.seq(first_pass[1]), policy.bonus_mask
        total = (entropy * tokens).sum()
    bonus_entropy = total / entropy_divisor(tokens, opts, inputs.mask_seq, inputs.normalizer)
    scale = inputs.loss_scale
    unscaled = (
        out.loss.detach() / scale
        if not (scale.__class__ is float and scale == 0.0)
        else torch.full_like(out.loss.detach(), float("nan"))
    )
    return unscaled + option_value(opts, "entropy_coef", bonus_entropy) * bonus_entropy
