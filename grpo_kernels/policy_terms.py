"""The policy terms of the loss families other trainers run: DPPO, GPG, GMPO, DRO, Clip-Cov and KL-Cov.

Each is written as verl 0.9's ``core_algos`` computes it (the names are verl's loss modes: ``dppo_tv``,
``dppo_kl``, ``gpg``, ``geo_mean``, ``dro``, ``clip_cov``, ``kl_cov``), on the [B, T] log-probs a kernel or the
torch path produced; ``objective.per_token_terms`` calls them by the registry's ``policy_term``
(``FAMILY_TERMS``). Each takes (lp, old, log_ratio, ratio, A, mask, importance_weights, opts): the current
log-probs (with gradient), the old ones, their difference, exp of it (clamped by ``log_ratio_clamp`` where set),
the advantages ([B, 1] or [B, T]), the float mask, the rollout weights or None, the options; and returns
(policy term, low flags or None, high flags or None), the flags being what the loss type's metrics count.

Clip-Cov and KL-Cov pick tokens by the covariance of the advantage and the log-prob: over the whole batch of
every process (``covariance_selection="batch"``: the means, the count and the choice are the batch's, through
torch.distributed's default group) or over the call's own tokens (``"micro_batch"``, verl's).
"""

from __future__ import annotations

import torch

from . import collectives
from .conventions import VERL_MEAN_EPS
from .options import option_value


def _trust_region(divergence: str):
    """DPPO (prime-rl's default loss; verl's ``dppo_tv`` / ``dppo_kl``): -A sg(min(r, delta)) log pi on the tokens
    whose probability stayed within the trust region, 0 elsewhere. The region is one-sided, by the advantage's
    sign: for A > 0 a token is out when its probability rose by more than ``epsilon_high`` (binary TV: p - p_old;
    binary KL: KL(Bern(p_old) || Bern(p)) while p rose), for A <= 0 when it fell by more than ``epsilon``."""

    def term(lp, old, log_ratio, ratio, A, mask, importance_weights, opts):
        p, p_old = torch.exp(lp.detach()), torch.exp(old)
        high, low, delta = (option_value(opts, name, p) for name in ("eps_high", "epsilon", "delta"))
        if divergence == "tv":
            inside = torch.where(A > 0, p - p_old <= high, p - p_old >= -low)
        else:
            lp_now = lp.detach()
            binary_kl = p_old * (old - lp_now) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
            inside = torch.where(A > 0, (binary_kl <= high) | (p <= p_old), (binary_kl <= low) | (p >= p_old))
        capped = (ratio if delta is None else torch.clamp(ratio, max=delta)).detach()
        # outside the region, and where the ratio is 0 (lp = -inf): 0, not 0 * -inf
        policy = torch.where(inside & (capped != 0), -A * capped * lp, 0.0)
        return policy, None, ~inside

    return term


def _log_prob(lp, old, log_ratio, ratio, A, mask, importance_weights, opts):
    """GPG / REINFORCE: -A log pi (verl's ``gpg``)."""
    return -A * lp, None, None


def _log_ratio_penalty(lp, old, log_ratio, ratio, A, mask, importance_weights, opts):
    """DRO: -(A log pi - dro_beta (log pi - log pi_old)^2 / 2) (verl's ``dro``)."""
    return -(lp * A - 0.5 * option_value(opts, "dro_beta", lp) * log_ratio.square()), None, None


def _geometric_mean(lp, old, log_ratio, ratio, A, mask, importance_weights, opts):
    """GMPO (verl's ``geo_mean``): each row's -A_row exp(mean over its tokens of the log-ratio clipped to
    [-epsilon, epsilon_high] on the advantage's side: sign(A) min(sign(A) x, sign(A) clip(x))), A_row the row's
    mean advantage; the rollout weights enter as the row's geometric mean of them. One value a row ([B, 1]); the
    flags: a clipped log-ratio where A < 0 (low) and where A > 0 (high)."""
    sign = torch.sign(A)
    clipped = torch.clamp(
        log_ratio, -option_value(opts, "epsilon", log_ratio), option_value(opts, "eps_high", log_ratio)
    )
    chosen = sign * torch.minimum(sign * log_ratio, sign * clipped)
    tokens = mask.sum(-1, keepdim=True).clamp(min=1.0)
    row_ratio = torch.exp((chosen * mask).sum(-1, keepdim=True) / tokens)
    row_advantage = (A * mask).sum(-1, keepdim=True) / tokens
    policy = -row_advantage * row_ratio
    if importance_weights is not None:  # (a padded weight of 0 at a masked token counts as 1)
        log_weights = torch.where(mask > 0, torch.log(importance_weights.expand_as(mask)), 0.0) * mask
        policy = policy * torch.exp(log_weights.sum(-1, keepdim=True) / tokens)
    was_clipped = log_ratio != clipped
    return policy, was_clipped & (A < 0), was_clipped & (A > 0)


