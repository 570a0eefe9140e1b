"""Seeded random combinations of every option against the specification (grpo_kernels/reference.py):
the loss on each backend and the eager loss, for the loss value, d loss / d logits and every metric.

Each case draws a shape (B up to 5, T up to 7, V over one or several blocks), a loss type and level,
the KL estimator and its clamps, delta, dual-clip, the log-ratio clamp, the entropy bonus, both
policy masks (with or without sampler log-probs), fractional masks, a fully masked row, per-row or
per-token advantages, importance weights of either shape and a token-count normalizer. The
specification shares no code with the paths it checks, so an agreement here is two independent
writings of the same math agreeing.
"""

import random

import pytest
import torch
from eager_baseline import grpo_loss_eager
from helpers import LOSS_TYPE_REGISTRY, PPO_CLIP_LOSS_TYPES, TRL_LOSS_TYPES, assert_close

from grpo_kernels import grpo_loss, grpo_loss_reference


def _draw(seed: int):
    """(options, inputs, logits) of one random case."""
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    B, T, V = rnd.randint(1, 5), rnd.randint(1, 7), rnd.choice([7, 50, 300])
    loss_type = rnd.choice(TRL_LOSS_TYPES)
    levels = LOSS_TYPE_REGISTRY[loss_type].levels
    level = levels[0] if len(levels) == 1 else rnd.choice(levels)  # (one level draws nothing: the seeds' cases)
    opts = dict(loss_type=loss_type, importance_sampling_level=level, temperature=rnd.choice([1.0, 0.7, 1.3]))
    if loss_type == "dr_grpo":
        opts["max_completion_length"] = rnd.randint(T, T + 3)
    if loss_type == "cispo":
        opts["epsilon_high"] = rnd.choice([1.05, 2.0, 5.0])
    elif rnd.random() < 0.3:
        opts["epsilon_high"] = 0.28
    if rnd.random() < 0.5:
        opts.update(beta=0.04, kl_estimator=rnd.choice(["k1", "k2", "k3"]))
        if rnd.random() < 0.3:
            opts["kl_clamp"] = 0.05
        if rnd.random() < 0.3:
            opts["use_bias_correction_kl"] = True
    if rnd.random() < 0.3:
        opts["log_ratio_clamp"] = 0.3
    if loss_type in PPO_CLIP_LOSS_TYPES and rnd.random() < 0.3:
        opts["delta"] = 1.3
    if loss_type in PPO_CLIP_LOSS_TYPES and rnd.random() < 0.3:
        opts["dual_clip"] = 2.0
    if rnd.random() < 0.3:
        opts["entropy_coef"] = 0.05
        if loss_type in ("dapo", "cispo", "vespo") and rnd.random() < 0.5:
            opts["entropy_reduction"] = "loss"  # divided as the token-count loss is (OpenRLHF's entropy loss)
    if rnd.random() < 0.25:
        opts["top_entropy_quantile"] = 0.5
    if rnd.random() < 0.25:
        opts["off_policy_mask_threshold"] = 0.05

    logits = 2 * torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    if rnd.random() < 0.3:
        mask = mask * torch.rand(B, T, generator=g)  # fractional weights
    if rnd.random() < 0.3:
        mask[0] = 0  # a fully masked row
    lp = torch.log_softmax(logits / opts["temperature"], -1).gather(-1, ids[..., None])[..., 0]
    near = lambda: lp + 0.3 * torch.randn(B, T, generator=g)  # noqa: E731 - ratios on both sides of the clips
    inputs = dict(
        completion_ids=ids,
        completion_mask=mask,
        advantages=torch.randn((B, T) if rnd.random() < 0.3 else (B,), generator=g),
    )
    if rnd.random() < 0.7:
        inputs["old_logps"] = near()
    if opts.get("beta"):
        inputs["ref_logps"] = near()
    if rnd.random() < 0.3:
        inputs["importance_weights"] = 0.5 + torch.rand((B, T) if rnd.random() < 0.5 else (B,), generator=g)
    if loss_type in ("dapo", "cispo", "vespo") and rnd.random() < 0.2:
        inputs["normalizer"] = 11.0
    if opts.get("off_policy_mask_threshold") is not None and rnd.random() < 0.5:
        inputs["sampling_logps"] = near()
    return opts, inputs, logits


def _run(fn, logits, inputs, opts, **extra):
    leaf = logits.clone().requires_grad_()
    out = fn(leaf, **inputs, **opts, **extra)
    out.loss.backward()
    return out, leaf.grad


@pytest.mark.parametrize("path", ["torch", "triton", "eager"])
def test_random_option_combinations_match_the_specification(path):
    seeds = range(150) if path != "triton" else range(1000, 1060)  # the interpreter is slow
    for seed in seeds:
        opts, inputs, logits = _draw(seed)
        expected, expected_grad = _run(grpo_loss_reference, logits, inputs, opts)
        if path == "eager":
            actual, grad = _run(grpo_loss_eager, logits, inputs, opts)
        else:
            actual, grad = _run(grpo_loss, logits, inputs, opts, backend=path)
        where = f"seed {seed}, {opts}"
        assert_close(f"loss ({where})", expected.loss, actual.loss, atol=2e-6, rtol=1e-5)
        assert_close(f"dlogits ({where})", expected_grad, grad, atol=2e-6, rtol=1e-4)
        assert set(expected.metrics) == set(actual.metrics), where
        for name, value in expected.metrics.items():
            assert_close(f"metric {name} ({where})", value, actual.metrics[name], atol=1e-5, rtol=1e-4)
