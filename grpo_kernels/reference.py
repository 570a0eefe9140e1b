"""The specification: the GRPO loss stated once more, plainly, as the oracle the tests use.

Nothing on a loss path imports this module (a test checks it), and it shares no math with the
production code in ``objective.py``. It is written the other way round on purpose: one
sequence at a time, over that sequence's active tokens only, each formula as
``docs/loss-semantics.md`` states it. A broadcasting or padding mistake in the vectorized
production math cannot be repeated here, and masked positions never enter the arithmetic, so
whatever a caller pads with (NaN, inf, -100) cannot reach the loss.

It computes in fp64 when given fp64 logits, else in fp32, and materializes the log-softmax
over the whole vocabulary: it is slow and meant to be read. Gradients come from autograd.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import collectives  # the sums and gathers over processes: plumbing, no math
from .objective import GRPOLossOutput  # the result's container only, no math
from .options import GRPOOptions
from .rollout_correction import check_call, reads_current  # the correction's own checks, shared with the call


def head_output(logits: torch.Tensor, logit_scale: float = 1.0, logit_softcap: float | None = None):
    """What a model's head makes of its raw outputs, as Gemma, Cohere, Granite... write it: times the scale,
    then soft-capped, cap * tanh(x / cap) (no cap when None)."""
    x = logits * logit_scale
    if logit_softcap is not None:
        x = logit_softcap * torch.tanh(x / logit_softcap)
    return x


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
):
    """log softmax(head_output(logits) / temperature) at ``ids``, and the entropy -sum p log p of that
    distribution."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    log_p = torch.log_softmax(head_output(logits.to(dtype), logit_scale, logit_softcap) / temperature, dim=-1)
    picked = torch.gather(log_p, -1, ids.long().unsqueeze(-1)).squeeze(-1)
    p = log_p.exp()
    # p log p -> 0 as p -> 0; log p is replaced before the product, so that no 0 * -inf reaches the gradient
    entropy = -(p * torch.where(p > 0, log_p, torch.zeros_like(log_p))).sum(-1)
    return picked, entropy


def kept_token_logprobs_and_entropy(
    logits: torch.Tensor,
    ids: torch.Tensor,
    kept_set,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    mask: torch.Tensor | None = None,
    return_sum_pi_squared: bool = False,
):
    """``token_logprobs_and_entropy`` over each token's kept set (``grpo_kernels.KeptSet``), densely: x =
    head_output(logits) / temperature set to -inf outside the set, then the log-softmax; a token whose target is
    outside its set (or whose set is empty) takes the whole vocabulary, unless ``outside="add_target"`` adds the target
    to its set; the entropy is the whole vocabulary's unless ``entropy="set"``. Only active tokens (``mask``) read
    their sets. With ``return_sum_pi_squared`` also Σπ² over the distribution each log-prob is taken in."""
    B, T, V = logits.shape
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = head_output(logits.to(dtype), logit_scale, logit_softcap) / temperature
    full = torch.log_softmax(x, dim=-1)
    member = torch.zeros(B * T, V, dtype=torch.bool, device=logits.device)
    active = torch.ones(B * T, dtype=torch.bool, device=logits.device) if mask is None else mask.reshape(-1) != 0
    for n in range(B * T):
        if not active[n]:
            continue
        if kept_set.offsets is None:
            row = kept_set.ids.reshape(B * T, -1)[n].long()
            row = row[row >= 0]
        else:
            row = kept_set.ids[int(kept_set.offsets[n]) : int(kept_set.offsets[n + 1])].long()
        member[n, row] = True
    member = member.view(B, T, V)
    target = ids.long().clamp(0, V - 1).unsqueeze(-1)
    found = member.gather(-1, target).squeeze(-1)
    if kept_set.outside == "add_target":
        member = member.scatter(-1, target, True)
        uses_set = torch.ones_like(found)
    else:
        uses_set = found
    uses_set = uses_set & active.view(B, T)
    in_set = torch.log_softmax(torch.where(member, x, float("-inf")), dim=-1)
    log_p = torch.where(uses_set.unsqueeze(-1), in_set, full)
    picked = log_p.gather(-1, target).squeeze(-1)

    def entropy_of(lp):
        p = lp.exp()
        return -(p * torch.where(p > 0, lp, torch.zeros_like(lp))).sum(-1)

    entropy = entropy_of(log_p) if kept_set.entropy == "set" else entropy_of(full)
    if return_sum_pi_squared:  # Σπ² of the distribution the token's log-prob is taken in (its set's, or the whole's)
        return picked, entropy, (log_p.exp() ** 2).sum(-1)
    return picked, entropy


