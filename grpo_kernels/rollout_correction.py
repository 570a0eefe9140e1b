"""The train / rollout mismatch correction in the loss call: importance weights and rejection masks from the
rollout engine's log-probs (``sampling_logps``), with the diagnostics the trainers log.

Three conventions, each written as its trainer computes it, chosen by ``GRPOOptions.rollout_correction``:

- ``VerlRolloutCorrection``: verl 0.9's ``RolloutCorrectionConfig`` (its fields, and its presets by name:
  ``"decoupled_seq_is_rs"``, ``"decoupled_token_icepop"``, ``"bypass_ppo_clip_k3_rs"``, ...): truncated (TIS) or
  IcePop importance weights per token or per sequence, optionally normalized to mean 1 over the batch of every
  process, and rejection by any of verl's k1 / k2 / k3 statistics per token, or per sequence as a sum, a mean
  or a max; metrics under verl's names (``rollout_corr/...``), as ``compute_rollout_correction_and_rejection_mask``
  computes them.
- ``TRLImportanceSampling``: TRL's ``vllm_importance_sampling_mode`` (``token_truncate``, ``token_mask``,
  ``sequence_truncate``, ``sequence_mask``) with ``vllm_importance_sampling_clip_min`` / ``_max``; metrics under
  TRL's names (``sampling/...``).
- ``OpenRLHFCorrection``: OpenRLHF's ``is_correction_*`` options (a ratio, binary-KL or TV gate per token or per
  sequence, masking or clipping); metrics ``is_filter_ratio`` and ``vllm_kl``.

The weights are detached and multiply the policy term (the call's ``importance_weights``); verl's rejection takes
the token out of the loss's mask (its reductions and metrics too), as verl's modified ``response_mask`` does;
TRL's and OpenRLHF's give it weight 0 and leave it in the mask, as theirs do. The
weights compare the old policy's log-probs (``old_logps``; without them this call's own, detached, as a single
update on fresh samples has them) with the sampler's. verl's bypass mode (``bypass_mode=True``, the PPO-clip
presets) takes the sampler's log-probs as the old ones and compares this call's log-probs with them.

Everything here is O(B * T) torch on [B, T] log-probs, in the sequence layout, without a host sync.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import torch

from . import collectives
from .conventions import VERL_MEAN_EPS, openrlhf_masked_mean, verl_masked_mean, verl_masked_sum

# verl's bound on a log-ratio before exp (``rollout_corr_helper.SAFETY_BOUND``)
SAFETY_BOUND = 20.0

RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
IS_LEVELS = ("token", "sequence")
TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class Correction:
    """One call's correction: the importance weights ([B, T], [B, 1] or None), the mask with the rejected tokens
    taken out ([B, T], float) and the metrics (0-d detached tensors by name)."""

    __slots__ = ("weights", "mask", "metrics")

    def __init__(self, weights, mask, metrics):
        self.weights, self.mask, self.metrics = weights, mask, metrics


def at_active_tokens(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> tuple:
    """(old, sampling) with each masked position read as 0: what a padded batch holds there (NaN, +-inf, a stale
    value) reaches no weight, rejection or metric of any correction. The trainers' own code multiplies by the mask
    (NaN x 0 is NaN) or indexes the active tokens; on finite padding both give these numbers."""
    active = mask != 0
    return torch.where(active, old, 0.0), torch.where(active, sampling, 0.0)


# ---- verl ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VerlRolloutCorrection:
    """verl's ``RolloutCorrectionConfig`` (the same fields, defaults and meanings). ``from_preset(name, **args)``
    builds one of its named presets; ``from_config(config)`` reads a verl config (or any object or mapping with
    its names). ``loss_type="reinforce"`` (the bypass REINFORCE presets) is verl's own loss, not a correction of
    this one: the verl adapter's ``grpo_kernels_bypass_mode`` runs it."""

    rollout_is: str | None = "sequence"
    rollout_is_threshold: str | float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    PRESETS: ClassVar[dict] = {}  # filled below: verl's preset names -> their fields and their arguments

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_is must be one of {list(IS_LEVELS)} or None, got {self.rollout_is!r}")
        if self.loss_type != "ppo_clip":
            raise ValueError(
                f"rollout correction loss_type={self.loss_type!r} is verl's bypass REINFORCE loss, not a correction "
                "of this loss: use the verl adapter's loss_mode 'grpo_kernels_bypass_mode', or loss_type='ppo_clip'"
            )
        if self.rollout_is is not None:
            is_threshold(self.rollout_is_threshold)  # a bad threshold is refused here, not at the first call
        if self.rollout_rs is not None:
            rs_thresholds(rs_options(self.rollout_rs), self.rollout_rs_threshold)

    @classmethod
    def from_preset(cls, name: str, **arguments) -> VerlRolloutCorrection:
        """verl's ``RolloutCorrectionConfig.<name>(**arguments)``, e.g. ``from_preset("decoupled_seq_is_rs",
        rs_threshold="0.5_2.0")``."""
        if name not in cls.PRESETS:
            raise ValueError(f"rollout_correction preset must be one of {sorted(cls.PRESETS)}, got {name!r}")
        build, parameters = cls.PRESETS[name]
        unknown = sorted(set(arguments) - set(parameters))
        if unknown:
            raise TypeError(f"verl's preset {name!r} takes {list(parameters)}, got {unknown}")
        return cls(**build(**{**parameters, **arguments}))

    @classmethod
    def from_config(cls, config) -> VerlRolloutCorrection:
        """A verl ``RolloutCorrectionConfig`` (or a mapping / object with its field names) as ours."""
        get = config.get if hasattr(config, "get") else lambda name, default: getattr(config, name, default)
        fields = {f.name: get(f.name, f.default) for f in dataclasses.fields(cls)}
        return cls(**fields)

    def against_current(self) -> bool:
        """Whether the weights compare this call's log-probs with the sampler's (bypass), not the old ones."""
        return self.bypass_mode

    def old_is_sampler(self) -> bool:
        return self.bypass_mode

    def applies_weights(self) -> bool:
        """verl's bypass PPO-clip applies no weight: its ratio is against the sampler already."""
        return self.rollout_is is not None and not self.bypass_mode

    def compute(self, old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> Correction:
        """verl's ``compute_rollout_correction_and_rejection_mask(old, sampling, mask, ...)``: (weights, the
        rejection's mask, the metrics with the ``rollout_corr/`` prefix)."""
        old, sampling = at_active_tokens(old, sampling, mask)
        log_ratio = old - sampling
        metrics: dict = {}
        weights = None
        if self.rollout_is is not None:
            weights, is_metrics = _verl_weights(
                log_ratio, mask, self.rollout_is, self.rollout_is_threshold, self.rollout_is_batch_normalize
            )
            metrics.update(is_metrics)
        new_mask = mask
        if self.rollout_rs is not None:
            new_mask, rs_metrics = _verl_rejection(log_ratio, mask, self.rollout_rs, self.rollout_rs_threshold)
            metrics.update(rs_metrics)
        metrics.update(offpolicy_metrics(old, sampling, mask))
        return Correction(
            weights if self.applies_weights() else None,
            new_mask,
            {f"rollout_corr/{k}": v for k, v in metrics.items()},
        )


def _rejecting(rollout_is, rollout_rs, rs_default, **fixed):
    """A preset that rejects by ``rollout_rs`` (threshold argument ``rs_threshold``), weighting at the level
    ``rollout_is`` (argument ``is_threshold``, 2.0) or not at all (None)."""
    if rollout_is is None:
        return (
            lambda rs_threshold: dict(
                rollout_is=None, rollout_rs=rollout_rs, rollout_rs_threshold=rs_threshold, **fixed
            ),
            {"rs_threshold": rs_default},
        )
    return (
        lambda is_threshold, rs_threshold: dict(
            rollout_is=rollout_is,
            rollout_is_threshold=is_threshold,
            rollout_rs=rollout_rs,
            rollout_rs_threshold=rs_threshold,
            **fixed,
        ),
        {"is_threshold": 2.0, "rs_threshold": rs_default},
    )


def _verl_presets() -> dict:
    """verl 0.9.1's ``RolloutCorrectionConfig`` presets: name -> (fields from arguments, the arguments' defaults)."""
    geo, k3 = "0.999_1.001", 0.01
    return {
        "disabled": (lambda: dict(rollout_is=None), {}),
        "decoupled_token_is": (
            lambda threshold: dict(rollout_is="token", rollout_is_threshold=threshold),
            {"threshold": 2.0},
        ),
        "decoupled_seq_is": (
            lambda threshold: dict(rollout_is="sequence", rollout_is_threshold=threshold),
            {"threshold": 2.0},
        ),
        "decoupled_token_icepop": (
            lambda threshold, threshold_lower: dict(
                rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}"
            ),
            {"threshold": 5.0, "threshold_lower": 0.5},
        ),
        "decoupled_seq_is_rs": _rejecting("sequence", "seq_sum_k1", "0.5_2.0"),
        "decoupled_geo_rs": _rejecting(None, "seq_mean_k1", geo),
        "decoupled_geo_rs_seq_tis": _rejecting("sequence", "seq_mean_k1", geo),
        "decoupled_geo_rs_token_tis": _rejecting("token", "seq_mean_k1", geo),
        "decoupled_k3_rs": _rejecting(None, "seq_mean_k3", k3),
        "decoupled_k3_rs_seq_tis": _rejecting("sequence", "seq_mean_k3", k3),
        "decoupled_k3_rs_token_tis": _rejecting("token", "seq_mean_k3", k3),
        "bypass_ppo_clip": (lambda: dict(rollout_is=None, bypass_mode=True), {}),
        "bypass_ppo_clip_geo_rs": _rejecting(None, "seq_mean_k1", geo, bypass_mode=True),
        "bypass_ppo_clip_k3_rs": _rejecting(None, "seq_mean_k3", k3, bypass_mode=True),
    }


