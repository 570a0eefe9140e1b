"""The GRPO objective's O(B * T) math: the one production home of each loss type's per-token
terms, the reductions, the policy masks, the entropy bonus and the logged metrics.

Every loss path runs these functions on log-probs (and entropies) that a kernel or the
chunked torch path produced; the kernels' own per-token code implements the same formulas
(``kernels/token_math.py``) and is tested against them. The math follows TRL 1.16's
``GRPOTrainer._compute_loss`` (``docs/loss-semantics.md``); the extra options (dual_clip,
kl_estimator, log_ratio_clamp, kl_clamp) follow verl and OpenRLHF.

This is not the specification: ``reference.py`` states the same loss once more, written
independently (a sequence at a time, over its active tokens), and the tests hold this module
and the kernels to it (and the benchmarks' eager baseline, ``benchmarks/eager_baseline.py``, which runs it).

Shapes: B rows, T completion positions, V vocabulary. ``lp`` is the current per-token
log-prob, ``old`` the sampling policy's, ``ref`` the reference model's, all [B, T].
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import collectives
from .kernels.contracts import CLIP_METRICS_CISPO, CLIP_METRICS_PPO
from .options import GRPOOptions, option_value
from .policy_terms import FAMILY_TERMS


@dataclasses.dataclass
class GRPOLossOutput:
    """What a GRPO loss call returns.

    loss: the scalar to call ``backward`` on.
    metrics: 0-d tensors under TRL's names (no host sync has happened).
    per_token_logps: detached fp32 [B, T], reusable as the next step's old log-probs.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    per_token_logps: torch.Tensor


@dataclasses.dataclass
class PerTokenTerms:
    """Per-token results of the loss math, before the reduction."""

    per_token_loss: torch.Tensor  # [B, T]: policy term * importance weight + beta * KL
    per_token_kl: torch.Tensor | None  # [B, T] or None when beta == 0
    is_low_clipped: torch.Tensor | None  # bool [B, T] ([B, 1] at sequence level)
    is_high_clipped: torch.Tensor | None  # for cispo: TRL's cispo-clipped flag
    vespo_phi: torch.Tensor | None = None  # vespo: the detached sequence weight phi(w), [B, 1]


def as_row_column(x: torch.Tensor | None) -> torch.Tensor | None:
    """[B] -> [B, 1] so per-row values broadcast over T; [B, 1] and [B, T] pass through."""
    if x is None or x.dim() == 2:
        return x
    return x.unsqueeze(1)