@dataclasses.dataclass
class _Sequence:
    """One row's active tokens: its mask weights and per-token values, 1-D over those tokens.

    A per-row input ([B] or [B, 1]) is a 0-d tensor here, one value for all of the row's tokens.
    """

    m: torch.Tensor  # the mask's (possibly fractional) weights
    lp: torch.Tensor  # current log-probs, with gradient
    entropy: torch.Tensor
    advantage: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor | None
    rollout_weight: torch.Tensor | None
    sampling: torch.Tensor | None


def _row_value(t: torch.Tensor | None, i: int, active: torch.Tensor, dtype) -> torch.Tensor | None:
    """Row i of a per-row ([B], [B, 1]) or per-token ([B, T]) input, at the row's active tokens."""
    if t is None:
        return None
    t = t.detach().to(dtype)
    if t.dim() == 1 or t.shape[-1] == 1:
        return t.reshape(-1)[i]
    return t[i][active]


def _sequences(lp, entropy, mask, advantages, old_logps, ref_logps, importance_weights, sampling_logps, dtype):
    rows = []
    for i in range(mask.shape[0]):
        active = mask[i] != 0
        row_lp = lp[i][active]
        old = _row_value(old_logps, i, active, dtype)
        rows.append(
            _Sequence(
                m=mask[i][active].to(dtype),
                lp=row_lp,
                entropy=entropy[i][active],
                advantage=_row_value(advantages, i, active, dtype),
                old=row_lp.detach() if old is None else old,  # on-policy: the ratio is 1, its gradient flows
                ref=_row_value(ref_logps, i, active, dtype),
                rollout_weight=_row_value(importance_weights, i, active, dtype),
                sampling=_row_value(sampling_logps, i, active, dtype),
            )
        )
    return rows


def _weighted_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """sum(x m) / max(sum m, 1), x broadcast over the tokens."""
    return (x * m).sum() / torch.clamp(m.sum(), min=1.0)


def _clamp(x: torch.Tensor, bound: float | None) -> torch.Tensor:
    return x if bound is None else torch.clamp(x, -bound, bound)


def _kl(seq: _Sequence, opts: GRPOOptions) -> torch.Tensor:
    """The estimate of KL(pi || pi_ref) at each token, before beta; "k3+" / "k1+" (verl's straight-through): the
    estimate's value with the gradient of (lp - ref)^2 / 2."""
    estimator = opts.kl_estimator.rstrip("+")
    if estimator == "k3":
        x = _clamp(seq.ref - seq.lp, opts.log_ratio_clamp)
        kl = torch.exp(x) - x - 1
    elif estimator == "k1":
        kl = seq.lp - seq.ref
    else:
        kl = (seq.lp - seq.ref) ** 2 / 2
    kl = _clamp(kl, opts.kl_clamp)
    if opts.kl_estimator.endswith("+"):
        half_square = (seq.lp - seq.ref) ** 2 / 2
        kl = kl.detach() + (half_square - half_square.detach())
    return kl


