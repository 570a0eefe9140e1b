"""The method family on the same kernels: SFT, RFT, DPO as gradient coefficients, and the reward-model loss.

For a completion o of question q every method's gradient is

    E[ 1/|o| * sum_t GC(q, o, t) * grad log pi(o_t | q, o_<t) ]

and only the data and the per-token gradient coefficient GC differ (DeepSeekMath, section
5.2.1). Our backward is ``dlogits = g_t * (onehot - p) / tau``: g_t is GC (times the
reduction's weight), so each method is the fused log-prob kernel plus O(B * T) math:

=========  ==============================  =================================================
method     GC                              here
=========  ==============================  =================================================
SFT        1                               ``sft_loss(logits, ids, mask)``
RFT        1 if o is correct else 0        ``rft_loss(logits, ids, mask, rewards)``
DPO        +-beta * sigmoid(beta(R- - R+))  ``dpo_loss(logits, ids, mask, ref_logps, beta)``
GRPO       ratio * A + beta (pi_ref/pi - 1)  ``GRPOLoss`` / ``grpo_loss``
=========  ==============================  =================================================

with R(o) = 1/|o| * sum_t (log pi - log pi_ref) for DPO. PPO with a learned critic (GAE
advantages) is out of scope: removing the critic is the point of GRPO.

Every loss here takes the GRPO entry points' inputs: padded [B, T, V] logits (``drop_last_position`` for a model's
[B, T + 1, V] output) or a packed batch ([total, V] with ``cu_seqlens``; the rows are then the S sequences), hidden
states [B, T, H] with the lm_head ``weight`` (and ``bias``: the fused head, no [N, V] logits), a vocabulary shard
(``vocab_parallel_group``), each sequence split over ranks (``context_parallel_group``: each rank's tokens of every
sequence, the loss the whole sequences' on every rank, as ``grpo_loss`` takes it), the head's output transform, both
backends and ``torch.compile(fullgraph=True)``. The
log-probs come from the call pipeline's log-prob pass (``pipeline.sequence_logprobs``); the specification of each
loss is in ``reference.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pipeline
from .context_parallel import whole_rows
from .from_hidden_states import HiddenStatesSource
from .from_logits import LogitsSource
from .inputs import LogprobSettings, check_context_parallel
from .objective import GRPOLossOutput
from .validation import check_per_token


def input_source(logits, weight, bias, head_precision: str, drop_last_position: bool):
    """The input form: logits, or, with an lm_head ``weight``, hidden states (``logits`` holds them)."""
    if weight is None:
        return LogitsSource(logits, drop_last_position=drop_last_position)
    if drop_last_position:
        raise ValueError(
            "drop_last_position=True applies to logits [B, T + 1, V]; with weight= the first argument is the hidden "
            "states that predict the completion, [B, T, H]: pass hidden_states[:, :-1]"
        )
    return HiddenStatesSource(logits, weight, bias, head_precision=head_precision)


def _sequence_logps(logits, completion_ids, completion_mask, settings: dict, ref_logps=None) -> tuple:
    """(the pass's ``LossInputs``, log-probs [S, T_max] with gradient, the mask there, and DPO's ``ref_logps`` there
    where given) of a method's call (its ``locals()``: the shared keywords, ``LogprobSettings``'). With a
    ``context_parallel_group``, those of the whole sequences (``context_parallel.whole_rows``): every rank computes
    the same loss, with the whole loss's gradient at its own tokens."""
    if settings["cu_seqlens"] is None and (not isinstance(logits, torch.Tensor) or logits.dim() != 3):
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        what = "hidden states [B, T, H]" if settings["weight"] is not None else "logits [B, T, V]"
        raise ValueError(f"the first argument must be {what} (a packed batch: with cu_seqlens), got {got}")
    if completion_mask is None:
        raise ValueError("completion_mask is required ([B, T], 1 where a completion token counts), got None")
    check_context_parallel(settings["context_parallel_group"])
    source = input_source(
        logits, settings["weight"], settings["bias"], settings["head_precision"], settings["drop_last_position"]
    )
    inputs, logp, mask = pipeline.sequence_logprobs(
        source, completion_ids, completion_mask, settings["temperature"], LogprobSettings.of(settings)
    )
    ref = None if ref_logps is None else _reference_logps(ref_logps, inputs)
    group = settings["context_parallel_group"]
    if group is None:
        return inputs, logp, mask, ref
    inputs, logp, ref = whole_rows(inputs, group, logp, ref)
    return inputs, logp, inputs.mask_seq, ref


