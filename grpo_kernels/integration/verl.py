"""verl drop-in: policy losses registered in verl's registry, and verl's log-probs on our kernel.

verl's actor computes per-token log-probs from the logits (``logprobs_from_logits``), then
calls the policy loss named by ``actor_rollout_ref.actor.policy_loss.loss_mode`` on those
log-probs. Both halves can be ours:

- ``register()`` adds two policy losses to verl's registry, computed with this package's
  per-token terms and reproducing verl 0.9's own numbers (values and gradients):

  - ``"grpo_kernels"``: verl's "vanilla" PPO-clip with dual-clip (c = ``clip_ratio_c``, 3 by
    default) and the +-20 log-ratio clamp;
  - ``"grpo_kernels_gspo"``: verl's "gspo" (sequence-level ratio with verl's per-token
    stop-gradient form, log-ratio capped at 10, no dual-clip);

  both with every ``loss_agg_mode`` (token-mean, token-sum, seq-mean-token-sum,
  seq-mean-token-mean, seq-mean-token-sum-norm) and the rollout correction weights.
- ``patch_logprobs()`` replaces verl's ``logprobs_from_logits`` and entropy functions with our fused
  kernel (``selective_log_softmax``, ``token_entropy``): no fp32 [N, V] log-softmax, the gradient in
  the logits' dtype; with megatron-core installed, also the Megatron backend's vocabulary-parallel
  ones (``vocab_parallel_log_probs_from_logits``, ``vocab_parallel_entropy``), over Megatron's
  tensor-parallel group.
- ``kl_loss(...)`` is verl's KL loss (``kl_penalty`` + ``agg_loss``) on our estimators.

Turning it on in a verl run: put ``grpo_kernels.integration.enable`` in verl's
``external_lib`` setting (importing that module calls ``register()`` and ``patch_logprobs()``),
and set ``actor_rollout_ref.actor.policy_loss.loss_mode=grpo_kernels`` (or
``grpo_kernels_gspo``). See ``grpo_kernels/integration/README.md``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ..objective import kl_term, per_token_terms
from ..options import GRPOOptions
from . import replace_everywhere

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
VERL_KL = {"low_var_kl": "k3", "k3": "k3", "kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2"}


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / (mask.sum() + 1e-8)  # verl_F.masked_mean's convention


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1,
              batch_num_tokens: Optional[Any] = None, global_batch_size: Optional[Any] = None,
              loss_scale_factor: Optional[Any] = None) -> torch.Tensor:
    """verl's ``agg_loss``: the loss is invariant to the data-parallel split (its ``global_batch_info``)."""
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {list(AGG_MODES)}, got {loss_agg_mode!r}")
    mask = mask.to(loss_mat.dtype)
    if loss_agg_mode in ("token-mean", "token-sum"):
        if loss_agg_mode == "token-sum":
            return (loss_mat * mask).sum() * dp_size
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError("token-mean with dp_size > 1 needs the global batch_num_tokens")
            batch_num_tokens = mask.sum()
        return (loss_mat * mask).sum() / batch_num_tokens * dp_size
    tokens = mask.sum(-1)
    row_loss = (loss_mat * mask).sum(-1)
    if loss_agg_mode == "seq-mean-token-mean":
        row_loss = row_loss / (tokens + 1e-8)
    non_empty = (tokens > 0).to(loss_mat.dtype)  # verl leaves fully masked rows out of the mean
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError(f"{loss_agg_mode} with dp_size > 1 needs the global_batch_size")
        global_batch_size = non_empty.sum()
    loss = (row_loss * non_empty).sum() / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


def _clip_bounds(config) -> tuple:
    clip = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else clip
    high = config.clip_ratio_high if config.clip_ratio_high is not None else clip
    return low, high


def _batch_info(config) -> Dict[str, Any]:
    return dict(getattr(config, "global_batch_info", None) or {})