def _vespo_phi(seq: _Sequence, opts: GRPOOptions) -> torch.Tensor:
    """phi(w) = exp(lambda + k log w - lambda w), detached, of the row's ratio w (TRL's clamps)."""
    lower = math.log(1e-8)
    log_w = torch.clamp(seq.lp.detach() - seq.old, -20.0, 20.0).mul(seq.m).sum()
    if seq.rollout_weight is not None:
        log_iw = torch.clamp(torch.log(seq.rollout_weight), lower, 20.0)
        log_w = log_w + log_iw.expand_as(seq.m).sum()
    log_w = torch.clamp(log_w, lower, 20.0)
    positive = seq.advantage >= 0
    k = torch.where(positive, opts.vespo_k_pos, opts.vespo_k_neg)
    lam = torch.clamp(torch.where(positive, opts.vespo_lambda_pos, opts.vespo_lambda_neg), min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.where(torch.isfinite(phi), phi, torch.zeros_like(phi))


@dataclasses.dataclass
class _RowLoss:
    per_token: torch.Tensor  # the row's per-token loss (policy + beta * KL), over its active tokens
    kl: torch.Tensor | None
    low_clipped: torch.Tensor | None  # bool, per token or one per row
    high_clipped: torch.Tensor | None
    phi: torch.Tensor | None


def _row_loss(seq: _Sequence, keep: torch.Tensor, opts: GRPOOptions, chosen: torch.Tensor | None) -> _RowLoss:
    """A row's per-token loss in TRL's order: the ratio, the policy term of its loss type (times the
    policy masks ``keep`` and the rollout weight), plus beta times the KL. ``chosen``: Clip-Cov's and KL-Cov's
    tokens of this row (``_covariance_choice``)."""
    A = seq.advantage
    log_ratio = seq.lp - seq.old
    level = opts.importance_sampling_level
    if level == "token":
        log_r = log_ratio
    elif level == "sequence":  # GSPO: the row's mean log-ratio, one ratio for the row
        log_r = _weighted_mean(log_ratio, seq.m)
    else:  # GSPO-token: the row's ratio as the value, each token's own gradient
        log_r = _weighted_mean(log_ratio, seq.m).detach() + seq.lp - seq.lp.detach()
    r = torch.exp(_clamp(log_r, opts.log_ratio_clamp))

    low = high = phi = None
    weighted_inside = False  # the rollout weight already folded into the term (vespo's w, gmpo's row mean)
    if opts.loss_type == "vespo":
        phi = _vespo_phi(seq, opts)
        policy = -phi * A * seq.lp
        weighted_inside = True
    elif opts.loss_type in ("dppo_tv", "dppo_kl"):
        p, p_old = torch.exp(seq.lp.detach()), torch.exp(seq.old)
        rose = p > p_old
        if opts.loss_type == "dppo_tv":  # |p - p_old| past the threshold, on the advantage's side
            outside = torch.where(A > 0, p - p_old > opts.eps_high, p_old - p > opts.epsilon)
        else:  # KL(Bern(p_old) || Bern(p)), with verl's 1e-8 inside the complement's log
            kl = p_old * (seq.old - seq.lp.detach()) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
            outside = torch.where(A > 0, (kl > opts.eps_high) & rose, (kl > opts.epsilon) & (p < p_old))
        weight = (r if opts.delta is None else torch.clamp(r, max=opts.delta)).detach()
        policy = torch.where(outside | (weight == 0), torch.zeros_like(seq.lp), -A * weight * seq.lp)
        high = outside
    elif opts.loss_type == "gpg":
        policy = -A * seq.lp
    elif opts.loss_type == "dro":
        policy = -A * seq.lp + opts.dro_beta / 2 * (seq.lp - seq.old) ** 2
    elif opts.loss_type == "gmpo":  # one value for the row: the geometric mean of its sign-clipped token ratios
        bounded = torch.clamp(log_ratio, -opts.epsilon, opts.eps_high)
        # on A's side: for A > 0 the smaller log-ratio, for A < 0 the larger, for A = 0 none
        kept = torch.where(A > 0, torch.minimum(log_ratio, bounded), torch.maximum(log_ratio, bounded))
        kept = torch.where(A == 0, torch.zeros_like(kept), kept)
        policy = -_weighted_mean(A, seq.m) * torch.exp(_weighted_mean(kept, seq.m))
        if seq.rollout_weight is not None:
            policy = policy * torch.exp(_weighted_mean(torch.log(seq.rollout_weight), seq.m))
        weighted_inside = True
        low, high = (log_ratio != bounded) & (A < 0), (log_ratio != bounded) & (A > 0)
    elif opts.loss_type == "clip_cov":
        plain, bounded = -A * r, -A * torch.clamp(r, 1 - opts.epsilon, 1 + opts.eps_high)
        policy = torch.where(chosen, torch.zeros_like(seq.lp), torch.maximum(plain, bounded))
        high = chosen
    elif opts.loss_type == "kl_cov":
        policy = -A * r + torch.where(chosen, opts.kl_cov_coef * torch.abs(log_ratio), torch.zeros_like(seq.lp))
        high = chosen
    elif opts.loss_type == "cispo":
        cap = torch.clamp(r, min=opts.cispo_ratio_min, max=opts.eps_high).detach()
        policy = torch.where(cap == 0, torch.zeros_like(seq.lp), -cap * A * seq.lp)
        high = (r > opts.eps_high) & (A > 0)
    elif opts.loss_type == "sapo":
        tau = torch.where(A > 0, opts.sapo_temperature_pos, opts.sapo_temperature_neg)
        policy = -(4 / tau) * torch.sigmoid(tau * (r - 1)) * A
    else:  # PPO clip
        clipped = torch.clamp(r, 1 - opts.epsilon, 1 + opts.eps_high)
        unclipped = r if opts.delta is None else torch.clamp(r, max=opts.delta)
        policy = torch.maximum(-unclipped * A, -clipped * A)
        if opts.dual_clip is not None:
            policy = torch.where(A < 0, torch.minimum(policy, -opts.dual_clip * A), policy)
        low = (unclipped < 1 - opts.epsilon) & (A < 0)
        high = (unclipped > 1 + opts.eps_high) & (A > 0)

    policy = policy * keep
    if seq.rollout_weight is not None and not weighted_inside:
        policy = policy * seq.rollout_weight
    kl = None
    per_token = policy.expand_as(seq.lp)
    if opts.beta != 0.0:
        kl = _kl(seq, opts)
        if opts.use_bias_correction_kl:
            kl = kl * r
        per_token = per_token + opts.beta * kl
    return _RowLoss(per_token, kl, low, high, phi)


def _token_weight_denominator(seq: _Sequence, rows: list[_Sequence], opts: GRPOOptions, normalizer):
    """The loss is sum over rows and active tokens of per_token * m / this."""
    B = len(rows)
    all_tokens = torch.clamp(sum(s.m.sum() for s in rows), min=1.0)
    if opts.loss_type in ("grpo", "sapo", "gmpo"):  # each row's token mean, then the mean over rows
        return B * torch.clamp(seq.m.sum(), min=1.0)
    if opts.loss_type == "bnpo":
        return all_tokens
    if opts.loss_type == "dr_grpo":
        return B * opts.max_completion_length
    if opts.loss_type in ("dapo", "cispo", "vespo", "dppo_tv", "dppo_kl", "gpg", "dro", "clip_cov", "kl_cov"):
        if normalizer is None:
            return all_tokens
        # 0 is a valid normalizer only with no active token, where every numerator is 0: the loss is 0
        return normalizer if float(normalizer) != 0 else 1.0
    return B  # luspo: each row's token sum, then the mean over rows


def _policy_keep(rows: list[_Sequence], opts: GRPOOptions) -> tuple:
    """Each row's policy-term mask (the high-entropy and off-policy masks multiplied), and the
    high-entropy mask alone (the entropy bonus's tokens) or None."""
    entropy_keep = [None] * len(rows)
    if opts.top_entropy_quantile < 1.0:
        entropies = collectives.gathered(torch.cat([s.entropy.detach() for s in rows]))
        if entropies.numel() == 0:
            entropy_keep = [torch.zeros_like(s.m) for s in rows]
        else:
            threshold = torch.quantile(entropies, 1.0 - opts.top_entropy_quantile)
            entropy_keep = [(s.entropy.detach() * s.m >= threshold).to(s.m.dtype) for s in rows]
    keep = []
    for s, e in zip(rows, entropy_keep, strict=True):
        k = torch.ones_like(s.m) if e is None else e
        if opts.off_policy_mask_threshold is not None:
            sampler = s.old if s.sampling is None else s.sampling  # the old log-probs, else this pass's own
            gap = torch.nan_to_num(sampler - s.lp.detach(), nan=0.0)
            on_policy_enough = _weighted_mean(gap, s.m) <= opts.off_policy_mask_threshold
            k = k * ((s.advantage >= 0) | on_policy_enough).to(s.m.dtype)
        keep.append(k)
    return keep, None if entropy_keep[0] is None else entropy_keep


def _metric_mean(values: list[torch.Tensor], rows: list[_Sequence]) -> torch.Tensor:
    """TRL's metric mean: over all rows for a per-row value (one per row, even a row without active
    tokens), else over active tokens weighted by the mask."""
    if all(v.dim() == 0 for v in values):
        return torch.stack(values).mean()
    total = sum((v * s.m).sum() for v, s in zip(values, rows, strict=True))
    return total / torch.clamp(sum(s.m.sum() for s in rows), min=1.0)


def _metrics(losses: list[_RowLoss], rows: list[_Sequence], opts: GRPOOptions) -> dict[str, torch.Tensor]:
    metrics = {}
    if opts.beta != 0.0:
        metrics["kl"] = _metric_mean([x.kl.detach() for x in losses], rows)
    if opts.compute_entropy:
        metrics["entropy"] = _metric_mean([s.entropy.detach() for s in rows], rows)
    if opts.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "gmpo"):
        low = [x.low_clipped.to(s.m.dtype) for x, s in zip(losses, rows, strict=True)]
        high = [x.high_clipped.to(s.m.dtype) for x, s in zip(losses, rows, strict=True)]
        metrics["clip_ratio/low_mean"] = _metric_mean(low, rows)
        metrics["clip_ratio/high_mean"] = _metric_mean(high, rows)
        metrics["clip_ratio/region_mean"] = _metric_mean(
            [torch.maximum(a, b) for a, b in zip(low, high, strict=True)], rows
        )
    elif opts.loss_type == "cispo":
        metrics["cispo_clip_ratio"] = _metric_mean(
            [x.high_clipped.to(s.m.dtype) for x, s in zip(losses, rows, strict=True)], rows
        )
    elif opts.loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = _metric_mean([x.phi for x in losses], rows)
    else:
        name = {
            "dppo_tv": "dppo/masked_mean",
            "dppo_kl": "dppo/masked_mean",
            "clip_cov": "clip_cov/selected_mean",
            "kl_cov": "kl_cov/selected_mean",
        }.get(opts.loss_type)
        if name is not None:
            metrics[name] = _metric_mean(
                [x.high_clipped.to(s.m.dtype) for x, s in zip(losses, rows, strict=True)], rows
            )
    return metrics


