"""verl drop-in: policy losses registered in verl's registry, and verl's log-probs on our kernel.

verl's actor computes per-token log-probs from the logits (``logprobs_from_logits``), then
calls the policy loss named by ``actor_rollout_ref.actor.policy_loss.loss_mode`` on those
log-probs. Both halves can be ours:

- ``register()`` adds ``"grpo_kernels_<mode>"`` to verl's registry for each of verl 0.9's 12 policy-loss
  modes (``POLICY_LOSSES``; ``"grpo_kernels"`` is vanilla too), computed with this package's per-token terms
  and reproducing verl's own numbers (the loss, its gradient, the metrics), with every ``loss_agg_mode``
  (token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm), verl's
  ``global_batch_info`` and the rollout correction weights.
- ``patch_logprobs()`` replaces verl's ``logprobs_from_logits`` and entropy functions with our fused
  kernel (``selective_log_softmax``, ``token_entropy``): no fp32 [N, V] log-softmax, the gradient in
  the logits' dtype; with megatron-core installed, also the Megatron backend's vocabulary-parallel
  ones (``vocab_parallel_log_probs_from_logits``, ``vocab_parallel_entropy``), over Megatron's
  tensor-parallel group.
- ``kl_loss(...)`` is verl's KL loss (``kl_penalty`` + ``agg_loss``) on our estimators.

Turning it on in a verl run: put ``grpo_kernels.integration.enable`` in verl's
``external_lib`` setting (importing that module calls ``register()`` and ``patch_logprobs()``),
and set ``actor_rollout_ref.actor.policy_loss.loss_mode=grpo_kernels_<mode>``. See
``grpo_kernels/integration/README.md``.
"""

from __future__ import annotations

import functools

import torch

from ..argument_docs import ADAPTER_ARGUMENTS, document_public
from ..conventions import VERL_AGG_MODES, verl_aggregate, verl_masked_mean
from ..objective import kl_term, per_token_terms
from ..options import GRPOOptions
from . import replace_everywhere

AGG_MODES = VERL_AGG_MODES
VERL_KL = {"low_var_kl": "k3", "k3": "k3", "kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2"}


def _at_active(t: torch.Tensor | None, active: torch.Tensor, fill: float) -> torch.Tensor | None:
    """``t`` where a token counts, ``fill`` elsewhere (None stays None): a masked position's content never enters
    the loss math. Differentiable at the active tokens."""
    return None if t is None else torch.where(active, t, fill)


def _active_tokens_only(policy_loss):
    """A policy loss that reads its inputs at active tokens only: whatever the masked positions of the log-probs,
    advantages and weights hold (padding, a NaN, an inf) is replaced by a neutral value (log-probs 0, so a ratio of
    1; advantage 0; weight 1) before the loss math, so it contributes exactly 0 to the loss, its gradient and the
    metrics. (verl's own token-level aggregations mask such a NaN, its sequence-level ones carry it; on finite
    inputs the two agree.)"""

    @functools.wraps(policy_loss)
    def on_active_tokens(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode: str = "token-mean",
        config=None,
        rollout_is_weights=None,
    ):
        active = response_mask.bool()
        return policy_loss(
            _at_active(old_log_prob, active, 0.0),
            _at_active(log_prob, active, 0.0),
            _at_active(advantages, active, 0.0),
            response_mask,
            loss_agg_mode,
            config,
            _at_active(rollout_is_weights, active, 1.0),
        )

    return on_active_tokens


# verl's agg_loss, under the adapter's name (``conventions``: one definition, the OpenRLHF adapter's too)
aggregate = verl_aggregate


def _clip_bounds(config) -> tuple:
    clip = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else clip
    high = config.clip_ratio_high if config.clip_ratio_high is not None else clip
    return low, high


def _batch_info(config) -> dict:
    return dict(getattr(config, "global_batch_info", None) or {})


@_active_tokens_only
def vanilla_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's "vanilla" policy loss on our per-token terms: PPO-clip, dual-clip, +-20 log-ratio clamp."""
    if config is None:
        raise ValueError("config (verl's ActorConfig) is required: it holds the clip ratios")
    low, high = _clip_bounds(config)
    dual_clip = config.get("clip_ratio_c", 3.0) if hasattr(config, "get") else getattr(config, "clip_ratio_c", 3.0)
    opts = GRPOOptions(
        loss_type="grpo",
        epsilon=low,
        epsilon_high=high,
        dual_clip=dual_clip,
        log_ratio_clamp=20.0,
        compute_entropy=False,
    )
    mask = response_mask.to(log_prob.dtype)
    terms = per_token_terms(log_prob, mask, advantages, old_log_prob, None, rollout_is_weights, opts)
    loss = aggregate(terms.per_token_loss, mask, loss_agg_mode, **_batch_info(config))
    with torch.no_grad():
        log_ratio = torch.clamp(log_prob - old_log_prob, -20.0, 20.0)
        ratio = torch.exp(log_ratio)
        clipped = (terms.is_low_clipped | terms.is_high_clipped).to(mask.dtype)
        plain = -advantages * ratio
        bounded = torch.maximum(plain, -advantages * torch.clamp(ratio, 1 - low, 1 + high))
        lower = ((bounded > -advantages * dual_clip) & (advantages < 0)).to(mask.dtype)
        metrics = {
            "actor/pg_clipfrac": verl_masked_mean(clipped, mask).item(),
            "actor/ppo_kl": verl_masked_mean(-log_ratio, mask).item(),
            "actor/pg_clipfrac_lower": verl_masked_mean(lower, mask).item(),
        }
    return loss, metrics


