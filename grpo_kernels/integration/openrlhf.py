"""OpenRLHF drop-in: the actor's loss and log-probs on this package's code, OpenRLHF 0.11's numbers.

OpenRLHF's PPO actor (``openrlhf/trainer/ray/ppo_actor.py``) computes the action log-probs and entropy in
``Actor.forward`` from the logits, then its loss as::

    actor_loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = PolicyLoss(...)(log_probs, old, advantages, ...)
    kl_loss = aggregate_loss(compute_approx_kl(log_probs, base, old, estimator, unbiased_gradient), mask, ...)
    loss = actor_loss + kl_loss * kl_ctl

This module has the same three names with the same signatures and return values, computed with this
package's per-token terms (``objective.per_token_terms``, ``objective.kl_term``):

- ``PolicyLoss``: ``ppo`` / ``gspo``, clip-higher (``clip_eps_low`` / ``clip_eps_high``), dual-clip, the
  ``token-mean`` (``token_level_loss=True``) and ``seq-mean-token-mean`` aggregations with ``dp_size``,
  ``batch_num_tokens`` and ``global_batch_size``, and the rollout corrections (``is_correction_level`` token /
  seq, ``is_correction_mode`` mask / clip, ``is_correction_gating`` ratio / binary_kl / tv, thresholds);
- ``compute_approx_kl``: k1 / k2 / k3 with OpenRLHF's clamps, and ``unbiased_gradient``;
- ``aggregate_loss``: OpenRLHF's reduction (the KL loss is always a token mean, whatever the policy's mode).

``patch_actor()`` makes ``openrlhf.models.actor``'s ``log_probs_from_logits`` and ``compute_entropy`` this
package's fused kernels (``selective_log_softmax``, ``token_entropy``); ``use_in_openrlhf()`` also puts the
three loss names above where OpenRLHF's actor looks them up. Importing this module needs neither OpenRLHF nor
DeepSpeed; the two patch functions need OpenRLHF importable. See ``grpo_kernels/integration/README.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..argument_docs import ADAPTER_ARGUMENTS, document_public
from ..conventions import openrlhf_aggregate_loss, openrlhf_masked_mean
from ..objective import kl_term, per_token_terms
from ..options import GRPOOptions
from ..rollout_correction import OPENRLHF_GATINGS, OPENRLHF_LEVELS, OPENRLHF_MODES, OpenRLHFCorrection
from ..validation import check_choice
from . import replace_everywhere

POLICY_LOSS_TYPES = ("ppo", "gspo")
IS_CORRECTION_LEVELS = ("off", *OPENRLHF_LEVELS)
IS_CORRECTION_MODES = OPENRLHF_MODES
IS_CORRECTION_GATINGS = OPENRLHF_GATINGS
KL_ESTIMATORS = ("k1", "k2", "k3")
# OpenRLHF's bounds: the PPO log-ratio before exp, every KL estimate, the unbiased gradient's importance weight
LOG_RATIO_CLAMP = 20.0
KL_CLAMP = 10.0
KL_IS_WEIGHT_CLIP = 10.0
# OpenRLHF's k3 clamps log(pi / pi_ref) at -10 from below only; any symmetric bound >= 11 gives the same values
# and gradients, since every value beyond it is clamped to KL_CLAMP (zero gradient) either way
K3_LOG_RATIO_CLAMP = 20.0
# OpenRLHF's GSPO ratio is unclamped: exp of a row's mean log-ratio, inf past about 88.7 in fp32, where its loss is
# NaN (the inf times the padding's zeros) and its gradient NaN (exp's backward, 0 x inf) even without padding. Ours
# bounds the mean log-ratio at 88 (e^88 = 1.65e38, fp32's largest power of e): OpenRLHF's numbers wherever they are
# finite (a row that far off clips: the clipped term and the dual-clip bound are exact, their gradient 0), and a
# finite loss and gradient where OpenRLHF's are NaN (without dual-clip a negative advantage's term is then
# 1.65e38 |A| for inf)
GSPO_LOG_RATIO_CLAMP = 88.0


# OpenRLHF's masked_mean and aggregate_loss, under its names (``conventions``: one definition each)
masked_mean = openrlhf_masked_mean
aggregate_loss = openrlhf_aggregate_loss


class PolicyLoss(nn.Module):
    """OpenRLHF's ``PolicyLoss`` (same constructor and ``forward``, same five results) on this package's
    per-token terms."""

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float | None = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold: Sequence[float] = (0.5, 5.0),
    ) -> None:
        super().__init__()
        check_choice("policy_loss_type", policy_loss_type, POLICY_LOSS_TYPES)
        check_choice("is_correction_level", is_correction_level, IS_CORRECTION_LEVELS)
        check_choice("is_correction_mode", is_correction_mode, IS_CORRECTION_MODES)
        check_choice("is_correction_gating", is_correction_gating, IS_CORRECTION_GATINGS)
        # the correction's options, checked and computed in the core (rollout_correction.OpenRLHFCorrection), where
        # a GRPOLoss call takes them too
        self.correction = (
            None
            if is_correction_level == "off"
            else OpenRLHFCorrection(
                is_correction_level, is_correction_mode, is_correction_gating, tuple(is_correction_threshold)
            )
        )
        self.clip_eps_low, self.clip_eps_high, self.dual_clip = clip_eps_low, clip_eps_high, dual_clip
        self.policy_loss_type = policy_loss_type
        self.token_level_loss = token_level_loss and policy_loss_type != "gspo"  # GSPO: the per-sample mean
        self.is_correction_level, self.is_correction_mode = is_correction_level, is_correction_mode
        self.is_correction_gating, self.is_correction_threshold = is_correction_gating, tuple(is_correction_threshold)
        gspo = policy_loss_type == "gspo"
        # dual_clip > 1 is checked by GRPOOptions; OpenRLHF's GSPO ratio is unclamped: ours within exp's range
        self.options = GRPOOptions(
            epsilon=clip_eps_low,
            epsilon_high=clip_eps_high,
            dual_clip=dual_clip,
            importance_sampling_level="sequence" if gspo else "token",
            log_ratio_clamp=GSPO_LOG_RATIO_CLAMP if gspo else LOG_RATIO_CLAMP,
            compute_entropy=False,
        )

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: torch.Tensor | None = None,
        rollout_log_probs: torch.Tensor | None = None,
        dp_size: int = 1,
        batch_num_tokens=None,
        global_batch_size=None,
    ):
        """(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio), as OpenRLHF's: the last two None without a
        rollout correction. In fp32 whatever the inputs' dtype (the gradient reaches 16-bit log-probs through the
        cast): OpenRLHF's float mask promotes its sums to fp32, and a 16-bit mask's row counts would make an empty
        row's mean NaN."""
        if action_mask is None:
            action_mask = torch.ones_like(log_probs)
        log_probs, old_log_probs, advantages = log_probs.float(), old_log_probs.float(), advantages.float()
        rollout_log_probs = None if rollout_log_probs is None else rollout_log_probs.float()
        mask = action_mask.float()
        correcting = self.correction is not None
        if correcting and rollout_log_probs is None:
            raise ValueError(f"is_correction_level={self.is_correction_level!r} needs rollout_log_probs, got None")
        gspo = self.policy_loss_type == "gspo"
        # GSPO with a correction takes its ratio against the rollout policy instead of weighting the term
        old = rollout_log_probs if gspo and correcting else old_log_probs
        weight = vllm_kl = is_filter_ratio = None
        if correcting and not gspo:
            correction = self.correction.compute(old_log_probs.detach(), rollout_log_probs.detach(), mask)
            weight = correction.weights
            is_filter_ratio, vllm_kl = correction.metrics["is_filter_ratio"], correction.metrics["vllm_kl"]
        terms = per_token_terms(log_probs, mask, advantages, old.detach(), None, weight, self.options)
        loss = aggregate_loss(
            terms.per_token_loss, mask, self.token_level_loss, dp_size, batch_num_tokens, global_batch_size
        )
        with torch.no_grad():
            clip_ratio = masked_mean(self._clipped(log_probs, old, mask, advantages).float(), mask)
            ppo_kl = masked_mean(-(log_probs - old_log_probs), mask)
        return loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio

    def _clipped(self, log_probs, old, mask, advantages) -> torch.Tensor:
        """OpenRLHF's clip flag: the clipped surrogate below the plain one (``surr2 < surr1``)."""
        log_ratio = log_probs - old
        if self.policy_loss_type == "gspo":
            log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
            ratio = log_ratio.clamp(max=GSPO_LOG_RATIO_CLAMP).exp() * mask
        else:
            ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        plain = ratio * advantages
        return ratio.clamp(1 - self.clip_eps_low, 1 + self.clip_eps_high) * advantages < plain