def _per_token(inputs, logp_seq: torch.Tensor) -> torch.Tensor:
    """The log-probs handed back, detached and shaped as the caller's ids (a packed call's [total]; a
    context-parallel call's at this rank's tokens)."""
    if inputs.caller_shape is None:
        return logp_seq.detach()
    return inputs.layout.from_seq(logp_seq.detach()).reshape(inputs.caller_shape)


def _coefficient_loss(logp, mask, coefficient):
    """-mean_i[ 1/|o_i| sum_t GC_it * logp_it ]: the surrogate whose gradient is the GC formula."""
    per_row = (coefficient * logp * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return -per_row.mean()


def sft_loss(
    logits,
    completion_ids,
    completion_mask,
    *,
    temperature: float = 1.0,
    backend: str = "auto",
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    head_precision: str = "input",
    check_ids: bool = True,
    drop_last_position: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    reduce_hidden_grad: bool = True,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    context_parallel_group=None,
) -> GRPOLossOutput:
    """Supervised fine-tuning: GC = 1 (the per-sequence mean negative log-likelihood, then the mean over sequences).

    ``logits`` [B, T, V] (``logits[:, t]`` predicts ``completion_ids[:, t]``; [B, T + 1, V] with
    ``drop_last_position``), or a packed batch's [total, V] with ``cu_seqlens`` [S + 1]; with ``weight`` (the lm_head
    [V, H], ``bias`` [V] or None) it is instead the hidden states [B, T, H] (packed: [total, H]) and the logits are
    never held (``head_precision`` as in ``fused_linear_grpo_loss``). ``completion_mask`` [B, T] (packed: [total]):
    masked tokens are not read. ``vocab_parallel_group`` / ``vocab_start_index``: this rank's vocabulary slice (of the
    logits or the weight), the ids global, as in ``grpo_loss``; ``context_parallel_group``: each rank's tokens of every
    sequence, the loss the whole sequences' on every rank (``grpo_loss``); ``logit_scale`` / ``logit_softcap``: the
    head's output transform. Returns ``GRPOLossOutput(loss, {"nll"}, per_token_logps)``."""
    inputs, logp, mask, _ = _sequence_logps(logits, completion_ids, completion_mask, locals())
    loss = _coefficient_loss(logp, mask, 1.0)
    return GRPOLossOutput(loss, {"nll": loss.detach()}, _per_token(inputs, logp))


def rft_loss(
    logits,
    completion_ids,
    completion_mask,
    rewards,
    *,
    temperature: float = 1.0,
    backend: str = "auto",
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    head_precision: str = "input",
    check_ids: bool = True,
    drop_last_position: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    reduce_hidden_grad: bool = True,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    context_parallel_group=None,
) -> GRPOLossOutput:
    """Rejection-sampling fine-tuning: GC = 1 for completions whose reward is 1, 0 for reward 0.

    ``rewards`` [B] (a packed batch's [S]) of 0 / 1: a rule verifier's verdict per completion. Offline RFT uses
    samples of the SFT model, online RFT samples of the current policy: the loss is the same. The other arguments
    are ``sft_loss``'s. Returns ``GRPOLossOutput(loss, {"kept_fraction"}, per_token_logps)``.
    """
    inputs, logp, mask, _ = _sequence_logps(logits, completion_ids, completion_mask, locals())
    rewards = _checked_rewards(rewards, inputs.layout.S, logp.device)
    loss = _coefficient_loss(logp, mask, rewards.unsqueeze(-1))
    return GRPOLossOutput(loss, {"kept_fraction": rewards.mean()}, _per_token(inputs, logp))


def _checked_rewards(rewards, S: int, device) -> torch.Tensor:
    """RFT's rewards as fp32 [S], after checking they are one 0 / 1 verdict a sequence (on the device inside a
    graph: no host sync)."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or rewards.shape[0] != S:
        got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be [B] of 0 / 1 (correct or not), one a sequence (S = {S}), got {got}")
    if rewards.device != device:
        raise ValueError(f"rewards is on {rewards.device} but the logits are on {device}")
    verdicts = (rewards == 0) | (rewards == 1)
    if torch.compiler.is_compiling():
        torch._assert_async(verdicts.all(), "rewards must be [B] of 0 / 1 (correct or not)")
    elif not bool(verdicts.all()):
        raise ValueError(
            f"rewards must be [B] of 0 / 1 (correct or not), got shape {tuple(rewards.shape)} with "
            f"values {sorted(set(rewards.flatten().tolist()))[:5]}"
        )
    return rewards.float()


def dpo_loss(
    logits,
    completion_ids,
    completion_mask,
    ref_logps,
    *,
    beta: float = 0.1,
    temperature: float = 1.0,
    backend: str = "auto",
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    head_precision: str = "input",
    check_ids: bool = True,
    drop_last_position: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    vocab_parallel_group=None,
    vocab_start_index: int | None = None,
    reduce_hidden_grad: bool = True,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    context_parallel_group=None,
) -> GRPOLossOutput:
    """DPO with length-normalized implicit rewards R(o) = 1/|o| sum_t (log pi - log pi_ref).

    Pairs are laid out as [2B, T]: rows 0..B-1 the chosen completions, rows B..2B-1 the
    rejected ones, pair i = (row i, row B + i) (a packed batch: its 2B sequences in that order). loss = mean_i
    -log sigmoid(beta (R+ - R-)), whose gradient coefficient is beta * sigmoid(beta (R- - R+)) on o+ and its
    negative on o-. ``ref_logps`` [2B, T] (packed: [total]), the reference model's. The other arguments are
    ``sft_loss``'s.
    """
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
        raise ValueError(f"beta must be a positive number, got {beta!r}")
    if cu_seqlens is None and isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.shape[0] % 2:
        raise ValueError(
            f"dpo_loss needs logits [2B, T, V] (chosen rows, then rejected rows), got shape {tuple(logits.shape)}"
        )
    inputs, logp, mask, ref = _sequence_logps(logits, completion_ids, completion_mask, locals(), ref_logps)
    if inputs.layout.S % 2:
        raise ValueError(f"dpo_loss needs 2B sequences (chosen, then rejected), got {inputs.layout.S}")
    loss, metrics = dpo_from_logps(logp, ref, mask, beta)
    return GRPOLossOutput(loss, metrics, _per_token(inputs, logp))


def _reference_logps(ref_logps, inputs) -> torch.Tensor:
    """DPO's reference log-probs, checked, in the sequence layout (detached fp32, 0 where no token counts)."""
    layout = inputs.layout
    if layout.packed:
        ref_logps = layout.one_row("ref_logps", ref_logps)
    else:
        check_per_token("ref_logps", ref_logps, inputs.ids.shape, inputs.ids.device, allow_row=False)
    ref = layout.seq(ref_logps.detach().float())
    return torch.where(inputs.mask_seq != 0, ref, 0.0)  # a masked position's content never enters the sums


def dpo_from_logps(logp, ref_logps, mask, beta):
    """The DPO loss and metrics from per-token log-probs [2B, T] (the sequence layout)."""
    implicit = ((logp - ref_logps) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # R(o), [2B]
    half = implicit.shape[0] // 2
    chosen, rejected = implicit[:half], implicit[half:]
    margin = beta * (chosen - rejected)
    loss = -F.logsigmoid(margin).mean()
    metrics = {
        "rewards/chosen": chosen.detach().mean(),
        "rewards/rejected": rejected.detach().mean(),
        "rewards/accuracy": (margin.detach() > 0).float().mean(),
        "rewards/margin": margin.detach().mean(),
    }
    return loss, metrics


def reward_model_loss(
    r_chosen: torch.Tensor,
    r_rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> torch.Tensor:
    """Bradley-Terry: mean of -log sigmoid(r_chosen - r_rejected - margin), stable at any margin, plus TRL's
    ``center_rewards_coefficient`` x mean((r_chosen + r_rejected)^2) when that is given (as TRL's RewardTrainer).

    ``logsigmoid`` never forms exp of a large positive number, so a margin of 1e4 gives 0
    (right order) or 1e4 (wrong order), not inf or NaN. ``margin`` (optional, same shape or
    a scalar) asks the chosen reward to win by at least that much (Llama 2's margin term).
    The Bradley-Terry term sees only differences, so the scores' level drifts freely; the centering term holds
    it near 0 (Eisenstein et al. 2023; TRL recommends 0.01), which a bounded reward such as a sigmoid of the score
    needs.
    """
    if r_chosen.shape != r_rejected.shape:
        raise ValueError(
            f"r_chosen and r_rejected must have the same shape, got {tuple(r_chosen.shape)} and "
            f"{tuple(r_rejected.shape)}"
        )
    if center_rewards_coefficient is not None and not center_rewards_coefficient >= 0:
        raise ValueError(f"center_rewards_coefficient must be >= 0 or None, got {center_rewards_coefficient}")
    chosen, rejected = r_chosen.float(), r_rejected.float()
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
    return loss
