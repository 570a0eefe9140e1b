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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .from_logits import TokenLogprobs
from .objective import GRPOLossOutput, token_logprobs_and_entropy
from .options import GRPOOptions
from .validation import check_logits, check_per_token, check_token_ids, resolve_backend


def _logps(logits, ids, mask, temperature, backend):
    """Per-token log-probs with gradient on the fused kernel (0 at masked positions)."""
    check_logits(logits)
    check_token_ids(ids, logits.shape, logits.device, True)
    check_per_token(
        "completion_mask", mask, logits.shape, logits.device, allow_row=False, allow_bool=True, allow_int=True
    )
    GRPOOptions(temperature=temperature)  # validates the temperature
    resolved = resolve_backend(backend, logits)
    flat_mask = mask.float().reshape(-1).contiguous()
    logp, _, _ = TokenLogprobs.apply(
        logits, ids.contiguous(), flat_mask, float(temperature), None, False, resolved, False
    )
    return logp


def _coefficient_loss(logp, mask, coefficient):
    """-mean_i[ 1/|o_i| sum_t GC_it * logp_it ]: the surrogate whose gradient is the GC formula."""
    mask = mask.float()
    per_row = (coefficient * logp * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return -per_row.mean()


def sft_loss(
    logits, completion_ids, completion_mask, *, temperature: float = 1.0, backend: str = "auto"
) -> GRPOLossOutput:
    """Supervised fine-tuning: GC = 1 (the per-sequence mean negative log-likelihood)."""
    logp = _logps(logits, completion_ids, completion_mask, temperature, backend)
    loss = _coefficient_loss(logp, completion_mask, 1.0)
    return GRPOLossOutput(loss, {"nll": loss.detach()}, logp.detach())


def rft_loss(
    logits, completion_ids, completion_mask, rewards, *, temperature: float = 1.0, backend: str = "auto"
) -> GRPOLossOutput:
    """Rejection-sampling fine-tuning: GC = 1 for completions whose reward is 1, 0 for reward 0.

    ``rewards`` [B] of 0 / 1 (a rule verifier's verdict per completion). Offline RFT uses
    samples of the SFT model, online RFT samples of the current policy: the loss is the same.
    """
    check_per_token("rewards", rewards, logits.shape, logits.device, allow_row=True)
    if rewards.dim() != 1 or not bool(((rewards == 0) | (rewards == 1)).all()):
        raise ValueError(
            f"rewards must be [B] of 0 / 1 (correct or not), got shape {tuple(rewards.shape)} with "
            f"values {sorted(set(rewards.flatten().tolist()))[:5]}"
        )
    logp = _logps(logits, completion_ids, completion_mask, temperature, backend)
    loss = _coefficient_loss(logp, completion_mask, rewards.float().unsqueeze(-1))
    return GRPOLossOutput(loss, {"kept_fraction": rewards.float().mean()}, logp.detach())


def _split_pairs(t: torch.Tensor):
    half = t.shape[0] // 2
    return t[:half], t[half:]


def dpo_loss(
    logits,
    completion_ids,
    completion_mask,
    ref_logps,
    *,
    beta: float = 0.1,
    temperature: float = 1.0,
    backend: str = "auto",
) -> GRPOLossOutput:
    """DPO with length-normalized implicit rewards R(o) = 1/|o| sum_t (log pi - log pi_ref).

    Pairs are laid out as [2B, T]: rows 0..B-1 the chosen completions, rows B..2B-1 the
    rejected ones, pair i = (row i, row B + i). loss = mean_i -log sigmoid(beta (R+ - R-)),
    whose gradient coefficient is beta * sigmoid(beta (R- - R+)) on o+ and its negative on o-.
    """
    if logits.dim() != 3 or logits.shape[0] % 2:
        raise ValueError(
            f"dpo_loss needs logits [2B, T, V] (chosen rows, then rejected rows), got shape {tuple(logits.shape)}"
        )
    if not isinstance(beta, (int, float)) or beta <= 0:
        raise ValueError(f"beta must be a positive number, got {beta!r}")
    check_per_token("ref_logps", ref_logps, logits.shape, logits.device, allow_row=False)
    logp = _logps(logits, completion_ids, completion_mask, temperature, backend)
    loss, metrics = dpo_from_logps(logp, ref_logps.float(), completion_mask.float(), beta)
    return GRPOLossOutput(loss, metrics, logp.detach())


def dpo_from_logps(logp, ref_logps, mask, beta):
    """The DPO loss and metrics from per-token log-probs (shared by the fast path and the reference)."""
    implicit = ((logp - ref_logps) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # R(o), [2B]
    chosen, rejected = _split_pairs(implicit)
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


# ----- references: the plain formulas, materializing the log-softmax ---------------------


def sft_loss_reference(logits, completion_ids, completion_mask, *, temperature: float = 1.0):
    lp, _ = token_logprobs_and_entropy(logits, completion_ids, temperature)
    mask = completion_mask.float()
    return -((lp * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def rft_loss_reference(logits, completion_ids, completion_mask, rewards, *, temperature: float = 1.0):
    lp, _ = token_logprobs_and_entropy(logits, completion_ids, temperature)
    mask = completion_mask.float()
    return -(rewards.float() * (lp * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def dpo_loss_reference(
    logits, completion_ids, completion_mask, ref_logps, *, beta: float = 0.1, temperature: float = 1.0
):
    lp, _ = token_logprobs_and_entropy(logits, completion_ids, temperature)
    mask = completion_mask.float()
    half = logits.shape[0] // 2
    implicit = ((lp - ref_logps.float()) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return -torch.log(torch.sigmoid(beta * (implicit[:half] - implicit[half:]))).mean()