@_active_tokens_only
def gspo_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's "gspo": GSPO-token (sequence ratio as value, per-token gradient), PPO-clip, no dual-clip.

    verl caps the log-weight at 10 from above only; ours clamps it to [-10, 10]. The two differ
    only where a row's ratio is below e^-10 (4.5e-5).
    """
    if config is None:
        raise ValueError("config (verl's ActorConfig) is required: it holds the clip ratios")
    low, high = _clip_bounds(config)
    opts = GRPOOptions(
        loss_type="grpo",
        epsilon=low,
        epsilon_high=high,
        importance_sampling_level="sequence_token",
        log_ratio_clamp=10.0,
        compute_entropy=False,
    )
    mask = response_mask.to(log_prob.dtype)
    terms = per_token_terms(log_prob, mask, advantages, old_log_prob, None, rollout_is_weights, opts)
    loss = aggregate(terms.per_token_loss, mask, loss_agg_mode, **_batch_info(config))
    with torch.no_grad():
        clipped = (terms.is_low_clipped | terms.is_high_clipped).to(mask.dtype)
        metrics = {
            "actor/pg_clipfrac": verl_masked_mean(clipped, mask).item(),
            "actor/ppo_kl": verl_masked_mean(-(log_prob - old_log_prob), mask).item(),
            "actor/pg_clipfrac_lower": 0.0,
        }
    return loss, metrics


def _required(config) -> None:
    if config is None:
        raise ValueError("config (verl's ActorConfig) is required: it holds the clip ratios and the loss's settings")


def _setting(config, name: str, default):
    """``config.<name>`` (verl's ActorConfig, a dataclass with ``get``, or any object), ``default`` where unset."""
    value = config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)
    return default if value is None else value


def _loss_setting(config, name: str, default):
    """``config.policy_loss.<name>`` (verl's PolicyLossConfig), ``default`` where unset or None."""
    policy_loss = getattr(config, "policy_loss", None)
    value = None if policy_loss is None else getattr(policy_loss, name, None)
    return default if value is None else value


def _terms(opts: GRPOOptions, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights):
    """(the float mask, our per-token terms) of verl's inputs."""
    mask = response_mask.to(log_prob.dtype)
    return mask, per_token_terms(log_prob, mask, advantages, old_log_prob, None, rollout_is_weights, opts)


def _ppo_kl(log_prob, old_log_prob, mask, clamp: float | None = 20.0) -> float:
    """verl's ``actor/ppo_kl``: the masked mean of -(log pi - log pi_old), clamped where verl clamps it."""
    log_ratio = log_prob.detach() - old_log_prob
    if clamp is not None:
        log_ratio = torch.clamp(log_ratio, -clamp, clamp)
    return verl_masked_mean(-log_ratio, mask).item()