def _covariance_clip(lp, old, log_ratio, ratio, A, mask, importance_weights, opts):
    """Clip-Cov (verl's ``clip_cov``): PPO's clipped loss, with ``clip_cov_ratio`` of the active tokens (at least
    one) left out, drawn at random among those PPO leaves unclipped whose covariance (A - mean A)(log pi - mean
    log pi) lies in (``clip_cov_lb``, ``clip_cov_ub``). The high flags: the tokens left out."""
    A = A.expand_as(mask)
    unclipped = -A * ratio
    clipped = -A * torch.clamp(ratio, 1 - opts.epsilon, 1 + opts.eps_high)
    active = mask > 0
    by_clip = (clipped > unclipped) & active
    batch = opts.covariance_selection == "batch"
    # verl's masked means (its epsilon): the covariances that choose the tokens are compared with bounds
    sums = torch.stack([(A * mask).sum(), (lp.detach() * mask).sum(), mask.sum()])
    sums = collectives.summed(sums) if batch else sums
    mean_advantage, mean_logp = sums[0] / (sums[2] + VERL_MEAN_EPS), sums[1] / (sums[2] + VERL_MEAN_EPS)
    covariance = (A - mean_advantage) * (lp.detach() - mean_logp)
    candidates = (covariance < opts.clip_cov_ub) & (covariance > opts.clip_cov_lb) & active & ~by_clip
    count = max(int(opts.clip_cov_ratio * sums[2].item()), 1)
    left_out = _drawn(candidates, count, batch)
    return torch.maximum(unclipped, clipped) * (~left_out), None, left_out


def _covariance_kl(lp, old, log_ratio, ratio, A, mask, importance_weights, opts):
    """KL-Cov (verl's ``kl_cov``): -A r, plus ``kl_cov_coef`` |log-ratio| on the ``kl_cov_ratio`` of the active
    tokens (at least one) with the largest covariance (A - mean A)(log pi - mean log pi), the means plain ones
    over the active tokens. The high flags: the penalized tokens."""
    A = A.expand_as(mask)
    active = mask > 0
    batch = opts.covariance_selection == "batch"
    # as verl: on the host, over the active tokens in row-major order (the top-k's ties break the same way)
    advantages, logps = A[active].detach().reshape(-1).cpu(), lp[active].detach().reshape(-1).cpu()
    if batch and collectives.distributed():
        sums = collectives.summed(torch.stack([advantages.sum(), logps.sum(), torch.tensor(float(advantages.numel()))]))
        count = int(sums[2].item())
        covariance = (advantages - sums[0] / sums[2]) * (logps - sums[1] / sums[2])
    else:  # verl's own means (tensor.mean), so that its ties are ours
        count = advantages.numel()
        covariance = (advantages - advantages.mean()) * (logps - logps.mean())
    chosen = _largest(covariance, max(1, int(count * opts.kl_cov_ratio)), batch)
    penalized = torch.zeros(mask.numel(), dtype=torch.bool)
    penalized[torch.nonzero(active.reshape(-1).cpu(), as_tuple=True)[0][chosen]] = True
    penalized = penalized.reshape(mask.shape).to(mask.device)
    unclipped = -A * ratio
    return torch.where(penalized, unclipped + opts.kl_cov_coef * log_ratio.abs(), unclipped), None, penalized


# the terms whose token selection runs on the host (a top-k or a random draw over the active tokens, across
# processes): no torch.compile graph holds them (``inputs.check_compilable``)
HOST_SELECTED_TERMS = ("covariance_clip", "covariance_kl")

FAMILY_TERMS = {
    "tv_trust_region": _trust_region("tv"),
    "kl_trust_region": _trust_region("kl"),
    "log_prob": _log_prob,
    "log_ratio_penalty": _log_ratio_penalty,
    "geometric_mean": _geometric_mean,
    "covariance_clip": _covariance_clip,
    "covariance_kl": _covariance_kl,
}


# ---- The whole batch's selections, across processes (torch.distributed's default group: ``collectives``) ----------


def _drawn(candidates: torch.Tensor, count: int, batch: bool) -> torch.Tensor:
    """``count`` of the ``candidates`` (bool [B, T]) at random, the first ``count`` of ``torch.randperm`` (torch's
    default generator, on the CPU, as verl draws it) over them in row-major order. Across processes the candidates
    are numbered in rank order and process 0 draws for all."""
    where = torch.nonzero(candidates)
    chosen = torch.zeros_like(candidates)
    if not (batch and collectives.distributed()):
        if len(where) > 0:
            picked = where[torch.randperm(len(where))[: min(count, len(where))].to(where.device)]
            chosen[picked[:, 0], picked[:, 1]] = True
        return chosen
    offset, total = collectives.offsets(len(where))
    drawn = torch.zeros(min(count, total), dtype=torch.int64)
    if collectives.world()[0] == 0 and total > 0:
        drawn.copy_(torch.randperm(total)[: len(drawn)])
    mine = collectives.from_first(drawn).cpu() - offset
    mine = mine[(mine >= 0) & (mine < len(where))].to(where.device)
    picked = where[mine]
    chosen[picked[:, 0], picked[:, 1]] = True
    return chosen


def _largest(values: torch.Tensor, count: int, batch: bool) -> torch.Tensor:
    """Indices into ``values`` (1-D, on the CPU) of the ``count`` largest: this process's own, or, across
    processes, of the largest ``count`` of every process's values (those that fall here)."""
    if not (batch and collectives.distributed()):
        return torch.topk(values, min(count, values.numel()), largest=True).indices if values.numel() else values.long()
    offset, _ = collectives.offsets(values.numel())
    everyone = collectives.gathered(values)
    top = torch.topk(everyone, min(count, everyone.numel()), largest=True).indices - offset
    return top[(top >= 0) & (top < values.numel())]