def _covariance_choice(rows: list[_Sequence], opts: GRPOOptions) -> list[torch.Tensor | None]:
    """Clip-Cov's and KL-Cov's chosen tokens, a bool vector a row over its active tokens (None for the other loss
    types), chosen over every process's rows (``covariance_selection="batch"``) or this call's.

    The covariance is (A - mean A)(log pi - mean log pi) over the active tokens: Clip-Cov's means weighted by the
    mask (verl's masked mean, with its 1e-8), KL-Cov's plain. Clip-Cov draws ``clip_cov_ratio`` of the mask's
    total (at least one) at random among the tokens whose covariance is in (lb, ub) and whose ratio PPO leaves
    unclipped: ``torch.randperm`` over them in row order, the first ones. KL-Cov takes the ``kl_cov_ratio`` of the
    active tokens (at least one) with the largest covariance (``torch.topk``)."""
    if opts.loss_type not in ("clip_cov", "kl_cov"):
        return [None] * len(rows)
    across = opts.covariance_selection == "batch"
    gather = collectives.gathered if across else (lambda values: values)
    A = [(s.advantage.detach() * torch.ones_like(s.m)) for s in rows]
    lp = [s.lp.detach() for s in rows]
    flat_A, flat_lp, flat_m = (gather(torch.cat(x)) for x in (A, lp, [s.m for s in rows]))
    if opts.loss_type == "clip_cov":
        mean_A = (flat_A * flat_m).sum() / (flat_m.sum() + 1e-8)
        mean_lp = (flat_lp * flat_m).sum() / (flat_m.sum() + 1e-8)
        eligible = []
        for s, a, x in zip(rows, A, lp, strict=True):
            r = torch.exp(_clamp(x - s.old, opts.log_ratio_clamp))
            unclipped = -a * r >= -a * torch.clamp(r, 1 - opts.epsilon, 1 + opts.eps_high)
            cov = (a - mean_A) * (x - mean_lp)
            eligible.append((cov > opts.clip_cov_lb) & (cov < opts.clip_cov_ub) & unclipped)
        count = max(int(opts.clip_cov_ratio * float(flat_m.sum())), 1)
        flags = gather(torch.cat(eligible).to(torch.uint8))
        positions = torch.nonzero(flags).flatten()
        picked = torch.zeros_like(flags, dtype=torch.bool)
        if positions.numel():
            picked[positions[torch.randperm(positions.numel())[: min(count, positions.numel())]]] = True
    else:
        cov = (flat_A - flat_A.mean()) * (flat_lp - flat_lp.mean())
        count = max(1, int(flat_A.numel() * opts.kl_cov_ratio))
        picked = torch.zeros(cov.numel(), dtype=torch.bool)
        if cov.numel():
            picked[torch.topk(cov, min(count, cov.numel())).indices] = True
    start = collectives.offsets(sum(s.m.numel() for s in rows))[0] if across else 0
    chosen = []
    for s in rows:
        chosen.append(picked[start : start + s.m.numel()].to(s.m.device))
        start += s.m.numel()
    return chosen