def _dppo(loss_type: str, verl_name: str, divergence: str):
    @_active_tokens_only
    def policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode: str = "token-mean",
        config=None,
        rollout_is_weights=None,
    ):
        _required(config)
        low, high = _clip_bounds(config)
        cap = _setting(config, "clip_ratio_c", 20.0)
        opts = GRPOOptions(
            loss_type=loss_type, epsilon=low, epsilon_high=high, delta=cap, log_ratio_clamp=20.0, compute_entropy=False
        )
        mask, terms = _terms(opts, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
        loss = aggregate(terms.per_token_loss, mask, loss_agg_mode, **_batch_info(config))
        with torch.no_grad():
            inside = (~terms.is_high_clipped).to(mask.dtype)
            ratio = torch.exp(torch.clamp(log_prob.detach() - old_log_prob, -20.0, 20.0))
            metrics = {
                "actor/pg_clipfrac": verl_masked_mean(1 - inside, mask).item(),
                "actor/ppo_kl": _ppo_kl(log_prob, old_log_prob, mask),
                "actor/pg_clipfrac_lower": verl_masked_mean((ratio > cap).to(mask.dtype) * inside, mask).item(),
            }
        return loss, metrics

    policy_loss.__name__ = policy_loss.__qualname__ = f"{verl_name}_policy_loss"
    policy_loss.__doc__ = (
        f"verl's {verl_name!r} (DPPO, binary {divergence} trust region) on our "
        "per-token terms: the thresholds clip_ratio_low / clip_ratio_high, the ratio capped at clip_ratio_c, +-20 "
        "log-ratio clamp."
    )
    return policy_loss


dppo_tv_policy_loss = _dppo("dppo_tv", "dppo_tv", "TV")
dppo_kl_policy_loss = _dppo("dppo_kl", "dppo_kl", "KL")


@_active_tokens_only
def sapo_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's "sapo": the soft gate 4 / tau sigmoid(tau (r - 1)) (tau_pos for A > 0, tau_neg else), +-20 log-ratio
    clamp, reduced as seq-mean-token-mean whatever ``loss_agg_mode`` says (as verl does)."""
    _required(config)
    opts = GRPOOptions(
        loss_type="sapo",
        sapo_temperature_pos=float(config.tau_pos),
        sapo_temperature_neg=float(config.tau_neg),
        log_ratio_clamp=20.0,
        compute_entropy=False,
    )
    mask, terms = _terms(opts, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    loss = aggregate(terms.per_token_loss, mask, "seq-mean-token-mean", **_batch_info(config))
    metrics = {
        "actor/pg_clipfrac": 0.0,
        "actor/ppo_kl": _ppo_kl(log_prob, old_log_prob, mask),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return loss, metrics


@_active_tokens_only
def gpg_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's "gpg": -A log pi (no ratio), no metrics."""
    _required(config)
    opts = GRPOOptions(loss_type="gpg", compute_entropy=False)
    mask, terms = _terms(opts, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    return aggregate(terms.per_token_loss, mask, loss_agg_mode, **_batch_info(config)), {}


@_active_tokens_only
def clip_cov_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's "clip_cov": PPO's clipped ratio (no log-ratio clamp), with policy_loss.clip_cov_ratio of the micro-batch's
    tokens left out, drawn (torch's default generator, as verl draws) among the unclipped ones whose advantage x
    log-prob covariance is in (clip_cov_lb, clip_cov_ub)."""
    _required(config)
    low, high = _clip_bounds(config)
    opts = GRPOOptions(
        loss_type="clip_cov",
        epsilon=low,
        epsilon_high=high,
        clip_cov_ratio=float(_loss_setting(config, "clip_cov_ratio", 0.0002)),
        clip_cov_lb=float(_loss_setting(config, "clip_cov_lb", 1.0)),
        clip_cov_ub=float(_loss_setting(config, "clip_cov_ub", 5.0)),
        covariance_selection="micro_batch",
        compute_entropy=False,
    )
    mask, terms = _terms(opts, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    loss = aggregate(terms.per_token_loss, mask, loss_agg_mode, **_batch_info(config))
    metrics = {
        "actor/pg_clipfrac": verl_masked_mean(terms.is_high_clipped.to(mask.dtype), mask).item(),
        "actor/ppo_kl": _ppo_kl(log_prob, old_log_prob, mask, clamp=None),
    }
    return loss, metrics


@_active_tokens_only
def kl_cov_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's "kl_cov": -A r (no clip, no clamp), plus policy_loss.ppo_kl_coef |log-ratio| on the
    policy_loss.kl_cov_ratio of the micro-batch's tokens with the largest advantage x log-prob covariance."""
    _required(config)
    opts = GRPOOptions(
        loss_type="kl_cov",
        kl_cov_ratio=float(_loss_setting(config, "kl_cov_ratio", 0.0002)),
        kl_cov_coef=float(_loss_setting(config, "ppo_kl_coef", 1.0)),
        covariance_selection="micro_batch",
        compute_entropy=False,
    )
    mask, terms = _terms(opts, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    loss = aggregate(terms.per_token_loss, mask, loss_agg_mode, **_batch_info(config))
    absolute = torch.abs(log_prob.detach() - old_log_prob)
    return loss, {"actor/ppo_kl": verl_masked_mean(absolute, mask).item()}


@_active_tokens_only
def geo_mean_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's "geo_mean" (GMPO): each row's -A exp(mean of its sign-clipped log-ratios), the plain mean over the
    rows whatever ``loss_agg_mode`` and the global batch info say (as verl does); the rollout weights enter as each
    row's geometric mean of them."""
    _required(config)
    low, high = _clip_bounds(config)
    opts = GRPOOptions(loss_type="gmpo", epsilon=low, epsilon_high=high, compute_entropy=False)
    mask, terms = _terms(opts, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    loss = terms.per_token_loss[:, 0].mean()  # one value a row, repeated over its positions
    metrics = {
        "actor/pg_clipfrac": verl_masked_mean(terms.is_high_clipped.to(mask.dtype), mask).item(),
        "actor/ppo_kl": _ppo_kl(log_prob, old_log_prob, mask, clamp=None),
        "actor/pg_clipfrac_lower": verl_masked_mean(terms.is_low_clipped.to(mask.dtype), mask).item(),
    }
    return loss, metrics


@_active_tokens_only
def dro_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's "dro": -(A log pi - policy_loss.dro_beta (log pi - log pi_old)^2 / 2)."""
    _required(config)
    opts = GRPOOptions(loss_type="dro", dro_beta=_loss_setting(config, "dro_beta", None), compute_entropy=False)
    mask, terms = _terms(opts, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    loss = aggregate(terms.per_token_loss, mask, loss_agg_mode, **_batch_info(config))
    return loss, {"actor/ppo_kl": _ppo_kl(log_prob, old_log_prob, mask, clamp=None)}


@_active_tokens_only
def cispo_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's "cispo": -sg(clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) A log pi, +-20 log-ratio clamp (TRL's
    cispo caps the ratio from above only: ``cispo_ratio_min`` is the lower bound)."""
    _required(config)
    low, high = _clip_bounds(config)
    opts = GRPOOptions(
        loss_type="cispo",
        epsilon_high=1 + high,
        cispo_ratio_min=1 - low,
        log_ratio_clamp=20.0,
        compute_entropy=False,
    )
    mask, terms = _terms(opts, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights)
    loss = aggregate(terms.per_token_loss, mask, loss_agg_mode, **_batch_info(config))
    with torch.no_grad():
        ratio = torch.exp(torch.clamp(log_prob.detach() - old_log_prob, -20.0, 20.0))
        moved = (ratio != torch.clamp(ratio, 1 - low, 1 + high)).to(mask.dtype)
    metrics = {
        "actor/pg_clipfrac": verl_masked_mean(moved, mask).item(),
        "actor/ppo_kl": _ppo_kl(log_prob, old_log_prob, mask),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return loss, metrics


@_active_tokens_only
def bypass_mode_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights=None,
):
    """verl's "bypass_mode" (old log-probs = the rollout's): the rollout correction's weights, rejection mask and
    metrics from verl's own ``compute_rollout_correction_and_rejection_mask`` (policy_loss.rollout_correction),
    then our loss: "ppo_clip" (verl's vanilla on the rejection mask, no weights) or "reinforce" (-w A log pi)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    _required(config)
    policy_loss = getattr(config, "policy_loss", None)
    correction = policy_loss.get("rollout_correction", None) if policy_loss is not None else None
    if correction is None:
        raise ValueError(
            "loss_mode 'bypass_mode' needs policy_loss.rollout_correction (verl's RolloutCorrectionConfig), got None"
        )
    with torch.no_grad():
        weights, effective_mask, correction_metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob,
            rollout_log_prob=old_log_prob,
            response_mask=response_mask,
            rollout_is=correction.get("rollout_is", None),
            rollout_is_threshold=correction.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=correction.get("rollout_is_batch_normalize", False),
            rollout_rs=correction.get("rollout_rs", None),
            rollout_rs_threshold=correction.get("rollout_rs_threshold", None),
        )
    loss_type = correction.get("loss_type", "ppo_clip")
    if loss_type == "reinforce":
        opts = GRPOOptions(loss_type="gpg", compute_entropy=False)
        is_weights = weights.batch["rollout_is_weights"] if weights else None
        mask, terms = _terms(opts, old_log_prob, log_prob, advantages, effective_mask, is_weights)
        loss = aggregate(terms.per_token_loss, mask, loss_agg_mode, **_batch_info(config))
        metrics = {"actor/ppo_kl": _ppo_kl(log_prob, old_log_prob, mask, clamp=None)}
    elif loss_type == "ppo_clip":  # the ratio to the rollout policy is the correction: no weights on top
        loss, metrics = vanilla_policy_loss(
            old_log_prob, log_prob, advantages, effective_mask, loss_agg_mode, config, None
        )
    else:
        raise ValueError(f"rollout_correction.loss_type must be 'reinforce' or 'ppo_clip', got {loss_type!r}")
    metrics.update(correction_metrics)
    return loss, metrics


# verl 0.9's policy-loss registry, mode by mode: register() adds each as "grpo_kernels_<mode>"
POLICY_LOSSES = {
    "vanilla": vanilla_policy_loss,
    "gspo": gspo_policy_loss,
    "cispo": cispo_policy_loss,
    "sapo": sapo_policy_loss,
    "gpg": gpg_policy_loss,
    "geo_mean": geo_mean_policy_loss,
    "clip_cov": clip_cov_policy_loss,
    "kl_cov": kl_cov_policy_loss,
    "dppo_tv": dppo_tv_policy_loss,
    "dppo_kl": dppo_kl_policy_loss,
    "dro": dro_policy_loss,
    "bypass_mode": bypass_mode_policy_loss,
}


def kl_loss(
    log_prob,
    ref_log_prob,
    response_mask,
    kl_penalty: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    **global_batch_info,
) -> torch.Tensor:
    """verl's actor KL loss: ``agg_loss(kl_penalty(logp, ref), mask)`` with verl's clamps (k3: +-20 in, +-10 out). A
    "+" suffix (``k3+``, ``low_var_kl+``, ``k1+``) is verl's straight-through form: the estimate's value with the k2
    estimator's gradient, (log pi - log pi_ref), which is the KL's own."""
    straight_through = kl_penalty.endswith("+")
    base = kl_penalty[:-1] if straight_through else kl_penalty
    if base not in VERL_KL:
        raise ValueError(
            f"kl_penalty must be one of {sorted(VERL_KL)} (each with an optional '+'), got {kl_penalty!r} ('abs' "
            "and 'full' are not implemented here)"
        )
    estimator = VERL_KL[base]
    clamps = dict(log_ratio_clamp=20.0, kl_clamp=10.0) if estimator == "k3" else {}
    if straight_through and estimator != "k2":  # k2's own gradient already: mse+ is mse
        estimator += "+"
    active = response_mask.bool()  # masked positions read as log-probs of 0 (a KL of 0), whatever they hold
    log_prob, ref_log_prob = _at_active(log_prob, active, 0.0), _at_active(ref_log_prob, active, 0.0)
    kl = kl_term(log_prob, ref_log_prob, GRPOOptions(kl_estimator=estimator, **clamps))
    return aggregate(kl, response_mask, loss_agg_mode, **global_batch_info)


def register() -> None:
    """Add ours to verl's policy-loss registry: "grpo_kernels_<mode>" for each of verl's modes (``POLICY_LOSSES``),
    and "grpo_kernels" (vanilla, the first name); and to its distillation registry, where verl has one (0.9):
    "grpo_kernels_forward_kl_topk" (``forward_kl_topk_loss``)."""
    from verl.trainer.ppo import core_algos

    core_algos.register_policy_loss("grpo_kernels")(vanilla_policy_loss)
    for mode, policy_loss in POLICY_LOSSES.items():
        core_algos.register_policy_loss(f"grpo_kernels_{mode}")(policy_loss)
    try:
        from verl.trainer.distillation import losses as distillation_losses
    except ImportError:  # a verl without on-policy distillation
        return
    if "grpo_kernels_forward_kl_topk" not in distillation_losses.DISTILLATION_LOSS_REGISTRY:
        settings = distillation_losses.DistillationLossSettings(names="grpo_kernels_forward_kl_topk", use_topk=True)
        distillation_losses.register_distillation_loss(settings)(forward_kl_topk_loss)


def patch_logprobs() -> None:
    """Make verl's log-prob and entropy functions our fused kernel, with their gradients, in every module
    that imported them by name (verl's engines read them when they are built, after ``external_lib`` is
    imported). Our log-probs and entropies are fp32 whatever the logits' dtype.

    - FSDP (whole vocabulary): ``logprobs_from_logits``, ``entropy_from_logits``,
      ``entropy_from_logits_with_chunking``;
    - Megatron (a tensor-parallel lm_head, each rank holding a vocabulary slice), where megatron-core
      is installed: ``vocab_parallel_log_probs_from_logits``, ``vocab_parallel_entropy`` and
      ``vocab_parallel_entropy_with_chunking`` become our vocabulary-parallel kernels over Megatron's
      tensor-parallel group (three all-reduces of O(tokens) values; no chunks needed, as no [N, V]
      fp32 temporary is made).
    """
    from verl.utils import torch_functional

    from ..loss import selective_log_softmax, token_entropy

    def logprobs_from_logits(logits, labels, inplace_backward=True):
        return selective_log_softmax(logits, labels)

    def entropy_from_logits(logits):
        return token_entropy(logits)

    def entropy_from_logits_with_chunking(logits, chunk_size: int = 2048):  # no chunks needed: no [N, V] temporary
        return token_entropy(logits)

    replace_everywhere(
        torch_functional,
        {
            "logprobs_from_logits": logprobs_from_logits,
            "entropy_from_logits": entropy_from_logits,
            "entropy_from_logits_with_chunking": entropy_from_logits_with_chunking,
        },
    )
    patch_fused_kernels()
    patch_distillation()
    try:
        from megatron.core import parallel_state
        from verl.utils.megatron import tensor_parallel
    except ImportError:  # no megatron-core: verl's Megatron backend cannot run either
        return

    def vocab_parallel_log_probs_from_logits(logits, labels):
        group = parallel_state.get_tensor_model_parallel_group()
        return selective_log_softmax(logits, labels, vocab_parallel_group=group)

    def vocab_parallel_entropy(vocab_parallel_logits):
        group = parallel_state.get_tensor_model_parallel_group()
        return token_entropy(vocab_parallel_logits, vocab_parallel_group=group)

    def vocab_parallel_entropy_with_chunking(vocab_parallel_logits, chunk_size: int = 2048):
        return vocab_parallel_entropy(vocab_parallel_logits)

    replace_everywhere(
        tensor_parallel,
        {
            "vocab_parallel_log_probs_from_logits": vocab_parallel_log_probs_from_logits,
            "vocab_parallel_entropy": vocab_parallel_entropy,
            "vocab_parallel_entropy_with_chunking": vocab_parallel_entropy_with_chunking,
        },
    )


class FusedLinearForPPO(torch.nn.Module):
    """verl's ``FusedLinearForPPO`` (its fused head for ``use_fused_kernels`` with the "torch" / "liger" backends) on
    our fused head op: the same constructor and ``forward(hidden_states, vocab_weights, input_ids, temperature)``
    -> (log-probs, entropy), fp32, differentiable in the hidden states and the weight, no [N, V] tensor kept."""

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        self.chunk_size, self.impl_backend = chunk_size, impl_backend

    def forward(self, hidden_states, vocab_weights, input_ids, temperature: float = 1.0):
        return _fused_head(hidden_states, vocab_weights, input_ids.long(), float(temperature))


def _fused_head(hidden, weight, ids, temperature: float, vocab_parallel_group=None, reduce_hidden_grad=True) -> tuple:
    """(log-probs, entropy) of verl's fused head on our op. A pass without a gradient (verl's ``compute_log_prob``:
    old log-probs) also computes each token's Σπ² from the same pass, attached to the log-probs as
    ``sum_pi_squared``, where ``prepare_model_outputs`` (``patch_fused_kernels``) takes it for verl's
    ``calculate_sum_pi_squared`` (which verl's own fused kernels refuse). The head's inputs ride along as
    ``fused_head_inputs``: verl's top-k distillation under ``use_fused_kernels`` takes the student's log-probs at
    the teacher's ids from them (``_fused_topk_distillation``)."""
    from ..loss import linear_selective_log_softmax_and_entropy, linear_token_logprobs

    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        logp, entropy = linear_selective_log_softmax_and_entropy(
            hidden,
            weight,
            ids,
            None,
            temperature,
            vocab_parallel_group=vocab_parallel_group,
            reduce_hidden_grad=reduce_hidden_grad,
        )
        logp.fused_head_inputs = (hidden, weight, temperature, vocab_parallel_group, reduce_hidden_grad)
        return logp, entropy
    logp, entropy, sum_pi_squared = linear_token_logprobs(
        hidden,
        weight,
        ids,
        None,
        temperature,
        return_entropy=True,
        vocab_parallel_group=vocab_parallel_group,
        return_sum_pi_squared=True,
    )
    logp.sum_pi_squared = sum_pi_squared
    logp.fused_head_inputs = (hidden, weight, temperature, vocab_parallel_group, reduce_hidden_grad)
    return logp, entropy


def linear_cross_entropy(
    hidden, weight, labels, temperature: float = 1.0, reduction: str = "none", dist_process_group=None
):
    """verl's ``linear_cross_entropy`` (its fused head for ``use_fused_kernels`` with the "triton" backend, and the
    Megatron engine's over its tensor-parallel group: ``weight`` this rank's vocabulary shard) on our fused head op:
    (log-probs, entropy) per token, flat [N] as verl returns them, fp32, differentiable.

    Over a tensor-parallel group, d hidden is the unsharded model's in both of Megatron's layouts. With sequence
    parallelism verl gathers the hidden states with ``gather_from_sequence_parallel_region``, whose backward sums
    d hidden over the group (a reduce-scatter): ``patch_fused_kernels`` marks that gather's output, and on it this
    op returns this rank's share (``reduce_hidden_grad=False``), as verl's own kernel does. Without sequence
    parallelism the hidden states reach the head unchanged on every rank and nothing sums d hidden (Megatron's
    ``ColumnParallelLinear`` would, through ``copy_to_tensor_model_parallel_region``; verl's fused path bypasses it
    and its own kernel returns the share alone there): this op all-reduces it."""
    if reduction != "none":
        raise ValueError(f"linear_cross_entropy: reduction must be 'none' (per-token values), got {reduction!r}")
    caller_sums = dist_process_group is not None and getattr(hidden, HIDDEN_GRAD_SUMMED_BY_CALLER, False)
    return _fused_head(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1).long(),
        float(temperature),
        vocab_parallel_group=dist_process_group,
        reduce_hidden_grad=not caller_sums,
    )


# set on a tensor whose producer's backward sums its gradient over the tensor-parallel group (``_summing_gather``)
HIDDEN_GRAD_SUMMED_BY_CALLER = "grpo_kernels_hidden_grad_summed_by_caller"


def _summing_gather(gather):
    """Megatron's ``gather_from_sequence_parallel_region`` as verl's fused postprocess calls it, its output marked
    where its backward reduce-scatters (``tensor_parallel_output_grad``, the default): the sum of d hidden over the
    group is then the mapping's, and our head returns its share (``linear_cross_entropy``)."""
    import functools

    @functools.wraps(gather)
    def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, *args, **kwargs):
        output = gather(input_, tensor_parallel_output_grad, *args, **kwargs)
        if tensor_parallel_output_grad:
            setattr(output, HIDDEN_GRAD_SUMMED_BY_CALLER, True)
        return output

    gather_from_sequence_parallel_region.marks_summed_grad = True
    return gather_from_sequence_parallel_region


def patch_fused_kernels() -> None:
    """verl's fused-kernel path (``use_fused_kernels=True``: log-probs and entropy straight from the hidden states
    and the head weight, the logits never made) on our fused head op, in every module that holds verl's by name:
    ``FusedLinearForPPO`` and ``linear_cross_entropy`` (``patch_logprobs`` calls this)."""
    from verl.utils.experimental import torch_functional as experimental
    from verl.utils.kernel import linear_cross_entropy as fused_module

    replace_everywhere(experimental, {"FusedLinearForPPO": FusedLinearForPPO})
    replace_everywhere(fused_module, {"linear_cross_entropy": linear_cross_entropy})
    try:  # verl's Megatron fused postprocess: its sequence-parallel gather sums d hidden (``linear_cross_entropy``)
        from verl.models.mcore import model_forward_fused
    except ImportError:  # no megatron-core: verl's Megatron backend cannot run either
        pass
    else:
        gather = model_forward_fused.gather_from_sequence_parallel_region
        if not getattr(gather, "marks_summed_grad", False):
            model_forward_fused.gather_from_sequence_parallel_region = _summing_gather(gather)
    try:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    except ImportError:  # an older verl, or its FSDP engine's dependencies missing: nothing there to serve
        return
    if not getattr(FSDPEngineWithLMHead.prepare_model_outputs, "serves_fused_extras", False):
        FSDPEngineWithLMHead.prepare_model_outputs = _with_fused_extras(FSDPEngineWithLMHead.prepare_model_outputs)


def _with_fused_extras(prepare_model_outputs):
    """verl's FSDP engine's ``prepare_model_outputs`` serving, under ``use_fused_kernels``, what verl's own fused
    kernels do not give there: ``calculate_sum_pi_squared`` (verl raises ``NotImplementedError``; Σπ² comes from our
    fused head's no-grad pass) and the top-k distillation (``distillation_use_topk``: verl's FSDP engine reads it
    from a ``fused_linear_aux`` only veomni's kernels make, and its dense branch not at all; ours from the hidden
    states the head read, ``_fused_topk_distillation``). Each is gathered, unpadded and made a nested tensor as verl
    does with the log-probs of the same call."""
    import functools

    from verl.utils import tensordict_utils as tu

    @functools.wraps(prepare_model_outputs)
    def prepare(self, output, output_args, micro_batch, logits_processor_func):
        def flag(key):
            return tu.get_non_tensor_data(data=micro_batch, key=key, default=False)

        fused = flag("use_fused_kernels")
        squares_wanted = fused and flag("calculate_sum_pi_squared")
        distillation_wanted = fused and flag("distillation_use_topk") and "teacher_ids" in micro_batch.keys()
        if not (squares_wanted or distillation_wanted):
            return prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func)
        head = output.log_probs
        squares = getattr(head, "sum_pi_squared", None)
        if squares_wanted and squares is None:
            raise NotImplementedError(
                "calculate_sum_pi_squared=True with use_fused_kernels=True: grpo_kernels computes Σπ² in its fused "
                "head's passes without a gradient (verl's compute_log_prob); this pass had a gradient"
            )
        if distillation_wanted and getattr(head, "fused_head_inputs", None) is None:
            raise NotImplementedError(
                "top-k distillation with use_fused_kernels=True: the model's head is not grpo_kernels' fused head "
                "(call grpo_kernels.integration.verl.patch_logprobs() before verl patches the model's forward)"
            )
        remove_padding = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
        distillation = {}
        if distillation_wanted:
            config = _distillation_config(logits_processor_func)
            distillation = _fused_topk_distillation(head.fused_head_inputs, micro_batch, config, remove_padding)
        # verl's own step skips what we serve (it would refuse Σπ², or find no distillation outputs), then ours
        served = [key for key, wanted in (("calculate_sum_pi_squared", squares_wanted),
                                          ("distillation_use_topk", distillation_wanted)) if wanted]  # fmt: skip
        tu.assign_non_tensor(micro_batch, **dict.fromkeys(served, False))
        try:
            model_output = prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func)
        finally:
            tu.assign_non_tensor(micro_batch, **dict.fromkeys(served, True))
        cu_seqlens = micro_batch["input_ids"].offsets()
        extras = dict(distillation)
        if squares_wanted:
            extras["sum_pi_squared"] = squares
        for name, values in extras.items():
            if remove_padding:
                values = self._gather_and_unpad_packed(values.reshape(-1), output_args["pad_size"])
            else:  # dense (bsz, seqlen): each sequence's valid positions, as verl takes the log-probs
                columns = torch.arange(values.shape[1], device=values.device)
                values = values[columns < cu_seqlens.diff().unsqueeze(1)]
            model_output[name] = torch.nested.nested_tensor_from_jagged(values, cu_seqlens)
        return model_output

    prepare.serves_fused_extras = True
    return prepare


