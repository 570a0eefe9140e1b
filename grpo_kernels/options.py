"""One frozen options object for every non-tensor setting of the GRPO loss.

Names follow TRL's ``GRPOConfig`` so a TRL user needs no translation. Every value here
that can change from step to step (beta, the epsilons, delta, temperature, clamps) is
passed to the kernels as a run-time argument: changing it never recompiles. Only the
*presence* of an optional feature (beta == 0 or not, delta None or not, ...) selects a
kernel specialization.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
from typing import ClassVar

import torch

from .kernels import contracts
from .rollout_correction import as_rollout_correction
from .validation import check_choice, check_number


@dataclasses.dataclass(frozen=True)
class LossType:
    """Every fact the code needs of one loss type: the one registry (``LOSS_TYPE_REGISTRY``). Nothing outside
    this module and the specification compares a loss type's name; a layer asks its entry instead.

    ``policy_term``: the per-token policy term (``objective.per_token_terms``): "ppo_clip" (PPO's clipped ratio),
    "capped_ratio" (CISPO: the detached ratio, capped, times log pi), "soft_gate" (SAPO: a sigmoid gate of the
    ratio), "sequence_weight" (VESPO: a detached weight of the row's ratio, times log pi), "tv_trust_region" and
    "kl_trust_region" (DPPO: the detached ratio times log pi, on the tokens whose probability moved less than the
    threshold, by the binary total-variation or KL divergence), "log_prob" (GPG / REINFORCE: log pi times the
    advantage), "geometric_mean" (GMPO: the row's geometric mean of the sign-clipped token ratios),
    "log_ratio_penalty" (DRO: log pi times the advantage less a quadratic penalty on the log-ratio),
    "covariance_clip" and "covariance_kl" (Clip-Cov, KL-Cov: PPO's ratio, with the tokens of the largest
    advantage x log-prob covariance left out, or penalized by their |log-ratio|). Its own names, never a loss
    type's, so that a branch on the term reads as one.
    ``reduction``: TRL's (``objective.reduction_weights``): "row_token_mean" (each row's token mean, then the mean
    over rows), "batch_token_mean" (over the local batch's tokens), "constant" (B x max_completion_length),
    "token_count" (the ``normalizer``: global active tokens / processes), "rows" (over B).
    ``clip_metrics``: the names of the clip metrics it logs. ``divided_by_accumulation``: TRL divides its
    loss by the gradient-accumulation steps in training (the TRL adapter's ``loss_scale``).
    ``kernel_term``: the loss kernels' LOSS_KIND for the policy term (``kernels.contracts.LOSS_*``), None where its
    loss math runs in torch on the kernels' log-probs (vespo's sequence weight). ``clip_metrics_kind``: which clip
    metrics the loss-metrics kernel computes (``kernels.contracts.CLIP_METRICS_*``, in ``clip_metrics``' order).
    ``levels``: the ``importance_sampling_level`` values it takes (the ones that make their ratio from each
    token's own log-ratio take "token" alone). docs/extending.md lists what else a new loss type needs.
    """

    name: str
    policy_term: str
    reduction: str
    clip_metrics: tuple
    divided_by_accumulation: bool
    kernel_term: int | None
    clip_metrics_kind: int
    levels: tuple = ("token", "sequence", "sequence_token")

    @property
    def takes_normalizer(self) -> bool:
        """Its reduction divides by the ``normalizer`` (a trainer's global active tokens / processes)."""
        return self.reduction == "token_count"


_PPO_CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
_PPO_CLIP = dict(
    policy_term="ppo_clip",
    clip_metrics=_PPO_CLIP_METRICS,
    kernel_term=contracts.LOSS_PPO_CLIP,
    clip_metrics_kind=contracts.CLIP_METRICS_PPO,
)
TOKEN, ONE_FLAG = ("token",), contracts.CLIP_METRICS_CISPO
LOSS_TYPE_REGISTRY = {
    t.name: t
    for t in (
        LossType("grpo", reduction="row_token_mean", divided_by_accumulation=True, **_PPO_CLIP),
        LossType("bnpo", reduction="batch_token_mean", divided_by_accumulation=True, **_PPO_CLIP),
        LossType("dr_grpo", reduction="constant", divided_by_accumulation=True, **_PPO_CLIP),
        LossType("dapo", reduction="token_count", divided_by_accumulation=False, **_PPO_CLIP),
        LossType("luspo", reduction="rows", divided_by_accumulation=True, **_PPO_CLIP),
        LossType(
            "cispo",
            "capped_ratio",
            "token_count",
            ("cispo_clip_ratio",),
            False,
            contracts.LOSS_CISPO,
            contracts.CLIP_METRICS_CISPO,
        ),
        LossType("sapo", "soft_gate", "row_token_mean", (), True, contracts.LOSS_SAPO, contracts.CLIP_METRICS_NONE),
        LossType("vespo", "sequence_weight", "token_count", (), False, None, contracts.CLIP_METRICS_NONE, TOKEN),
        # the loss math of these runs in torch on the kernels' log-probs (no kernel_term); one flag a token where
        # they log one (CLIP_METRICS_CISPO's kind: the high flag, under the registry's name)
        LossType("dppo_tv", "tv_trust_region", "token_count", ("dppo/masked_mean",), False, None, ONE_FLAG, TOKEN),
        LossType("dppo_kl", "kl_trust_region", "token_count", ("dppo/masked_mean",), False, None, ONE_FLAG, TOKEN),
        LossType("gpg", "log_prob", "token_count", (), False, None, contracts.CLIP_METRICS_NONE, TOKEN),
        LossType(
            "gmpo", "geometric_mean", "row_token_mean", _PPO_CLIP_METRICS, True, None, contracts.CLIP_METRICS_PPO, TOKEN
        ),
        LossType("dro", "log_ratio_penalty", "token_count", (), False, None, contracts.CLIP_METRICS_NONE, TOKEN),
        LossType(
            "clip_cov", "covariance_clip", "token_count", ("clip_cov/selected_mean",), False, None, ONE_FLAG, TOKEN
        ),
        LossType("kl_cov", "covariance_kl", "token_count", ("kl_cov/selected_mean",), False, None, ONE_FLAG, TOKEN),
    )
}
LOSS_TYPES = tuple(LOSS_TYPE_REGISTRY)
PPO_CLIP_LOSS_TYPES = tuple(n for n, t in LOSS_TYPE_REGISTRY.items() if t.policy_term == "ppo_clip")
# delta: TRL's cap on the PPO-clip types' unclipped ratio, and DPPO's cap on its (detached) ratio
DELTA_LOSS_TYPES = PPO_CLIP_LOSS_TYPES + tuple(
    n for n, t in LOSS_TYPE_REGISTRY.items() if t.policy_term in ("tv_trust_region", "kl_trust_region")
)
# The loss types whose reduction divides by a token count (the ``normalizer``: global active tokens)
TOKEN_COUNT_LOSS_TYPES = tuple(n for n, t in LOSS_TYPE_REGISTRY.items() if t.takes_normalizer)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_token")
# Where Clip-Cov and KL-Cov pick their tokens: over every process's batch, or each call's own (verl's, per micro-batch)
COVARIANCE_SELECTIONS = ("batch", "micro_batch")
KL_ESTIMATORS = ("k3", "k1", "k2", "k3+", "k1+")  # "+": the value with k2's gradient (verl's straight-through)
# How the entropy bonus is divided: "token_mean", TRL's mean over its tokens; "loss", as the loss is (a token-count
# loss type's normalizer: OpenRLHF's aggregate_loss of the entropy with its global batch_num_tokens and dp_size)
ENTROPY_REDUCTIONS = ("token_mean", "loss")
# How the per-token loss is reduced: "loss_type", the loss type's own reduction (``LossType.reduction``);
# "prompt_mean", SkyRL's: each prompt's token mean, then the mean over the call's prompts (the call's ``prompt_ids``)
AGGREGATIONS = ("loss_type", "prompt_mean")

# Each trainer's loss at its own defaults (docs/loss-semantics.md, "Each trainer's conventions"), as GRPOOptions
# keywords; anything passed alongside a preset overrides it, within what the trainer's loss can be
# (``PRESET_LIMITS``). tests/test_presets.py holds each to the trainer's own code.
PRESETS = {
    # TRL 1.16's GRPOConfig: loss_type "dapo", k3 KL without clamps, times the ratio where there is a KL term
    # (use_bias_correction_kl, from_preset), no dual-clip (delta caps the unclipped branch)
    "trl": dict(loss_type="dapo", kl_estimator="k3"),
    # verl "vanilla" with loss_agg_mode "token-mean" (our dapo: the normalizer is verl's global tokens / dp size):
    # dual-clip c = 3, log-ratio clamp +-20, the KL loss "low_var_kl" (k3, +-20 in, +-10 out; k1 and k2 unclamped)
    # aggregated like the policy loss
    "verl": dict(loss_type="dapo", dual_clip=3.0, log_ratio_clamp=20.0, kl_estimator="k3", kl_clamp=10.0),
    # OpenRLHF's --actor.loss_agg_mode "token-mean" (dapo: its batch_num_tokens / dp_size is the normalizer), the
    # ratio's log clamped to +-20, the KL loss's estimator k1, every estimate clamped to +-10 (k3's log-ratio at -10
    # from below first: the +-20 clamp gives the same numbers), dual-clip only when set, the entropy loss
    # (--actor.entropy_coef) aggregated as the policy loss is (aggregate_loss with the same batch info)
    "openrlhf": dict(
        loss_type="dapo", kl_estimator="k1", log_ratio_clamp=20.0, kl_clamp=10.0, entropy_reduction="loss"
    ),
}
# What a preset's trainer computes with one reduction: the loss types and ratio levels it can be, and what to use
# for the rest (the trainer's other aggregations leave empty rows out of their mean, and OpenRLHF's KL loss is a
# token mean whatever the policy's aggregation: neither is one of our reductions).
PRESET_LIMITS = {
    "verl": dict(
        loss_types=("dapo",),
        levels=("token",),
        instead=(
            "verl's other loss_agg_modes and its 'gspo' loss_mode: grpo_kernels.integration.verl (its policy losses "
            "take every loss_agg_mode, kl_loss its KL loss)"
        ),
    ),
    "openrlhf": dict(
        loss_types=("dapo",),
        levels=("token",),
        instead=(
            "--actor.loss_agg_mode seq-mean-token-mean and --actor.policy_loss_type gspo: "
            "grpo_kernels.integration.openrlhf (PolicyLoss, compute_approx_kl and aggregate_loss, OpenRLHF's own "
            "signatures)"
        ),
    ),
}
# The matching advantage conventions: keywords of grpo_kernels.advantages.group_advantages.
ADVANTAGE_PRESETS = {
    "trl": dict(std="sample", eps=1e-4),
    "verl": dict(std="sample", eps=1e-6),
    "openrlhf": dict(std="sample", eps=1e-9, clip=10.0),  # its group_norm, clamped to --reward.clip_range
}


@dataclasses.dataclass(frozen=True)
class GRPOOptions:
    """All options of the GRPO loss. Each one's meaning: docs/options.md (and the fields' Attributes below)."""

    loss_type: str = "grpo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    dual_clip: float | None = None
    importance_sampling_level: str = "token"
    temperature: float = 1.0
    max_completion_length: int | None = None
    use_bias_correction_kl: bool = False
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    kl_estimator: str = "k3"
    log_ratio_clamp: float | None = None
    kl_clamp: float | None = None
    compute_entropy: bool = True
    entropy_coef: float = 0.0
    entropy_reduction: str = "token_mean"
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # Clip-Cov / KL-Cov (the entropy mechanism's losses, verl's names and defaults) and where they select tokens
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    kl_cov_coef: float = 1.0
    covariance_selection: str = "batch"
    dro_beta: float | None = None
    cispo_ratio_min: float | None = None
    aggregation: str = "loss_type"
    # the train / rollout mismatch correction (grpo_kernels.rollout_correction): verl's presets or config, TRL's modes
    rollout_correction: object = None
    # the model's head output transform (grpo_kernels.heads): logits = cap(logit_scale * raw) / temperature
    logit_scale: float = 1.0
    logit_softcap: float | None = None

    # Facts derived from the fields (``_derive_facts``), kept as plain attributes: asked on every call
    loss: ClassVar[LossType]
    reduction: ClassVar[str]
    takes_normalizer: ClassVar[bool]
    eps_high: ClassVar[float]
    uses_kl: ClassVar[bool]
    kernel_temperature: ClassVar[float]
    kernel_softcap: ClassVar[float | None]
    sequence_level: ClassVar[bool]
    loss_in_kernel: ClassVar[bool]
    masks_tokens: ClassVar[bool]
    fused_metric_names: ClassVar[tuple]
    kernel_loss: ClassVar[contracts.KernelLoss | None]
    has_entropy_bonus: ClassVar[bool]
    masks_high_entropy: ClassVar[bool]
    masks_off_policy: ClassVar[bool]
    clip_low: ClassVar[float]
    clip_high: ClassVar[float]
    runtime_scalars: ClassVar[torch.Tensor]
    absent_scalars: ClassVar[tuple]
    graph_constant: ClassVar[bool]
    # the loss types whose reduction divides by the ``normalizer`` (validation names them)
    token_count_loss_types: ClassVar[tuple] = TOKEN_COUNT_LOSS_TYPES

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_number("beta", self.beta, non_negative=True)
        check_number("epsilon", self.epsilon, non_negative=True)
        check_number("epsilon_high", self.epsilon_high, non_negative=True, optional=True)
        check_number("delta", self.delta, positive=True, optional=True)
        check_number("dual_clip", self.dual_clip, optional=True)
        check_number("temperature", self.temperature, positive=True)
        check_number("sapo_temperature_pos", self.sapo_temperature_pos, positive=True)
        check_number("sapo_temperature_neg", self.sapo_temperature_neg, positive=True)
        check_number("log_ratio_clamp", self.log_ratio_clamp, positive=True, optional=True)
        check_number("kl_clamp", self.kl_clamp, positive=True, optional=True)
        if self.epsilon > 1.0:
            raise ValueError(f"epsilon must be <= 1 (the lower clip bound is 1 - epsilon), got {self.epsilon!r}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (verl and OpenRLHF use 3), got {self.dual_clip!r}")
        if self.dual_clip is not None and self.loss_type not in PPO_CLIP_LOSS_TYPES:
            raise ValueError(
                f"dual_clip applies to the PPO-clip loss types {list(PPO_CLIP_LOSS_TYPES)}, "
                f"not to loss_type={self.loss_type!r}"
            )
        if self.delta is not None and self.loss_type not in DELTA_LOSS_TYPES:
            raise ValueError(
                f"delta applies to the loss types {list(DELTA_LOSS_TYPES)} (the PPO-clip ones, and DPPO's cap on its "
                f"ratio), not to loss_type={self.loss_type!r}"
            )
        if self.loss_type == "dr_grpo":
            if self.max_completion_length is None:
                raise ValueError("loss_type='dr_grpo' needs max_completion_length (its constant normalizer), got None")
            if isinstance(self.max_completion_length, bool) or not isinstance(self.max_completion_length, int):
                raise TypeError(f"max_completion_length must be an int, got {self.max_completion_length!r}")
            if self.max_completion_length < 1:
                raise ValueError(f"max_completion_length must be >= 1, got {self.max_completion_length!r}")
        check_number("entropy_coef", self.entropy_coef)
        check_choice("entropy_reduction", self.entropy_reduction, ENTROPY_REDUCTIONS)
        check_choice("aggregation", self.aggregation, AGGREGATIONS)
        if self.entropy_reduction == "loss" and LOSS_TYPE_REGISTRY[self.loss_type].reduction != "token_count":
            counted = [t.name for t in LOSS_TYPE_REGISTRY.values() if t.reduction == "token_count"]
            raise ValueError(
                f"entropy_reduction='loss' divides the entropy bonus as a token-count loss is: it needs "
                f"loss_type in {counted}, got loss_type={self.loss_type!r}"
            )
        if self.entropy_reduction == "loss" and self.aggregation != "loss_type":
            raise ValueError(
                f"entropy_reduction='loss' divides the entropy bonus by the loss type's token count: it needs "
                f"aggregation='loss_type', got aggregation={self.aggregation!r}"
            )
        check_number("top_entropy_quantile", self.top_entropy_quantile)
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(
                f"top_entropy_quantile must be in [0, 1] (1 keeps every token), got {self.top_entropy_quantile!r}"
            )
        if self.top_entropy_quantile < 1.0 and not self.compute_entropy:
            raise ValueError(
                "top_entropy_quantile < 1 masks tokens by their entropy: compute_entropy=False turns it off"
            )
        check_number("off_policy_mask_threshold", self.off_policy_mask_threshold, optional=True)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            check_number(name, getattr(self, name))
        levels = LOSS_TYPE_REGISTRY[self.loss_type].levels
        if self.importance_sampling_level not in levels:
            raise ValueError(
                f"loss_type={self.loss_type!r} makes its own ratio from the token log-ratios: use "
                f"importance_sampling_level in {list(levels)}, got {self.importance_sampling_level!r}"
            )
        check_choice("covariance_selection", self.covariance_selection, COVARIANCE_SELECTIONS)
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            check_number(name, getattr(self, name), positive=True)
        check_number("clip_cov_lb", self.clip_cov_lb)
        check_number("clip_cov_ub", self.clip_cov_ub)
        check_number("kl_cov_coef", self.kl_cov_coef, non_negative=True)
        check_number("dro_beta", self.dro_beta, positive=True, optional=True)
        check_number("cispo_ratio_min", self.cispo_ratio_min, non_negative=True, optional=True)
        if self.cispo_ratio_min is not None and LOSS_TYPE_REGISTRY[self.loss_type].policy_term != "capped_ratio":
            raise ValueError(
                f"cispo_ratio_min bounds CISPO's ratio from below: it needs loss_type='cispo', got "
                f"loss_type={self.loss_type!r}"
            )
        if self.loss_type == "dro" and self.dro_beta is None:
            raise ValueError("loss_type='dro' needs dro_beta (its log-ratio penalty's coefficient, > 0), got None")
        if self.entropy_coef != 0.0 and not self.compute_entropy:
            raise ValueError(
                f"entropy_coef={self.entropy_coef!r} needs the entropy: compute_entropy=False turns it off"
            )
        object.__setattr__(self, "rollout_correction", as_rollout_correction(self.rollout_correction))
        check_number("logit_scale", self.logit_scale, positive=True)
        check_number("logit_softcap", self.logit_softcap, positive=True, optional=True)
        if self.use_bias_correction_kl and self.beta == 0:
            raise ValueError("use_bias_correction_kl=True multiplies the KL term, but beta=0 turns the KL term off")
        self._derive_facts()

    def _derive_facts(self) -> None:
        """The facts every call asks of the options, kept as plain attributes (frozen options never change;
        ``replace`` makes new ones, which derive their own). Not fields: equality, hashing and ``repr`` never
        see them.

        - ``loss``: this loss type's registry entry.
        - ``reduction``: how the per-token loss is reduced (``objective.reduction_weights``): the loss type's own
          (``LossType.reduction``), or "prompt_mean" (``aggregation``).
        - ``takes_normalizer``: the reduction divides by the call's ``normalizer`` (a token-count loss type's own).
        - ``eps_high``: the upper clip (for cispo: the absolute cap on the ratio, as in TRL).
        - ``uses_kl``: the loss has a KL term (beta != 0).
        - ``kernel_temperature``: what the kernels divide the capped raw logits by: the head's scale folded in,
          temperature / logit_scale (cap(s x) / tau = (C / s) tanh(x / (C / s)) / (tau / s), C = logit_softcap).
        - ``kernel_softcap``: the soft-cap the kernels apply to the raw logits x, softcap * tanh(x / softcap):
          logit_softcap / logit_scale (the scale folded in); None without a cap.
        - ``sequence_level``: the ratio needs the whole row's log-probs (GSPO and GSPO-token): the two-pass path.
        - ``loss_in_kernel``: the kernels compute this loss's per-token terms (token-level ratios, a per-token
          formula, no ``cispo_ratio_min``); otherwise the kernels give log-probs and the loss math runs on them
          in torch (GSPO's sequence ratios, VESPO's sequence weights, the families of ``policy_terms.py``).
        - ``masks_tokens``: a policy-term mask that needs this pass's log-probs or entropies before the loss
          (TRL's high-entropy mask, DeepSeek-V3.2's off-policy sequence mask): one more read of the logits.
          ``masks_high_entropy`` and ``masks_off_policy``: which of them; ``has_entropy_bonus``: entropy_coef != 0.
        - ``clip_low``, ``clip_high``: PPO-clip's ratio bounds, 1 - epsilon and 1 + eps_high.
        - ``runtime_scalars``: the float options and values the loss reads on every call (``RUNTIME_SCALARS``), one
          float64 CPU tensor (NaN where unset), which a torch.compile graph takes as an input (``scalar``);
          ``absent_scalars``: the names that are unset (None), which shape the graph.
        - ``kernel_loss``: these options as the loss kernels' launchers take them (``kernels.contracts.KernelLoss``),
          so the launchers never read an option (nor import this module); None for a loss type whose loss math
          runs in torch (no ``kernel_term``).
        - ``fused_metric_names``: the names of a fused loss call's metrics, in the loss-metrics kernel's order (its
          KL where there is one, its entropy where computed, the clip metrics; TRL's names)."""
        loss = LOSS_TYPE_REGISTRY[self.loss_type]
        sequence_level = self.importance_sampling_level in ("sequence", "sequence_token")
        eps_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        facts = dict(
            loss=loss,
            reduction=loss.reduction if self.aggregation == "loss_type" else self.aggregation,
            takes_normalizer=loss.takes_normalizer and self.aggregation == "loss_type",
            eps_high=eps_high,
            uses_kl=self.beta != 0.0,
            kernel_temperature=self.temperature / self.logit_scale,
            kernel_softcap=None if self.logit_softcap is None else self.logit_softcap / self.logit_scale,
            sequence_level=sequence_level,
            # the kernels' CISPO caps the ratio from above only: a lower bound runs the loss math in torch
            loss_in_kernel=not sequence_level and loss.kernel_term is not None and self.cispo_ratio_min is None,
            masks_tokens=self.top_entropy_quantile < 1.0 or self.off_policy_mask_threshold is not None,
            has_entropy_bonus=self.entropy_coef != 0.0,
            masks_high_entropy=self.top_entropy_quantile < 1.0,
            masks_off_policy=self.off_policy_mask_threshold is not None,
            clip_low=1 - self.epsilon,
            clip_high=1 + eps_high,
            fused_metric_names=("kl",) * (self.beta != 0.0) + ("entropy",) * self.compute_entropy + loss.clip_metrics,
        )
        for name, value in facts.items():
            object.__setattr__(self, name, value)  # (frozen: __setattr__ refuses)
        object.__setattr__(self, "kernel_loss", None if loss.kernel_term is None else _kernel_loss(self))
        values = [getattr(self, name) for name in RUNTIME_SCALARS]
        absent = tuple(name for name, v in zip(RUNTIME_SCALARS, values, strict=True) if v is None)
        object.__setattr__(self, "absent_scalars", absent)
        object.__setattr__(self, "graph_constant", False)
        object.__setattr__(
            self, "runtime_scalars", torch.tensor([math.nan if v is None else float(v) for v in values], dtype=_F64)
        )

    def as_graph_constant(self) -> GRPOOptions:
        """These options marked as a graph's constant (a compiled call's keywords: ``inputs.options_from``): their
        floats are numbers in the graph, as the call site's are."""
        object.__setattr__(self, "graph_constant", True)
        return self

    def replace(self, **changes) -> GRPOOptions:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_preset(cls, preset: str, **overrides) -> GRPOOptions:
        """A trainer's loss at its defaults ("trl", "verl", "openrlhf"), with ``overrides`` on top. A ``loss_type``
        or ``importance_sampling_level`` whose loss that trainer computes otherwise than one of our reductions is
        refused, naming what to use instead (``PRESET_LIMITS``), as is an ``aggregation`` other than the loss type's."""
        check_choice("preset", preset, tuple(PRESETS))
        options = {**PRESETS[preset], **overrides}
        if options.get("aggregation", "loss_type") != "loss_type":
            raise ValueError(
                f"preset={preset!r} reduces the loss as {preset}'s loss types do: aggregation must be 'loss_type', "
                f"got {options['aggregation']!r} ({preset} has no prompt-level aggregation; use GRPOOptions without "
                "a preset)"
            )
        limits = PRESET_LIMITS.get(preset)
        if limits is not None:
            for name, allowed in (("loss_type", limits["loss_types"]), ("importance_sampling_level", limits["levels"])):
                value = options.get(name, getattr(cls, name))
                if value not in allowed:
                    raise ValueError(
                        f"preset={preset!r} takes {name} in {list(allowed)}, got {value!r}: {preset} "
                        f"reduces that loss otherwise than any loss_type here. For {limits['instead']}"
                    )
        if preset == "verl" and options["kl_estimator"].rstrip("+") != "k3" and "kl_clamp" not in overrides:
            options["kl_clamp"] = None  # verl clamps only its k3 ("low_var_kl")
        if preset == "trl" and "use_bias_correction_kl" not in overrides:
            # TRL 1.16's default (use_bias_correction_kl=True) multiplies its KL term by the ratio; no KL term, nothing
            options["use_bias_correction_kl"] = options.get("beta", 0.0) != 0.0
        return cls(**options)

    @classmethod
    def from_trl_config(cls, config, **overrides) -> GRPOOptions:
        """The loss options of a TRL ``GRPOConfig`` (or any object with its attribute names)."""
        # an override (a trainer's resolved value) wins over the config, also in the fields derived below
        get = lambda name, default=None: overrides.get(name, getattr(config, name, default))  # noqa: E731
        loss_type = get("loss_type", "dapo")
        beta = float(get("beta", 0.0))
        options = dict(
            loss_type=loss_type,
            beta=beta,
            epsilon=float(get("epsilon", 0.2)),
            epsilon_high=get("epsilon_high"),
            delta=get("delta") if loss_type in PPO_CLIP_LOSS_TYPES else None,
            importance_sampling_level=get("importance_sampling_level", "token"),
            temperature=float(get("temperature", 1.0)),
            max_completion_length=get("max_completion_length") if loss_type == "dr_grpo" else None,
            use_bias_correction_kl=bool(get("use_bias_correction_kl", False)) and beta != 0.0,
            sapo_temperature_pos=float(get("sapo_temperature_pos", 1.0)),
            sapo_temperature_neg=float(get("sapo_temperature_neg", 1.05)),
            entropy_coef=float(get("entropy_coef", 0.0) or 0.0),
            top_entropy_quantile=float(get("top_entropy_quantile", 1.0)),
            vespo_k_pos=float(get("vespo_k_pos", 2.0)),
            vespo_lambda_pos=float(get("vespo_lambda_pos", 3.0)),
            vespo_k_neg=float(get("vespo_k_neg", 3.0)),
            vespo_lambda_neg=float(get("vespo_lambda_neg", 2.0)),
            off_policy_mask_threshold=get("off_policy_mask_threshold"),
            kl_estimator=PRESETS["trl"]["kl_estimator"],
        )
        return cls(**{**options, **overrides})


# The float options (and the values derived from them) the loss reads on every call, in ``runtime_scalars``' order
RUNTIME_SCALARS = (
    "beta",
    "epsilon",
    "eps_high",
    "clip_low",
    "clip_high",
    "delta",
    "dual_clip",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "log_ratio_clamp",
    "kl_clamp",
    "entropy_coef",
    "top_entropy_quantile",
    "off_policy_mask_threshold",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "dro_beta",
    "cispo_ratio_min",
    "temperature",
    "kernel_temperature",
    "kernel_softcap",
)
_RUNTIME_INDEX = {name: i for i, name in enumerate(RUNTIME_SCALARS)}
_F64 = torch.float64

_KL_KINDS = {
    "k3": contracts.KL_K3,
    "k1": contracts.KL_K1,
    "k2": contracts.KL_K2,
    "k3+": contracts.KL_K3,
    "k1+": contracts.KL_K1,
}

# Other trainers' names for our options (an unknown option names ours: ``check_option_names``)
OPTION_ALIASES = {
    "clip_eps": "epsilon",
    "clip_eps_low": "epsilon",
    "eps_clip": "epsilon",
    "eps_low": "epsilon",
    "epsilon_low": "epsilon",
    "clip_ratio": "epsilon",
    "clip_ratio_low": "epsilon",
    "cliprange": "epsilon",
    "clip_range": "epsilon",
    "clip_eps_high": "epsilon_high",
    "eps_high": "epsilon_high",
    "clip_ratio_high": "epsilon_high",
    "clip_ratio_c": "dual_clip",
    "kl_coef": "beta",
    "init_kl_coef": "beta",
    "kl_beta": "beta",
    "kl_ctl": "beta",
    "entropy_coeff": "entropy_coef",
    "kl_penalty": "kl_estimator",
    "kl_loss_type": "kl_estimator",
    "loss_agg_mode": "loss_type",
    "loss_reduction": "aggregation",
    "max_response_length": "max_completion_length",
    "ppo_kl_coef": "kl_cov_coef",
    "loss_mode": "loss_type",
}
# The loss functions' and Modules' call keywords, which an unknown option may have meant (option_docs' lists)
CALL_KEYWORDS = (
    "backend",
    "in_place_backward",
    "one_pass",
    "check_ids",
    "drop_last_position",
    "preset",
    "options",
    "loss_scale",
    "cu_seqlens",
    "vocab_parallel_group",
    "vocab_start_index",
    "reduce_hidden_grad",
    "context_parallel_group",
    "lm_head_mode",
    "head_precision",
    "prompt_ids",
    "kept_set",
    "sampling_logps",
    "importance_weights",
    "normalizer",
    "bias",
)


def check_option_names(names) -> None:
    """Refuse an unknown option by name, with the nearest of ours: another trainer's name for it
    (``OPTION_ALIASES``: OpenRLHF's ``clip_eps`` is ``epsilon``), else the closest spelling among the options and
    the call keywords."""
    fields = _option_fields()
    for name in names:
        if name in fields:
            continue
        if name in CALL_KEYWORDS:
            raise TypeError(
                f"{name!r} is not a loss option (a GRPOOptions field) but a keyword of the call: pass it to the "
                "function or Module whose signature takes it (docs/the-call.md)"
            )
        if name in OPTION_ALIASES:
            hint = f"; did you mean {OPTION_ALIASES[name]!r} (another trainer's name for it)?"
        else:
            close = difflib.get_close_matches(name, fields + CALL_KEYWORDS, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else "."
        raise TypeError(f"unknown option {name!r}{hint} The options are GRPOOptions' fields (docs/options.md)")


@functools.cache
def _option_fields() -> tuple:
    return tuple(f.name for f in dataclasses.fields(GRPOOptions))


def _checked_init(generated):
    """GRPOOptions' generated ``__init__`` behind ``check_option_names``: every way of making options (keywords to
    ``GRPOLoss``, ``grpo_loss``, ``from_preset``, ``GRPOOptions`` itself) names an unknown option's fix."""

    @functools.wraps(generated)
    def __init__(self, *args, **kwargs):
        if not kwargs.keys() <= _FIELD_SET:
            check_option_names(kwargs)
        generated(self, *args, **kwargs)

    return __init__


_FIELD_SET = frozenset(f.name for f in dataclasses.fields(GRPOOptions))
GRPOOptions.__init__ = _checked_init(GRPOOptions.__init__)


def option_value(options: GRPOOptions, name: str, like: torch.Tensor | None = None):
    """A float option (or derived value: ``RUNTIME_SCALARS``) as the loss math reads it: the Python number (None
    where unset) in an eager call; inside a torch.compile graph its element of ``options.runtime_scalars``, a tensor
    the graph takes as an input, so that a new value (``GRPOLoss.update``: a temperature or clip schedule) is a new
    input, not a new graph. ``like``: the tensor it combines with, whose device and dtype it takes (without one, a
    float64 CPU 0-d tensor: a custom op's argument). Options that are a graph's constant (a compiled call's
    keywords) give their numbers there too. (A function, not a method: dynamo calls no method of a constant.)"""
    if not torch.compiler.is_compiling() or options.graph_constant:
        return getattr(options, name)
    if name in options.absent_scalars:  # (a None is the graph's structure: an option turned on or off)
        return None
    value = options.runtime_scalars[_RUNTIME_INDEX[name]]
    return value if like is None else value.to(device=like.device, dtype=like.dtype)


def kernel_loss_scalars(value) -> tuple:
    """The loss kernels' run-time scalars in ``contracts.LOSS_SCALARS`` order, from ``value(name)``: an option's
    number, None where unset (0 to the kernels, whose ``LOSS_FLAGS`` say which are on). The options' own
    ``kernel_loss`` and a compiled graph's op (from ``runtime_scalars``) take them here."""
    number = lambda name: 0.0 if value(name) is None else float(value(name))  # noqa: E731
    scalars = dict(
        eps_low=number("epsilon"),
        eps_high=number("eps_high"),
        delta=number("delta"),
        dual_clip=number("dual_clip"),
        beta=number("beta"),
        log_ratio_clamp=number("log_ratio_clamp"),
        kl_clamp=number("kl_clamp"),
        sapo_tau_pos=number("sapo_temperature_pos"),
        sapo_tau_neg=number("sapo_temperature_neg"),
    )
    return tuple(scalars[name] for name in contracts.LOSS_SCALARS)


def runtime_values(scalars) -> dict:
    """``GRPOOptions.runtime_scalars`` (a CPU tensor, inside an op: no device sync) as numbers by name, None where
    the option is unset."""
    return {name: None if v != v else v for name, v in zip(RUNTIME_SCALARS, scalars.tolist(), strict=True)}


def _kernel_loss(o: GRPOOptions) -> contracts.KernelLoss:
    """``GRPOOptions.kernel_loss``: the policy term's kernel, the run-time scalars (``contracts.LOSS_SCALARS``
    order: a value that changes between steps is never a constexpr) and the compile-time ``LOSS_FLAGS`` (a
    feature's presence only, one ``contracts.LOSS_FLAG_*`` bit each)."""
    args = {
        "loss_scalars": kernel_loss_scalars(lambda name: getattr(o, name)),
        "LOSS_KIND": o.loss.kernel_term,
        "KL_KIND": _KL_KINDS[o.kl_estimator],
        "LOSS_FLAGS": (
            contracts.LOSS_FLAG_DELTA * (o.delta is not None)
            | contracts.LOSS_FLAG_DUAL_CLIP * (o.dual_clip is not None)
            | contracts.LOSS_FLAG_LOG_RATIO_CLAMP * (o.log_ratio_clamp is not None)
            | contracts.LOSS_FLAG_KL_CLAMP * (o.kl_clamp is not None)
            | contracts.LOSS_FLAG_BIAS_CORRECTION_KL * bool(o.use_bias_correction_kl)
            | contracts.LOSS_FLAG_KL_STRAIGHT_THROUGH * o.kl_estimator.endswith("+")
        ),
    }
    return contracts.KernelLoss(
        args,
        o.temperature,
        o.kernel_temperature,
        o.kernel_softcap,
        o.compute_entropy,
        o.uses_kl,
        o.loss.clip_metrics_kind,
        len(o.loss.clip_metrics),
    )