VerlRolloutCorrection.PRESETS.update(_verl_presets())
# verl's bypass REINFORCE presets are its own loss (the verl adapter's bypass_mode), refused here by name
VERL_REINFORCE_PRESETS = (
    "bypass_pg_is",
    "bypass_pg_geo_rs",
    "bypass_pg_geo_rs_seq_tis",
    "bypass_pg_geo_rs_token_tis",
    "bypass_pg_token_icepop",
)


def is_threshold(spec) -> tuple[float, float | None]:
    """verl's ``rollout_is_threshold``: (upper, lower or None); a number (or its string) is TIS's upper bound, a
    ``"lower_upper"`` string IcePop's bounds."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    lower = None
    try:
        if isinstance(spec, str) and "_" in spec:
            lower_text, upper_text = spec.strip().split("_", 1)
            lower, upper = float(lower_text), float(upper_text)
        else:
            upper = float(spec)
    except ValueError:
        raise ValueError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold needs 0 < lower <= upper, got {spec!r}")
    return upper, lower


def rs_options(spec: str) -> list[str]:
    """verl's ``rollout_rs``: a comma-separated list of its options, each once, in order."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"rollout_rs must be a comma-separated list of {list(RS_OPTIONS)}, got {spec!r}")
    options: list[str] = []
    for option in (part.strip() for part in spec.split(",") if part.strip()):
        if option not in RS_OPTIONS:
            raise ValueError(f"rollout_rs option must be one of {list(RS_OPTIONS)}, got {option!r}")
        if option not in options:
            options.append(option)
    return options