def _fused_topk_distillation(head_inputs, micro_batch, config, packed: bool) -> dict:
    """verl's FSDP top-k distillation outputs per position (shaped as the fused head's log-probs: [1, nnz / sp]
    packed, [bsz, seqlen] dense), from the hidden states and the head weight the fused head read
    (``topk_logprobs(hidden, ids, weight=...)``: no [N, V] tensor) and the teacher's top-k in ``micro_batch``
    ("teacher_ids", "teacher_logprobs", nested as verl holds them), clamped at ``config``'s; the same per-token math as
    ``compute_forward_kl_topk`` but the overlap metrics, which need the student's own top-k over the vocabulary (as
    veomni's fused path, verl's other, gives none)."""
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

    from ..distillation import topk_logprobs

    hidden, weight, temperature, group, reduce_hidden_grad = head_inputs
    ids, logps = micro_batch["teacher_ids"], micro_batch["teacher_logprobs"]
    if packed:  # one row of every sequence's positions
        ids, logps = ids.values().unsqueeze(0), logps.values().unsqueeze(0)
        if get_ulysses_sequence_parallel_world_size() > 1:
            ids, logps = slice_input_tensor(ids, dim=1, padding=True), slice_input_tensor(logps, dim=1, padding=True)
    else:  # dense [bsz, seqlen]: each sequence padded to the model input's length (the padding's ids read as 0)
        rows = ids.size(0)
        shape = (rows, hidden.numel() // hidden.shape[-1] // rows, ids.size(-1))
        ids, logps = ids.to_padded_tensor(0, output_size=shape), logps.to_padded_tensor(0.0, output_size=shape)
    hidden = hidden.reshape(*ids.shape[:2], hidden.shape[-1])
    clamp = config.distillation_loss.log_prob_min_clamp
    student = topk_logprobs(
        hidden,
        ids.long(),
        temperature,
        weight=weight,
        vocab_parallel_group=group,
        reduce_hidden_grad=reduce_hidden_grad,
        check_ids=False,
    )
    return _forward_kl_topk_outputs(student, logps.float(), clamp)


def _distillation_config(loss_function):
    """The ``distillation_config`` verl's distillation actor binds into its loss (``functools.partial(
    distillation_ppo_loss, config=..., distillation_config=...)``, which the engine passes as the logits processor)."""
    config = getattr(loss_function, "keywords", {}).get("distillation_config")
    if config is None:
        raise ValueError(
            "top-k distillation with use_fused_kernels=True: the engine's loss function carries no "
            "distillation_config (verl binds one with functools.partial(distillation_ppo_loss, ...)), got "
            f"{loss_function!r}"
        )
    return config


# ---- verl's on-policy distillation (``verl/trainer/distillation``): the top-k forward KL on our pass -----------------


def compute_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format: str):
    """verl's FSDP ``compute_forward_kl_topk`` (its signature and outputs, per token: the clamped sum
    p (log p - log q), the student's and the teacher's top-k mass, the overlap count and its token advantage), with
    the student's log-probs at the teacher's ids from our pass (``grpo_kernels.distillation.topk_logprobs``): no
    [N, V] log-softmax (verl's default holds one; its chunked path holds the logits' fp32 chunks and an [N, V]
    gradient), the backward's K ids' terms fused. ``student_logits`` [bsz, seqlen / sp, V], already divided by the
    temperature (verl's engine divides them); the teacher's top-k as nested tensors ("thd")."""
    from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size, slice_input_tensor

    from ..distillation import topk_logprobs

    if not (teacher_topk_log_probs.is_nested and teacher_topk_ids.is_nested):
        raise ValueError("teacher_topk_log_probs and teacher_topk_ids must be nested tensors, as verl passes them")
    logps = teacher_topk_log_probs.values().unsqueeze(0)
    ids = teacher_topk_ids.values().unsqueeze(0)
    if get_ulysses_sequence_parallel_world_size() > 1:
        logps, ids = slice_input_tensor(logps, dim=1), slice_input_tensor(ids, dim=1)
    if not logps.shape[:2] == ids.shape[:2] == student_logits.shape[:2]:
        raise ValueError(
            f"the teacher's top-k {tuple(ids.shape)} does not match the student's logits {tuple(student_logits.shape)}"
        )
    student = topk_logprobs(student_logits, ids.long())
    with torch.no_grad():  # the student's own top-k (the cap and temperature keep the logits' order)
        student_ids = torch.topk(student_logits, k=ids.shape[-1], dim=-1).indices
    overlap = (ids.unsqueeze(-1) == student_ids.unsqueeze(-2)).any(-1)
    return _forward_kl_topk_outputs(student, logps.float(), config.distillation_loss.log_prob_min_clamp, overlap)