def grpo_loss_reference(
    logits: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    importance_weights: torch.Tensor | None = None,
    normalizer=None,
    options: GRPOOptions | None = None,
    sampling_logps: torch.Tensor | None = None,
    prompt_ids: torch.Tensor | None = None,
    kept_set=None,
    **option_kwargs,
) -> GRPOLossOutput:
    """The GRPO loss of logits [B, T, V] for completion ids [B, T], the specification. With ``logit_scale`` or
    ``logit_softcap`` in the options the logits are a head's raw outputs (``head_output``).

    The arguments are ``grpo_loss``'s: ``completion_mask`` [B, T] (a fractional value weights the
    token), ``advantages`` [B] or [B, T], optional old / reference log-probs and rollout importance
    weights ([B] or [B, T]), the token-count ``normalizer`` of dapo / cispo / vespo, the options, and
    ``sampling_logps`` for the off-policy mask (default: the old log-probs, else this pass's own), and
    ``prompt_ids`` [B], each row's prompt, for ``aggregation="prompt_mean"``; ``kept_set`` the sampler's kept sets
    (``kept_token_logprobs_and_entropy``).
    """
    opts = options if options is not None else GRPOOptions(**option_kwargs)
    if kept_set is None:
        lp, entropy = token_logprobs_and_entropy(
            logits, completion_ids, opts.temperature, opts.logit_scale, opts.logit_softcap
        )
    else:  # the current policy's log-probs over the sampler's kept sets
        lp, entropy = kept_token_logprobs_and_entropy(
            logits, completion_ids, kept_set, opts.temperature, opts.logit_scale, opts.logit_softcap, completion_mask
        )
    dtype = lp.dtype
    corrected = None
    correction = opts.rollout_correction
    if correction is not None:  # the trainers' own code is its oracle (tests/test_rollout_correction.py)
        check_call(correction, sampling_logps, importance_weights, old_logps)
        old = lp.detach() if reads_current(correction, old_logps) else old_logps.to(dtype)
        corrected = correction.compute(old, sampling_logps.detach().to(dtype), completion_mask.to(dtype))
        completion_mask, importance_weights = corrected.mask, corrected.weights
        old_logps = sampling_logps if correction.old_is_sampler() else old_logps
    rows = _sequences(
        lp, entropy, completion_mask, advantages, old_logps, ref_logps, importance_weights, sampling_logps, dtype
    )
    keep, entropy_keep = _policy_keep(rows, opts)
    chosen = _covariance_choice(rows, opts)
    losses = [_row_loss(s, k, opts, c) for s, k, c in zip(rows, keep, chosen, strict=True)]

    if opts.aggregation == "prompt_mean":  # SkyRL's: each prompt's token mean, then the mean over the prompts
        prompt_of = [int(i) for i in prompt_ids]
        tokens = {p: sum(s.m.sum() for s, q in zip(rows, prompt_of, strict=True) if q == p) for p in prompt_of}
        denominators = [len(tokens) * torch.clamp(tokens[p], min=1.0) for p in prompt_of]
    else:
        denominators = [_token_weight_denominator(seq, rows, opts, normalizer) for seq in rows]
    loss = torch.zeros((), dtype=dtype, device=lp.device)
    for seq, row, denominator in zip(rows, losses, denominators, strict=True):
        loss = loss + (row.per_token * seq.m).sum() / denominator
    metrics = _metrics(losses, rows, opts)
    if opts.entropy_coef != 0.0:  # TRL's bonus: the mean entropy over the (high-entropy) active tokens
        metrics["policy_loss"] = loss.detach()  # TRL logs the loss before its bonus
        bonus_m = (
            [s.m for s in rows] if entropy_keep is None else [s.m * e for s, e in zip(rows, entropy_keep, strict=True)]
        )
        total = sum((s.entropy * m).sum() for s, m in zip(rows, bonus_m, strict=True))
        if opts.entropy_reduction == "loss":  # divided as the (token-count) loss is: OpenRLHF's entropy loss
            divisor = _token_weight_denominator(rows[0], rows, opts, normalizer)
        else:
            divisor = torch.clamp(sum(m.sum() for m in bonus_m), min=1.0)
        loss = loss - opts.entropy_coef * total / divisor
    if corrected is not None:
        metrics.update(corrected.metrics)
    return GRPOLossOutput(loss, metrics, lp.detach())