def rs_thresholds(options: list[str], spec) -> dict[str, tuple[float | None, float]]:
    """verl's ``rollout_rs_threshold``: one spec shared, or one per option; (lower or None, upper) by option. A k1
    option takes ratio bounds ``"lower_upper"`` (a single number: upper, with its reciprocal below); k2 / k3
    take an upper bound on the divergence."""
    if spec is None:
        raise ValueError("rollout_rs needs rollout_rs_threshold, got None")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_rs_threshold must be a number or a string, got {spec!r}")
    specs = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(specs) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold takes one threshold for all of {options} or one each, got {spec!r}")
    specs = specs * len(options) if len(specs) == 1 else specs
    bounds = {}
    for option, text in zip(options, specs, strict=True):
        try:
            if option.endswith("k1"):
                lower_text, upper_text = text.split("_", 1) if "_" in text else (str(1.0 / float(text)), text)
                lower, upper = float(lower_text), float(upper_text)
                if not 0 < lower <= upper:
                    raise ValueError
            else:
                if "_" in text:
                    raise ValueError
                lower, upper = None, float(text)
                if upper <= 0:
                    raise ValueError
        except ValueError:
            what = "'lower_upper' ratio bounds, 0 < lower <= upper" if option.endswith("k1") else "an upper bound > 0"
            raise ValueError(f"rollout_rs_threshold for {option!r} must be {what}, got {text!r}") from None
        bounds[option] = (lower, upper)
    return bounds


def _masked_max(values, mask):
    return values.masked_fill(~mask.bool(), float("-inf")).max()


def _masked_min(values, mask):
    return values.masked_fill(~mask.bool(), float("inf")).min()