def compute_approx_kl(
    log_probs: torch.Tensor,
    log_probs_base: torch.Tensor,
    log_probs_old: torch.Tensor | None = None,
    kl_estimator: str = "k1",
    unbiased_gradient: bool = False,
) -> torch.Tensor:
    """OpenRLHF's ``compute_approx_kl`` [B, T]: the k1 / k2 / k3 estimate of KL(pi || pi_ref), clamped to +-10 (k3
    also bounds its log-ratio first); with ``unbiased_gradient`` the estimate's value with the reverse KL's
    importance-weighted gradient, w k1 d log pi, w = pi / pi_old clamped at 10 and detached."""
    check_choice("kl_estimator", kl_estimator, KL_ESTIMATORS)
    lp, ref = log_probs.float(), log_probs_base.float()
    clamps = dict(log_ratio_clamp=K3_LOG_RATIO_CLAMP) if kl_estimator == "k3" else {}
    value = kl_term(lp, ref, GRPOOptions(kl_estimator=kl_estimator, kl_clamp=KL_CLAMP, **clamps))
    if not unbiased_gradient:
        return value
    w = 1.0 if log_probs_old is None else (lp - log_probs_old.float()).exp().clamp(max=KL_IS_WEIGHT_CLIP).detach()
    surrogate = w * (lp - ref) ** 2 / 2.0  # its gradient: w (lp - ref) d lp, the score-function form
    return value.detach() + surrogate - surrogate.detach()