# ---- The method family (``methods.py``): SFT, RFT, DPO -------------------------------------------------------------


def _sequence_means(logits, completion_ids, completion_mask, temperature, logit_scale, logit_softcap) -> tuple:
    """(each row's mask-weighted mean log-prob over its active tokens, 1/|o| sum_t log pi, 0 for a row with none; the
    log-probs [B, T], 0 where no token counts). Only active tokens are read: a masked id may be anything (-100)."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    lp = torch.zeros(completion_ids.shape, dtype=dtype, device=logits.device)
    means = []
    for i in range(logits.shape[0]):
        active = completion_mask[i] != 0
        picked, _ = token_logprobs_and_entropy(
            logits[i][active], completion_ids[i][active], temperature, logit_scale, logit_softcap
        )
        m = completion_mask[i][active].to(dtype)
        means.append((picked * m).sum() / torch.clamp(m.sum(), min=1.0))
        lp = lp.index_put((torch.full_like(completion_ids[i][active], i), active.nonzero()[:, 0]), picked)
    return means, lp


def sft_loss_reference(
    logits, completion_ids, completion_mask, *, temperature=1.0, logit_scale=1.0, logit_softcap=None
) -> GRPOLossOutput:
    """``methods.sft_loss``'s specification: the mean over rows of each row's mean negative log-likelihood."""
    means, lp = _sequence_means(logits, completion_ids, completion_mask, temperature, logit_scale, logit_softcap)
    loss = -sum(means) / len(means)
    return GRPOLossOutput(loss, {"nll": loss.detach()}, lp.detach())


def rft_loss_reference(
    logits, completion_ids, completion_mask, rewards, *, temperature=1.0, logit_scale=1.0, logit_softcap=None
) -> GRPOLossOutput:
    """``methods.rft_loss``'s specification: SFT's per-row term on the rows whose reward is 1 only, the mean taken
    over every row."""
    means, lp = _sequence_means(logits, completion_ids, completion_mask, temperature, logit_scale, logit_softcap)
    kept = [mean for mean, reward in zip(means, rewards.tolist(), strict=True) if reward == 1]
    loss = -sum(kept, torch.zeros((), dtype=lp.dtype, device=lp.device)) / len(means)
    return GRPOLossOutput(loss, {"kept_fraction": rewards.float().mean()}, lp.detach())


def dpo_loss_reference(
    logits,
    completion_ids,
    completion_mask,
    ref_logps,
    *,
    beta=0.1,
    temperature=1.0,
    logit_scale=1.0,
    logit_softcap=None,
) -> GRPOLossOutput:
    """``methods.dpo_loss``'s specification: pair i is (row i, row B + i); R(o) the row's mean of log pi - log pi_ref
    over its active tokens; the loss the mean over pairs of -log sigmoid(beta (R+ - R-)), written as log(1 + e^-x)."""
    means, lp = _sequence_means(logits, completion_ids, completion_mask, temperature, logit_scale, logit_softcap)
    ref_means, _ = _sequence_means_of(ref_logps.to(lp.dtype), completion_mask)
    implicit = [m - r for m, r in zip(means, ref_means, strict=True)]
    half = len(implicit) // 2
    margins = [beta * (implicit[i] - implicit[half + i]) for i in range(half)]
    loss = sum(torch.nn.functional.softplus(-x) for x in margins) / half
    metrics = {
        "rewards/chosen": sum(implicit[:half]).detach() / half,
        "rewards/rejected": sum(implicit[half:]).detach() / half,
        "rewards/accuracy": torch.tensor(sum(float(x > 0) for x in margins) / half, device=lp.device),
        "rewards/margin": sum(margins).detach() / half,
    }
    return GRPOLossOutput(loss, metrics, lp.detach())


def _sequence_means_of(values, completion_mask) -> tuple:
    """Each row's mask-weighted mean of per-token ``values`` over its active tokens (0 for a row with none)."""
    means = []
    for i in range(values.shape[0]):
        active = completion_mask[i] != 0
        m = completion_mask[i][active].to(values.dtype)
        means.append((values[i][active] * m).sum() / torch.clamp(m.sum(), min=1.0))
    return means, values