def _forward_kl_topk_outputs(student, teacher, clamp, overlap=None) -> dict:
    """verl's per-token top-k outputs from the student's and the teacher's log-probs at the teacher's ids [.., K]:
    the sum p (log p - log q) (both clamped below at ``clamp``), both top-k masses and, with ``overlap`` (which of
    the teacher's ids are among the student's own top-k), the overlap count and its token advantage."""
    student_mass, teacher_mass = student.exp().sum(-1), teacher.exp().sum(-1)
    log_q, log_p = student, teacher
    if clamp is not None:
        log_q, log_p = log_q.clamp_min(clamp), log_p.clamp_min(clamp)
    token_kl = log_p.exp() * (log_p - log_q)
    out = {"distillation_losses": token_kl.sum(-1), "student_mass": student_mass, "teacher_mass": teacher_mass}
    if overlap is not None:
        count = overlap.sum(-1)
        out["overlap_count"] = count
        out["overlap_token_advantage"] = torch.where(count > 0, (-token_kl * overlap).sum(-1) / count.clamp_min(1), 0.0)
    return out


def patch_distillation() -> None:
    """verl's FSDP top-k distillation logits processor (``verl.trainer.distillation.fsdp.losses.
    compute_forward_kl_topk``, which ``distillation_ppo_loss`` calls for "forward_kl_topk" and ours) on our pass,
    where verl has on-policy distillation (``patch_logprobs`` calls this)."""
    try:
        from verl.trainer.distillation.fsdp import losses as fsdp_losses
    except ImportError:
        return
    replace_everywhere(fsdp_losses, {"compute_forward_kl_topk": compute_forward_kl_topk})