def _rows_stats(values, valid):
    """mean, unbiased std (0 for one row), max and min of ``values`` [S] over the ``valid`` rows, sync-free (verl
    indexes the valid rows)."""
    count = valid.sum()
    mean = torch.where(valid, values, 0.0).sum() / count.clamp(min=1)
    var = torch.where(valid, (values - mean) ** 2, 0.0).sum() / (count - 1).clamp(min=1)
    std = torch.where(count > 1, var.sqrt(), 0.0)
    return mean, std, values.masked_fill(~valid, float("-inf")).max(), values.masked_fill(~valid, float("inf")).min()


def _batch_mean(values, mask):
    """The mean of the masked values over every process (torch.distributed's default group; this process's alone
    without one), as verl's batch normalization takes it (``distributed_masked_mean``)."""
    totals = collectives.summed(torch.stack([(values * mask).sum(), mask.sum()]))
    return totals[0] / totals[1]


def _verl_weights(log_ratio, mask, level, threshold, batch_normalize):
    """verl's ``compute_rollout_correction_weights``: (the weights [B, T], zero at padding; their metrics)."""
    upper, lower = is_threshold(threshold)
    if level == "token":
        for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        for_metrics = verl_masked_sum(log_ratio, mask, -1).unsqueeze(-1)  # [B, 1]
        raw = torch.exp(for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:  # TIS
        weights = raw.clamp(max=upper)
    else:  # IcePop
        weights = torch.where((raw >= lower) & (raw <= upper), raw, 0.0)
    metrics = _verl_is_metrics(weights, raw, for_metrics, mask, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = verl_masked_mean(((raw < lower) | (raw > upper)).float(), mask)
    weights = weights.detach()
    if batch_normalize:  # per token: over every token; per sequence: over the rows' weights, one a row with tokens
        if level == "token":
            mean = _batch_mean(weights, mask)
        else:
            mean = _batch_mean(verl_masked_mean(weights, mask, -1), (mask.sum(-1) > 0).to(weights.dtype))
        usable = mean > VERL_MEAN_EPS
        weights = torch.where(usable, weights / mean, weights)
        metrics["rollout_is_batch_norm_factor"] = torch.where(usable, mean, 1.0)
    return weights, metrics


def _verl_is_metrics(weights, raw, for_metrics, mask, level, upper, lower):
    """verl's ``compute_is_metrics``."""
    metrics = {}
    lower_or_reciprocal = 1.0 / upper if lower is None else lower
    # verl compares the log-ratio with fp32 logs of the bounds
    log_upper = torch.log(torch.tensor(upper, device=weights.device))
    log_lower = torch.log(torch.tensor(lower_or_reciprocal, device=weights.device))
    if level == "sequence":
        metrics["rollout_is_max"] = torch.exp(for_metrics.max().clamp(max=SAFETY_BOUND))
        metrics["rollout_is_min"] = torch.exp(for_metrics.min())
        metrics["rollout_is_mean"] = verl_masked_mean(weights, mask)
        metrics["rollout_is_ratio_fraction_high"] = (for_metrics > log_upper).float().mean()
        metrics["rollout_is_ratio_fraction_low"] = (for_metrics < log_lower).float().mean()
    else:
        metrics["rollout_is_mean"] = verl_masked_mean(weights, mask)
        metrics["rollout_is_ratio_fraction_high"] = verl_masked_mean((raw > upper).float(), mask)
        metrics["rollout_is_ratio_fraction_low"] = verl_masked_mean((raw < lower_or_reciprocal).float(), mask)
        metrics["rollout_is_max"] = _masked_max(weights, mask)
        metrics["rollout_is_min"] = _masked_min(weights, mask)
    bounded = weights.clamp(min=0.0, max=upper)
    bounded_mean = verl_masked_mean(bounded, mask)
    variance = verl_masked_mean(bounded.square(), mask) - bounded_mean.square()
    metrics["rollout_is_std"] = torch.where(mask.sum() > 1, variance.clamp(min=0.0).sqrt(), 0.0)
    normalized = bounded / (bounded_mean + VERL_MEAN_EPS)
    metrics["rollout_is_eff_sample_size"] = 1.0 / verl_masked_mean(normalized.square(), mask)
    row_means = verl_masked_mean(weights, mask, -1)
    metrics["rollout_is_seq_mean"] = row_means.mean()
    metrics["rollout_is_seq_std"] = row_means.std() if row_means.numel() > 1 else row_means.new_zeros(())
    metrics["rollout_is_seq_max"] = row_means.max()
    metrics["rollout_is_seq_min"] = row_means.min()
    metrics["rollout_is_seq_max_deviation"] = (row_means - 1.0).abs().max()
    raw_row_means = verl_masked_mean(raw, mask, -1)
    metrics["rollout_is_seq_fraction_high"] = (raw_row_means > upper).float().mean()
    metrics["rollout_is_seq_fraction_low"] = (raw_row_means < lower_or_reciprocal).float().mean()
    return metrics


def _verl_rejection(log_ratio, mask, spec, threshold_spec):
    """verl's ``compute_rollout_rejection_mask``: (the mask with every option's rejections taken out; metrics).
    Every option must pass for a token to stay."""
    options = rs_options(spec)
    bounds = rs_thresholds(options, threshold_spec)
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    token_stats = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    in_mask = mask.bool()
    valid_rows = mask.sum(-1) > 0
    kept = torch.ones_like(mask)
    metrics = {}
    for option in options:
        lower, upper = bounds[option]
        k1 = option.endswith("k1")
        low, high = (math.log(lower), math.log(upper)) if k1 else (None, upper)
        estimator = token_stats[option[-2:]]
        if option.startswith("token"):
            row_stat, stat = None, estimator
        else:
            if option.startswith("seq_sum"):
                row_stat = verl_masked_sum(estimator, mask, -1)
            elif option.startswith("seq_mean"):
                row_stat = verl_masked_mean(estimator, mask, -1)
            else:  # seq_max: 0 for a row without tokens
                row_max = estimator.masked_fill(~in_mask, float("-inf")).max(dim=-1).values
                row_stat = torch.where(row_max == float("-inf"), 0.0, row_max)
            stat = row_stat.unsqueeze(-1).expand_as(mask)
        keep = (stat <= high) if not k1 else (stat >= low) & (stat <= high)
        option_kept = keep.to(mask.dtype)
        kept = kept * option_kept
        metrics.update(_verl_rs_metrics(option, stat, mask, valid_rows, row_stat, high, low if k1 else 0.0, k1))
        rows_kept = (~(~keep & in_mask)).all(dim=-1)
        metrics[f"rollout_rs_{option}_masked_fraction"] = verl_masked_mean(1 - option_kept, mask)
        valid = valid_rows.to(mask.dtype)
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = torch.where(
            valid.sum() > 0, ((1.0 - rows_kept.to(mask.dtype)) * valid).sum() / valid.sum().clamp(min=1), 0.0
        )
    metrics["rollout_rs_masked_fraction"] = verl_masked_mean(1 - kept, mask)
    final_keep = (kept > 0.5) & in_mask
    metrics["rollout_rs_seq_masked_fraction"] = (~final_keep & in_mask).any(dim=-1).float().mean()
    return mask * kept, metrics


def _verl_rs_metrics(option, stat, mask, valid_rows, row_stat, upper, lower, two_sided):
    """verl's ``compute_rs_metrics`` for one option (``stat`` per token; ``row_stat`` per row or None)."""
    prefix = f"rollout_rs_{option}"
    rows = row_stat if row_stat is not None else verl_masked_mean(stat, mask, -1)
    rows_mean, rows_std, rows_max, rows_min = _rows_stats(rows, valid_rows)
    valid = valid_rows.float()
    count = valid.sum().clamp(min=1)
    any_row = valid_rows.any()
    rows_high = ((rows > upper).float() * valid).sum() / count
    rows_low = ((rows < lower).float() * valid).sum() / count if two_sided else None
    sequence_level = row_stat is not None
    metrics = {f"{prefix}_mean": verl_masked_mean(stat, mask)}
    if sequence_level:
        metrics[f"{prefix}_max"] = torch.where(any_row, rows_max, _masked_max(stat, mask))
        metrics[f"{prefix}_min"] = torch.where(any_row, rows_min, _masked_min(stat, mask))
        high, low = rows_high, rows_low if two_sided else rows.new_zeros(())
    else:
        metrics[f"{prefix}_max"] = _masked_max(stat, mask)
        metrics[f"{prefix}_min"] = _masked_min(stat, mask)
        high = verl_masked_mean((stat > upper).float(), mask)
        low = verl_masked_mean((stat < lower).float(), mask) if two_sided else stat.new_zeros(())
    metrics[f"{prefix}_fraction_high"] = high
    metrics[f"{prefix}_fraction_low"] = low
    bounded = stat.clamp(min=lower if two_sided else 0.0, max=upper)
    bounded_mean = verl_masked_mean(bounded, mask)
    variance = verl_masked_mean(bounded.square(), mask) - bounded_mean.square()
    metrics[f"{prefix}_std"] = torch.where(mask.sum() > 1, variance.clamp(min=0.0).sqrt(), 0.0)
    zero = rows.new_zeros(())
    metrics[f"{prefix}_seq_mean"] = torch.where(any_row, rows_mean, zero)
    metrics[f"{prefix}_seq_std"] = torch.where(any_row, rows_std, zero)
    metrics[f"{prefix}_seq_max"] = torch.where(any_row, rows_max, zero)
    metrics[f"{prefix}_seq_min"] = torch.where(any_row, rows_min, zero)
    deviation = rows.abs().masked_fill(~valid_rows, float("-inf")).max()
    metrics[f"{prefix}_seq_max_deviation"] = torch.where(any_row, deviation, zero)
    metrics[f"{prefix}_seq_fraction_high"] = rows_high
    if two_sided:
        metrics[f"{prefix}_seq_fraction_low"] = rows_low
    return metrics


def offpolicy_metrics(old, sampling, mask) -> dict:
    """verl's ``compute_offpolicy_metrics``: the rollout / training gap (KL, perplexities, chi-squared), unprefixed."""
    metrics = {}
    row_training = verl_masked_mean(old, mask, -1)
    metrics["training_ppl"] = torch.exp(-row_training).mean()
    metrics["training_log_ppl"] = (-row_training).mean()
    metrics["kl"] = verl_masked_mean(sampling - old, mask)
    log_ratio = old - sampling
    metrics["k3_kl"] = verl_masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)
    row_rollout = verl_masked_mean(sampling, mask, -1)
    metrics["rollout_ppl"] = torch.exp(-row_rollout).mean()
    metrics["rollout_log_ppl"] = (-row_rollout).mean()
    log_ppl_diff = row_rollout - row_training
    metrics["log_ppl_diff"] = log_ppl_diff.mean()
    metrics["log_ppl_abs_diff"] = log_ppl_diff.abs().mean()
    metrics["log_ppl_diff_max"] = log_ppl_diff.max()
    metrics["log_ppl_diff_min"] = log_ppl_diff.min()
    metrics["ppl_ratio"] = torch.exp(log_ppl_diff).mean()
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    metrics["chi2_token"] = verl_masked_mean(rho.square(), mask) - 1.0
    row_log_ratio = verl_masked_sum(log_ratio, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    metrics["chi2_seq"] = torch.exp(2.0 * row_log_ratio).mean() - 1.0
    return metrics


# ---- TRL ----------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TRLImportanceSampling:
    """TRL's vLLM importance sampling (``GRPOConfig.vllm_importance_sampling_mode`` and its clip bounds, TRL's
    names and defaults): the ratio of the old policy to the sampler per token, or per sequence (the product),
    clipped to [clip_min, clip_max] (``*_truncate``) or zeroed outside it (``*_mask``); a token the sampler could
    not score (a NaN log-prob) gets ratio 1."""

    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None

    def __post_init__(self) -> None:
        if self.vllm_importance_sampling_mode not in TRL_MODES:
            raise ValueError(
                f"vllm_importance_sampling_mode must be one of {list(TRL_MODES)}, "
                f"got {self.vllm_importance_sampling_mode!r}"
            )
        for name in ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"{name} must be a number >= 0 or None, got {value!r}")

    @classmethod
    def from_config(cls, config) -> TRLImportanceSampling:
        """A TRL ``GRPOConfig``'s settings (or any object with its attribute names)."""
        fields = {f.name: getattr(config, f.name, f.default) for f in dataclasses.fields(cls)}
        return cls(**fields)

    def against_current(self) -> bool:
        return False

    def old_is_sampler(self) -> bool:
        return False

    def compute(self, old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> Correction:
        """TRL's ``importance_sampling_ratio`` ([B, T], or [B, 1] per sequence) and its ``sampling/`` metrics."""
        old, sampling = at_active_tokens(old, sampling, mask)
        mode = self.vllm_importance_sampling_mode
        clip_min, clip_max = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        difference = torch.nan_to_num((old - sampling) * mask, nan=0.0)
        sequence_level = mode.startswith("sequence")
        if sequence_level:
            difference = difference.sum(dim=-1, keepdim=True)
        ratio = torch.exp(difference)
        if mode.endswith("truncate"):
            ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
        else:
            low = -math.inf if clip_min is None else clip_min
            high = math.inf if clip_max is None else clip_max
            ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
        delta = torch.abs(old - sampling)
        counted = mask.bool() & ~torch.isnan(delta)
        any_counted = counted.any()
        zero = delta.new_zeros(())
        metrics = {
            "sampling/sampling_logp_difference/mean": torch.where(
                any_counted, torch.where(counted, delta, 0.0).sum() / counted.sum().clamp(min=1), zero
            ),
            "sampling/sampling_logp_difference/max": torch.where(
                any_counted, delta.masked_fill(~counted, float("-inf")).max(), zero
            ),
        }
        flat = ratio.reshape(-1)
        in_ratio = torch.ones_like(flat, dtype=torch.bool) if sequence_level else mask.bool().reshape(-1)
        any_ratio = in_ratio.any()
        metrics["sampling/importance_sampling_ratio/min"] = torch.where(
            any_ratio, flat.masked_fill(~in_ratio, float("inf")).min(), zero
        )
        metrics["sampling/importance_sampling_ratio/mean"] = torch.where(
            any_ratio, torch.where(in_ratio, flat, 0.0).sum() / in_ratio.sum().clamp(min=1), zero
        )
        metrics["sampling/importance_sampling_ratio/max"] = torch.where(
            any_ratio, flat.masked_fill(~in_ratio, float("-inf")).max(), zero
        )
        return Correction(ratio, mask, metrics)


# ---- OpenRLHF -----------------------------------------------------------------------------------------------------

OPENRLHF_LEVELS = ("token", "seq")
OPENRLHF_MODES = ("mask", "clip")
OPENRLHF_GATINGS = ("ratio", "binary_kl", "tv")


@dataclasses.dataclass(frozen=True)
class OpenRLHFCorrection:
    """OpenRLHF 0.11's train / rollout correction (``--actor.is_correction_level`` token / seq,
    ``_mode`` mask / clip, ``_gating`` ratio / binary_kl / tv, ``_threshold`` (low, high); its names and
    defaults): a gate reads a statistic per token, or a sequence's mean (the ratio pi_old / pi_rollout, or the
    binary KL / total variation of the two token probabilities), and zeroes the weight of the units outside
    [low, high] (mask: the survivors keep their token ratio) or clamps the statistic into it (clip: the ratio
    itself, per token). Rejected tokens stay in the mask with weight 0, as OpenRLHF's do. Metrics
    ``is_filter_ratio`` and ``vllm_kl`` (OpenRLHF's names). (OpenRLHF's GSPO takes its ratio against the sampler
    instead: its adapter does that.)"""

    is_correction_level: str = "token"
    is_correction_mode: str = "mask"
    is_correction_gating: str = "ratio"
    is_correction_threshold: tuple = (0.5, 5.0)

    def __post_init__(self) -> None:
        for name, value, choices in (
            ("is_correction_level", self.is_correction_level, OPENRLHF_LEVELS),
            ("is_correction_mode", self.is_correction_mode, OPENRLHF_MODES),
            ("is_correction_gating", self.is_correction_gating, OPENRLHF_GATINGS),
        ):
            if value not in choices:
                raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
        threshold = tuple(self.is_correction_threshold)
        if len(threshold) != 2:
            raise ValueError(f"is_correction_threshold must be (low, high), got {threshold!r}")
        object.__setattr__(self, "is_correction_threshold", threshold)
        if self.is_correction_mode == "clip" and (
            self.is_correction_level == "seq" or self.is_correction_gating != "ratio"
        ):
            raise ValueError(
                "is_correction_mode='clip' clamps a per-token ratio: it needs is_correction_level='token'"
                f" and is_correction_gating='ratio', got {self.is_correction_level!r} and "
                f"{self.is_correction_gating!r}"
            )
        if self.is_correction_gating != "ratio" and threshold[0] > 0:
            raise ValueError(
                f"is_correction_gating={self.is_correction_gating!r} bounds a divergence from above only: "
                f"the threshold's low must be 0, got {threshold!r}"
            )

    def against_current(self) -> bool:
        return False

    def old_is_sampler(self) -> bool:
        return False

    def compute(self, old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> Correction:
        """OpenRLHF's weight of the policy term [B, T] (0 at padding), ``is_filter_ratio`` and ``vllm_kl``."""
        old, sampling = at_active_tokens(old, sampling, mask)
        low, high = self.is_correction_threshold
        sequence_level = self.is_correction_level == "seq"
        log_ratio = old - sampling
        token_ratio = log_ratio.exp()
        if self.is_correction_gating == "ratio":
            stat = openrlhf_masked_mean(log_ratio, mask, -1).unsqueeze(-1) if sequence_level else log_ratio
            stat = stat.exp()
        else:
            p = sampling.exp().clamp(1e-6, 1 - 1e-6)  # keeps the binary KL's logs finite
            q = old.exp().clamp(1e-6, 1 - 1e-6)
            if self.is_correction_gating == "binary_kl":
                stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
            else:  # tv
                stat = (p - q).abs()
            if sequence_level:
                stat = openrlhf_masked_mean(stat, mask, -1).unsqueeze(-1)
        if self.is_correction_mode == "clip":
            weight = stat.clamp(min=low, max=high)
            filtered = (stat < low) | (stat > high)
        else:
            keep = (stat >= low) & (stat <= high)
            weight = torch.where(keep, token_ratio, 0.0)
            filtered = ~keep
        metrics = {
            "is_filter_ratio": filtered.float().mean()
            if sequence_level
            else openrlhf_masked_mean(filtered.float(), mask),
            "vllm_kl": openrlhf_masked_mean(sampling - old, mask),
        }
        return Correction(torch.where(mask.bool(), weight.expand_as(old), 0.0), mask, metrics)


# ---- A corrected call ---------------------------------------------------------------------------------------------


def check_call(correction, sampling_logps, importance_weights, old_logps) -> None:
    """A corrected call's inputs (the loss call's and the specification's): the sampler's log-probs, no weights of
    the caller's own, and in bypass mode no old log-probs (the sampler's are the old ones)."""
    if sampling_logps is None:
        raise ValueError(
            f"rollout_correction={correction!r} needs sampling_logps (the rollout engine's log-probs, shaped as the "
            "ids), got None"
        )
    if importance_weights is not None:
        raise ValueError(
            "importance_weights and rollout_correction both weight the policy term: pass importance_weights=None "
            "(the correction computes them from sampling_logps), or rollout_correction=None"
        )
    if correction.old_is_sampler() and old_logps is not None:
        raise ValueError(
            "rollout_correction in bypass mode takes sampling_logps as the old log-probs: pass old_logps=None, "
            "got a tensor"
        )


def reads_current(correction, old_logps) -> bool:
    """Whether the correction compares this call's own log-probs (detached) with the sampler's: without old ones
    (a single update on fresh samples), or in bypass mode."""
    return old_logps is None or correction.against_current()


# ---- The option's values ------------------------------------------------------------------------------------------


def as_rollout_correction(value):
    """``GRPOOptions.rollout_correction`` as one of the two conventions: None; an instance; a name (one of verl's
    presets, or one of TRL's ``vllm_importance_sampling_mode`` values with TRL's default bounds); a verl
    ``RolloutCorrectionConfig`` (or a mapping with its field names)."""
    if value is None or isinstance(value, (VerlRolloutCorrection, TRLImportanceSampling, OpenRLHFCorrection)):
        return value
    if isinstance(value, str):
        if value in VerlRolloutCorrection.PRESETS:
            return VerlRolloutCorrection.from_preset(value)
        if value in TRL_MODES:
            return TRLImportanceSampling(value)
        if value in VERL_REINFORCE_PRESETS:
            raise ValueError(
                f"rollout_correction={value!r} is verl's bypass REINFORCE loss, not a correction of this loss: use "
                "the verl adapter's loss_mode 'grpo_kernels_bypass_mode'"
            )
        raise ValueError(
            f"rollout_correction must be one of verl's presets {sorted(VerlRolloutCorrection.PRESETS)} or TRL's "
            f"modes {list(TRL_MODES)}, got {value!r}"
        )
    if hasattr(value, "rollout_is") or (isinstance(value, dict) and "rollout_is" in value):
        return VerlRolloutCorrection.from_config(value)
    raise TypeError(
        "rollout_correction must be None, a preset or mode name, VerlRolloutCorrection, TRLImportanceSampling, "
        f"OpenRLHFCorrection or a verl RolloutCorrectionConfig, got {type(value).__name__}"
    )