def patch_actor() -> None:
    """Make OpenRLHF's ``log_probs_from_logits`` and ``compute_entropy`` our fused kernels wherever they were
    imported by name (``openrlhf.models.actor`` reads them in ``Actor.forward``): fp32 log-probs and entropy,
    no [N, V] log-softmax; the gradients (the entropy's too, for ``--actor.entropy_coef``) from the same
    backward formula. ``Actor.forward`` still casts the logits to fp32 and divides them by the temperature
    before calling them, as OpenRLHF does."""
    from openrlhf.models import utils

    from ..loss import selective_log_softmax, token_entropy

    def log_probs_from_logits(logits, labels, temperature: float = 1.0):
        return selective_log_softmax(logits, labels, temperature=temperature)

    def compute_entropy(logits):
        return token_entropy(logits)

    replace_everywhere(utils, {"log_probs_from_logits": log_probs_from_logits, "compute_entropy": compute_entropy})


def use_in_openrlhf() -> None:
    """``patch_actor()``, and OpenRLHF's ``PolicyLoss``, ``compute_approx_kl`` and ``aggregate_loss`` replaced by
    this module's wherever they were imported by name (``openrlhf.trainer.ray.ppo_actor`` among them): the one
    call a user adds before OpenRLHF builds its actor."""
    from openrlhf.models import loss, utils

    patch_actor()
    replace_everywhere(loss, {"PolicyLoss": PolicyLoss, "aggregate_loss": aggregate_loss})
    replace_everywhere(utils, {"compute_approx_kl": compute_approx_kl})


# ---- Every Ray worker --------------------------------------------------------------------------------------------
#
# OpenRLHF's actors (PolicyModelActor, ...) are Ray actors: each runs in a worker process of its own, which imports
# OpenRLHF anew, so a ``use_in_openrlhf()`` in the launcher never reaches them. Ray runs a job's
# ``worker_process_setup_hook`` in every worker it starts, before the worker's first task or actor.

RAY_SETUP_HOOK = "grpo_kernels.integration.openrlhf.setup_ray_worker"
# set in a worker once the hook ran (what a process can ask to know it trains on this package's loss)
PATCHED_ENV = "GRPO_KERNELS_IN_OPENRLHF"
# OpenRLHF's own runtime_env (openrlhf.cli.train_ppo_ray.train), which it passes to ray.init only when Ray is not
# initialized yet: what the environment sets wins, as there
OPENRLHF_ENV_VARS = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}


def setup_ray_worker() -> None:
    """Ray's ``worker_process_setup_hook`` (``RAY_SETUP_HOOK``): ``use_in_openrlhf()`` in the worker process, and
    ``PATCHED_ENV`` set. An error (OpenRLHF not importable in the worker) stops the worker, visibly, rather than
    leave it training on OpenRLHF's own loss."""
    import os

    use_in_openrlhf()
    os.environ[PATCHED_ENV] = "1"


def ray_runtime_env(runtime_env: dict | None = None) -> dict:
    """The ``runtime_env`` to start Ray with (``ray.init(runtime_env=...)``, or ``ray job submit --runtime-env-json``)
    so that every worker of the job runs OpenRLHF's actor on this package's loss: ``runtime_env`` (yours, if any)
    with ``worker_process_setup_hook`` set to ``RAY_SETUP_HOOK`` and OpenRLHF's own ``env_vars`` where yours do not
    set them (OpenRLHF's launcher skips its own ``ray.init`` once Ray is running). Another setup hook is refused:
    Ray runs one."""
    import os

    env = dict(runtime_env or {})
    hook = env.get("worker_process_setup_hook")
    if hook is not None and hook != RAY_SETUP_HOOK:
        raise ValueError(
            f"runtime_env already has worker_process_setup_hook={hook!r}: Ray runs one hook a job; call "
            f"{RAY_SETUP_HOOK}() from yours instead"
        )
    env["worker_process_setup_hook"] = RAY_SETUP_HOOK
    env["env_vars"] = {**{k: os.environ.get(k, v) for k, v in OPENRLHF_ENV_VARS.items()}, **env.get("env_vars", {})}
    return env


# the arguments' descriptions appended to the docstrings (the API reference's; argument_docs.py)
document_public(globals(), ["PolicyLoss", "compute_approx_kl", "ray_runtime_env"], ADAPTER_ARGUMENTS)