def forward_kl_topk_loss(config, distillation_config, model_output, data) -> tuple:
    """verl's registered ``forward_kl_topk`` (the per-token losses its logits processor wrote, clamped at 0; the
    masses' mean, min and max and the overlap ratio and token advantage over the response tokens), under our name
    "grpo_kernels_forward_kl_topk": verl's distillation actor reaches it through its registry (``register``)."""
    from verl.utils.metric import AggregationType, Metric
    from verl.workers.utils.padding import no_padding_2_padding

    padded = {
        name: no_padding_2_padding(model_output[name], data)
        for name in ("distillation_losses", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage")
        if model_output.get(name) is not None
    }
    response = data["response_mask"]
    active = response.bool().to_padded_tensor(False) if response.is_nested else response.bool()
    metrics = {}
    if "overlap_count" in padded and "overlap_token_advantage" in padded:
        k = distillation_config.distillation_loss.topk
        metrics["distillation/overlap_ratio"] = (padded["overlap_count"][active].float().mean() / k).item()
        with_overlap = active & (padded["overlap_count"] > 0)
        advantage = padded["overlap_token_advantage"][with_overlap]
        metrics["distillation/overlap_token_advantage"] = advantage.mean().item() if with_overlap.any() else 0.0
    for name in ("student_mass", "teacher_mass"):
        values = padded[name][active]
        metrics[f"distillation/{name}"] = values.mean().item()
        metrics[f"distillation/{name}_min"] = Metric(AggregationType.MIN, values.min())
        metrics[f"distillation/{name}_max"] = Metric(AggregationType.MAX, values.max())
    return padded["distillation_losses"].clamp_min(0.0), metrics


# the arguments' descriptions appended to the docstrings (the API reference's; argument_docs.py)
document_public(globals(), ["kl_loss", "compute_forward_kl_topk"], ADAPTER_ARGUMENTS)