def kl_term(lp: torch.Tensor, ref: torch.Tensor, opts: GRPOOptions) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate, before multiplying by beta. A "+" estimator (verl's straight-through
    ``k3+``, ``k1+``) has the estimate's value and k2's gradient, log pi - log pi_ref, unclamped."""
    if opts.kl_estimator.endswith("+"):
        k2 = 0.5 * (lp - ref) ** 2
        return k2 - k2.detach() + kl_term(lp, ref, opts.replace(kl_estimator=opts.kl_estimator[:-1])).detach()
    if opts.kl_estimator == "k3":
        x = ref - lp
        bound = option_value(opts, "log_ratio_clamp", x)
        if bound is not None:
            x = torch.clamp(x, -bound, bound)
        kl = torch.exp(x) - x - 1
    elif opts.kl_estimator == "k1":
        kl = lp - ref
    else:  # k2
        kl = 0.5 * (lp - ref) ** 2
    bound = option_value(opts, "kl_clamp", kl)
    if bound is not None:
        kl = torch.clamp(kl, -bound, bound)
    return kl


def per_token_terms(
    lp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    importance_weights: torch.Tensor | None,
    opts: GRPOOptions,
    policy_mask: torch.Tensor | None = None,
) -> PerTokenTerms:
    """The per-token loss of every loss_type, in TRL's order of operations.

    ``mask`` is float [B, T]; ``advantages`` and ``importance_weights`` are [B, 1] or [B, T].
    ``policy_mask`` (TRL's off-policy and high-entropy masks, ``policy_masks``) multiplies the
    policy term, never the KL. For vespo the importance weights enter its sequence weight phi(w),
    as in TRL, instead of multiplying the policy term; for gmpo, the row's geometric mean of them
    multiplies the row's term (verl's ``geo_mean``).
    """
    old = lp.detach() if old_logps is None else old_logps  # on-policy: ratio is 1, gradient flows
    log_ratio = lp - old
    if opts.importance_sampling_level == "sequence":  # GSPO: one weight per row, the masked mean log-ratio
        log_weight = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    elif opts.importance_sampling_level == "sequence_token":
        # GSPO-token (verl's "gspo"): the row's weight as a value, a per-token gradient:
        # log w_it = sg[mean_t log-ratio] + logp_it - sg[logp_it]
        row = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        log_weight = lp - lp.detach() + row.detach()
    else:
        log_weight = log_ratio
    bound = option_value(opts, "log_ratio_clamp", log_weight)
    if bound is not None:
        log_weight = torch.clamp(log_weight, -bound, bound)
    coef_1 = torch.exp(log_weight)

    per_token_kl = None
    if opts.uses_kl:
        per_token_kl = kl_term(lp, ref_logps, opts)
        if opts.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    A = advantages
    is_low = is_high = phi = None
    term = opts.loss.policy_term  # the registry's: a loss type reusing a term gets the same term on every path
    if term == "sequence_weight":  # vespo: phi(w) detached: the gradient is phi * A * grad log pi
        phi = vespo_weights(A, log_ratio, mask, importance_weights, opts)
        policy = -phi * A * lp
    elif term == "capped_ratio":  # cispo (with cispo_ratio_min, bounded below too: verl's)
        cap = option_value(opts, "eps_high", coef_1)
        capped = torch.clamp(coef_1, min=option_value(opts, "cispo_ratio_min", coef_1), max=cap).detach()
        policy = torch.where(capped == 0, 0.0, -capped * A * lp)  # at lp = -inf: the limit 0, not 0 * -inf
        is_high = (coef_1 > cap) & (A > 0)
    elif term == "soft_gate":  # sapo
        tau = torch.where(
            A > 0, option_value(opts, "sapo_temperature_pos", A), option_value(opts, "sapo_temperature_neg", A)
        )
        policy = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * A
    elif term in FAMILY_TERMS:  # DPPO, GPG, GMPO, DRO, Clip-Cov, KL-Cov: ``policy_terms``
        policy, is_low, is_high = FAMILY_TERMS[term](lp, old, log_ratio, coef_1, A, mask, importance_weights, opts)
    else:  # "ppo_clip"
        low, high = option_value(opts, "clip_low", coef_1), option_value(opts, "clip_high", coef_1)
        coef_2 = torch.clamp(coef_1, low, high)
        delta = option_value(opts, "delta", coef_1)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        policy = -torch.min(coef_1 * A, coef_2 * A)
        dual_clip = option_value(opts, "dual_clip", policy)
        if dual_clip is not None:  # verl / OpenRLHF: bound the loss of negative advantages by -A*c
            policy = torch.where(A < 0, torch.min(-A * dual_clip, policy), policy)
        is_low = (coef_1 < low) & (A < 0)
        is_high = (coef_1 > high) & (A > 0)

    if policy_mask is not None:
        policy = policy * policy_mask
    # rollout correction: the policy term only (vespo's weights are in its w, gmpo's in its row's term)
    if importance_weights is not None and term not in ("sequence_weight", "geometric_mean"):
        policy = policy * importance_weights
    per_token_loss = (
        policy if per_token_kl is None else policy + option_value(opts, "beta", per_token_kl) * per_token_kl
    )
    per_token_loss = per_token_loss.expand_as(lp)  # sequence-level without KL is [B, 1]
    return PerTokenTerms(per_token_loss, per_token_kl, is_low, is_high, phi)


@torch.no_grad()
def vespo_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    importance_weights: torch.Tensor | None,
    opts: GRPOOptions,
) -> torch.Tensor:
    """VESPO's gamma weight phi(w) = e^lambda w^k e^(-lambda w) (phi(1) = 1), detached, in TRL's log-space
    form and clamps: w is the row's summed token log-ratio (each clamped to +-20), plus the summed log
    rollout importance weight (clamped to [log 1e-8, 20]), the sum clamped to [log 1e-8, 20]; k and
    lambda by the advantage's sign (lambda at least 1e-4); NaN and inf give 0.

    TRL sums the rollout weights' logs over every position; here over active tokens (masked
    positions may hold anything), which is the same where padding carries a weight of 1.
    """
    lower = math.log(1e-8)
    seq = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if importance_weights is not None:
        log_iw = torch.clamp(torch.log(importance_weights.float()), lower, 20.0).expand_as(mask)
        seq = seq + torch.where(mask != 0, log_iw, 0.0).sum(-1, keepdim=True)
    log_w = torch.clamp(seq, lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, option_value(opts, "vespo_k_pos", log_w), option_value(opts, "vespo_k_neg", log_w))
    lam = torch.where(
        nonneg, option_value(opts, "vespo_lambda_pos", log_w), option_value(opts, "vespo_lambda_neg", log_w)
    )
    lam = lam.clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def active_token_count(mask: torch.Tensor) -> torch.Tensor:
    """The default dapo / cispo / vespo normalizer: local active tokens, at least 1."""
    return mask.sum().clamp(min=1.0)


def prompt_divisors(mask: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
    """What each sequence's tokens are divided by in the prompt mean (SkyRL's ``loss_reduction="prompt_mean"``), fp32
    [S]: the call's number of prompts (distinct ``prompt_ids``) times the active tokens of the sequence's prompt, at
    least 1. ``mask``: [S, T] (the sequence layout). On the device without a host sync (a sort, not ``unique``)."""
    ids = prompt_ids.reshape(-1)
    if ids.numel() == 0:
        return torch.ones(0, device=mask.device, dtype=torch.float32)
    sorted_ids, order = torch.sort(ids, stable=True)
    new_prompt = torch.ones_like(sorted_ids, dtype=torch.bool)
    new_prompt[1:] = sorted_ids[1:] != sorted_ids[:-1]
    prompt = torch.cumsum(new_prompt, 0) - 1  # each sorted sequence's prompt, 0 to P - 1
    row_tokens = mask.float().sum(-1)[order]
    tokens = torch.zeros(ids.numel(), device=mask.device, dtype=torch.float32).index_add_(0, prompt, row_tokens)
    divisors = torch.empty_like(row_tokens)
    divisors[order] = (prompt[-1] + 1).float() * tokens[prompt].clamp(min=1.0)
    return divisors


def reduction_weights(mask: torch.Tensor, opts: GRPOOptions, normalizer=None, prompt_ids=None) -> torch.Tensor:
    """Each token's weight in TRL's reductions (without TRL's division by gradient-accumulation steps).

    loss = sum over tokens of per_token_loss * weight, for every loss_type:

    - grpo, sapo: mean over rows of the row's token mean: M / (B * max(|o_i|, 1))
    - bnpo: M / max(sum M, 1);  dr_grpo: M / (B * max_completion_length)
    - dapo, cispo, vespo: M / normalizer (default: local active tokens, at least 1);  luspo: M / B
    - any loss type with ``aggregation="prompt_mean"``: M / (prompts * max(its prompt's tokens, 1))
    """
    B, reduction = mask.shape[0], opts.reduction
    if reduction == "prompt_mean":
        return mask / prompt_divisors(mask, prompt_ids).unsqueeze(-1)
    if reduction == "row_token_mean":
        return mask / (B * mask.sum(-1, keepdim=True).clamp(min=1.0))
    if reduction == "batch_token_mean":
        return mask / mask.sum().clamp(min=1.0)
    if reduction == "constant":
        return mask / (B * opts.max_completion_length)
    if reduction == "token_count":
        return mask / (active_token_count(mask) if normalizer is None else _nonzero(normalizer))
    return mask / B  # "rows"


def _nonzero(normalizer):
    """A normalizer of 0 comes only with no active token (validation checks it): every weight is 0 then,
    and it divides as 1 so that they stay 0 rather than 0 / 0."""
    if isinstance(normalizer, torch.Tensor):
        return torch.where(normalizer == 0, torch.ones_like(normalizer), normalizer)
    return normalizer if normalizer != 0 else 1


def reduce_loss(
    per_token_loss: torch.Tensor, mask: torch.Tensor, opts: GRPOOptions, normalizer=None, prompt_ids=None
) -> torch.Tensor:
    """TRL's reduction of the per-token loss to the scalar loss (or the prompt mean: ``reduction_weights``)."""
    return (per_token_loss * reduction_weights(mask, opts, normalizer, prompt_ids)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor, per_row: bool = False) -> torch.Tensor:
    """TRL's metric mean: over active tokens, or over all rows for a per-row [B, 1] value.

    (TRL tells the two apart by ``x.shape[1] == 1``, which misreads T = 1; we say which.)
    """
    if per_row:
        return x.float().mean()
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def clip_metric_values(opts: GRPOOptions, low: torch.Tensor | None, high: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's clip metrics of a loss type, by name, as the 0 / 1 values their means are taken of, from the
    per-token (or per-row) low- and high-clipped indicators: the PPO-clip types log low, high and either
    (the region); cispo its capped share. The one place the kernel paths' metrics take their names too."""
    names, kind = opts.loss.clip_metrics, opts.loss.clip_metrics_kind  # the kind the loss-metrics kernel reads too
    if kind == CLIP_METRICS_PPO:
        return dict(zip(names, (low, high, torch.maximum(low, high)), strict=True))
    if kind == CLIP_METRICS_CISPO:
        return dict(zip(names, (high,), strict=True))
    return {}


def metric_names(opts: GRPOOptions, has_kl: bool, has_entropy: bool) -> tuple:
    """The names of the loss-metrics kernel's metrics, in its order (TRL's names; a fused call's are
    ``GRPOOptions.fused_metric_names``)."""
    return ("kl",) * has_kl + ("entropy",) * has_entropy + tuple(opts.loss.clip_metrics)


def loss_metrics(
    terms: PerTokenTerms, entropy: torch.Tensor | None, mask: torch.Tensor, opts: GRPOOptions
) -> dict[str, torch.Tensor]:
    """TRL's logged metrics, as detached 0-d tensors."""
    metrics = {}
    # The clip flags are one per row at sequence level, unless per-token advantages make them per token
    # (then TRL's [B, T] flags take the token mean, like every other level's)
    flags = terms.is_high_clipped
    per_row = opts.importance_sampling_level == "sequence" and flags is not None and flags.shape[-1] == 1
    if terms.per_token_kl is not None:
        metrics["kl"] = masked_mean(terms.per_token_kl.detach(), mask)
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy.detach(), mask)
    if flags is not None:
        low = None if terms.is_low_clipped is None else terms.is_low_clipped.float()
        for name, x in clip_metric_values(opts, low, flags.float()).items():
            metrics[name] = masked_mean(x, mask, per_row)
    # vespo: TRL's mean of phi over rows (over active tokens for per-token advantages)
    if opts.loss.policy_term == "sequence_weight":
        phi = terms.vespo_phi.detach()
        metrics["vespo/phi_seq_mean"] = masked_mean(phi, mask, per_row=phi.shape[-1] == 1)
    return metrics


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, opts: GRPOOptions) -> torch.Tensor:
    """TRL's top-entropy mask: active tokens whose entropy is at least the (1 - top_entropy_quantile)
    quantile of every process's active tokens' entropies; float [B, T]."""
    active = mask != 0
    gathered = collectives.gathered(entropy.detach()[active].float())
    if gathered.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.float32)
    threshold = torch.quantile(gathered, 1.0 - opts.top_entropy_quantile)
    return ((entropy.detach() * mask >= threshold) & active).float()


def off_policy_mask(
    advantages: torch.Tensor,
    logp: torch.Tensor,
    sampling_logps: torch.Tensor | None,
    mask: torch.Tensor,
    opts: GRPOOptions,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask, as TRL computes it: keep a row if its advantage is
    >= 0 or its mean KL(sampler || current) = mean(sampling_logps - logp) over active tokens is at
    most the threshold; a NaN sampling log-prob (unscored) counts as no evidence. Float [B, 1] or [B, T]."""
    reference = logp.detach() if sampling_logps is None else sampling_logps.float()
    kl = torch.nan_to_num(reference - logp.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return (
        (as_row_column(advantages) >= 0) | (mean_kl <= option_value(opts, "off_policy_mask_threshold", mean_kl))
    ).float()


def policy_masks(
    logp: torch.Tensor,
    entropy: torch.Tensor | None,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    sampling_logps: torch.Tensor | None,
    opts: GRPOOptions,
):
    """(the mask multiplying the policy term, the high-entropy mask or None): TRL multiplies the
    policy term by both masks (never the KL); the entropy bonus acts on the high-entropy tokens."""
    entropy_mask = high_entropy_mask(entropy, mask, opts) if opts.masks_high_entropy else None
    masks = [
        m
        for m in (
            entropy_mask,
            off_policy_mask(advantages, logp, sampling_logps, mask, opts) if opts.masks_off_policy else None,
        )
        if m is not None
    ]
    policy = masks[0] if len(masks) == 1 else masks[0] * masks[1]
    return policy, entropy_mask


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, opts: GRPOOptions, loss_mask=None, normalizer=None):
    """The entropy bonus, subtracted from the loss: ``entropy_coef`` times the entropy summed over ``mask``'s tokens
    (the bonus's), divided by their count (TRL's mean, whatever the loss type's reduction) or, with
    ``entropy_reduction="loss"``, as the token-count loss is (``normalizer``, else ``loss_mask``'s active tokens:
    OpenRLHF's ``aggregate_loss`` of the entropy). 0 without a coefficient."""
    if not opts.has_entropy_bonus:
        return 0.0
    total = (entropy * mask).sum()
    return option_value(opts, "entropy_coef", total) * total / entropy_divisor(mask, opts, loss_mask, normalizer)


def entropy_divisor(mask: torch.Tensor, opts: GRPOOptions, loss_mask=None, normalizer=None):
    """What the entropy bonus divides its sum by (``entropy_bonus``)."""
    if opts.entropy_reduction == "loss":
        return (
            active_token_count(mask if loss_mask is None else loss_mask) if normalizer is None else _nonzero(normalizer)
        )
    return mask.sum().clamp(min=1.0)


# ---- The loss assembled from per-token results, where the loss math runs in torch (pipeline.loss_in_torch) -------
#
# (The fused kernel paths reduce on the device: kernels/reduce.py, with pipeline.kernel_reduction's weights.)


def scaled(x, loss_scale):
    """``x * loss_scale``, with no op at all for a plain 1.0 (a Python float)."""
    return x if isinstance(loss_scale, float) and loss_scale == 1.0 else x * loss_scale


def reduced_loss(
    per_token_loss, mask, opts: GRPOOptions, normalizer, loss_scale, entropy=None, bonus_mask=None, prompt_ids=None
):
    """TRL's reduction of the per-token loss (or the prompt mean), less the entropy bonus (with ``entropy_coef``, over
    ``bonus_mask``'s tokens), times ``loss_scale`` (an O(1) op whose backward only scales the
    O(B * T) per-token gradients)."""
    loss = reduce_loss(per_token_loss, mask, opts, normalizer, prompt_ids)
    if opts.has_entropy_bonus:
        loss = loss - entropy_bonus(entropy, mask if bonus_mask is None else bonus_mask, opts, mask, normalizer)
    return scaled(loss, loss_scale)


def neutral_at_masked(t: torch.Tensor | None, active: torch.Tensor, fill: float) -> torch.Tensor | None:
    """A detached fp32 per-token input with ``fill`` wherever no token counts.

    [B, T] inputs are replaced at masked tokens, per-row ([B] / [B, 1]) inputs on rows with
    no active token, so that whatever a caller pads with (-100, NaN, inf) never enters the
    arithmetic: a 0 weight cannot cancel a NaN (NaN * 0 is NaN, and so is its gradient).
    """
    if t is None:
        return None
    t = as_row_column(t.detach().float())
    where = active if t.shape[1] == active.shape[1] else active.any(-1, keepdim=True)  # [B, T] or per row
    return torch.where(where, t, fill)


def loss_from_logps(
    logp,
    entropy,
    per_token,
    normalizer,
    opts: GRPOOptions,
    loss_scale=1.0,
    bonus_mask=None,
    policy_mask=None,
    prompt_ids=None,
) -> GRPOLossOutput:
    """The O(B * T) part on differentiable log-probs of the sequence layout: per-token terms, reduction,
    metrics. ``per_token``: a ``kernels.contracts.TokenInputs`` in the sequence layout (its mask required);
    ``prompt_ids`` [S]: the prompt mean's.

    ``logp`` (and ``entropy``) are 0 at masked tokens; the per-token inputs get neutral
    values there (ratio 1, KL 0, advantage 0) and are detached: no gradient reaches them.
    """
    mask = per_token.mask
    active = mask != 0
    terms = per_token_terms(
        logp,
        mask,
        neutral_at_masked(per_token.advantages, active, 0.0),
        neutral_at_masked(per_token.old_logps, active, 0.0),
        neutral_at_masked(per_token.ref_logps, active, 0.0),
        neutral_at_masked(per_token.importance_weights, active, 1.0),
        opts,
        policy_mask,
    )
    loss = reduced_loss(terms.per_token_loss, mask, opts, normalizer, loss_scale, entropy, bonus_mask, prompt_ids)
    return GRPOLossOutput(loss, loss_metrics(terms, entropy, mask, opts), logp.detach())