def vanilla_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
                        config=None, rollout_is_weights=None):
    """verl's "vanilla" policy loss on our per-token terms: PPO-clip, dual-clip, +-20 log-ratio clamp."""
    if config is None:
        raise ValueError("config (verl's ActorConfig) is required: it holds the clip ratios")
    low, high = _clip_bounds(config)
    dual_clip = config.get("clip_ratio_c", 3.0) if hasattr(config, "get") else getattr(config, "clip_ratio_c", 3.0)
    opts = GRPOOptions(loss_type="grpo", epsilon=low, epsilon_high=high, dual_clip=dual_clip, log_ratio_clamp=20.0,
                       compute_entropy=False)
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
        metrics = {"actor/pg_clipfrac": _masked_mean(clipped, mask).item(),
                   "actor/ppo_kl": _masked_mean(-log_ratio, mask).item(),
                   "actor/pg_clipfrac_lower": _masked_mean(lower, mask).item()}
    return loss, metrics


def gspo_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "seq-mean-token-mean",
                     config=None, rollout_is_weights=None):
    """verl's "gspo": GSPO-token (sequence ratio as value, per-token gradient), PPO-clip, no dual-clip.

    verl caps the log-weight at 10 from above only; ours clamps it to [-10, 10]. The two differ
    only where a row's ratio is below e^-10 (4.5e-5).
    """
    if config is None:
        raise ValueError("config (verl's ActorConfig) is required: it holds the clip ratios")
    low, high = _clip_bounds(config)
    opts = GRPOOptions(loss_type="grpo", epsilon=low, epsilon_high=high, importance_sampling_level="sequence_token",
                       log_ratio_clamp=10.0, compute_entropy=False)
    mask = response_mask.to(log_prob.dtype)
    terms = per_token_terms(log_prob, mask, advantages, old_log_prob, None, rollout_is_weights, opts)
    loss = aggregate(terms.per_token_loss, mask, loss_agg_mode, **_batch_info(config))
    with torch.no_grad():
        clipped = (terms.is_low_clipped | terms.is_high_clipped).to(mask.dtype)
        metrics = {"actor/pg_clipfrac": _masked_mean(clipped, mask).item(),
                   "actor/ppo_kl": _masked_mean(-(log_prob - old_log_prob), mask).item(),
                   "actor/pg_clipfrac_lower": 0.0}
    return loss, metrics


def kl_loss(log_prob, ref_log_prob, response_mask, kl_penalty: str = "low_var_kl",
            loss_agg_mode: str = "token-mean", **global_batch_info) -> torch.Tensor:
    """verl's actor KL loss: ``agg_loss(kl_penalty(logp, ref), mask)`` with verl's clamps (k3: +-20 in, +-10 out)."""
    if kl_penalty not in VERL_KL:
        raise ValueError(f"kl_penalty must be one of {sorted(VERL_KL)}, got {kl_penalty!r} ('abs' and 'full' "
                         "are not implemented here)")
    estimator = VERL_KL[kl_penalty]
    clamps = dict(log_ratio_clamp=20.0, kl_clamp=10.0) if estimator == "k3" else {}
    kl = kl_term(log_prob, ref_log_prob, GRPOOptions(kl_estimator=estimator, **clamps))
    return aggregate(kl, response_mask, loss_agg_mode, **global_batch_info)


def register() -> None:
    """Add "grpo_kernels" and "grpo_kernels_gspo" to verl's policy-loss registry."""
    from verl.trainer.ppo import core_algos

    core_algos.register_policy_loss("grpo_kernels")(vanilla_policy_loss)
    core_algos.register_policy_loss("grpo_kernels_gspo")(gspo_policy_loss)


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

    replace_everywhere(torch_functional, {"logprobs_from_logits": logprobs_from_logits,
                                           "entropy_from_logits": entropy_from_logits,
                                           "entropy_from_logits_with_chunking": entropy_from_logits_with_chunking})
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

    replace_everywhere(tensor_parallel, {"vocab_parallel_log_probs_from_logits": vocab_parallel_log_probs_from_logits,
                                          "vocab_parallel_entropy": vocab_parallel_entropy,
                                          "vocab_parallel_entropy_with_chunking": vocab_parallel_entropy_with_chunking})
