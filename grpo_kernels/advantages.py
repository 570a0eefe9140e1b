"""Group-relative advantages: the critic-free baseline of GRPO.

Rewards are laid out as consecutive groups of ``group_size`` completions of one prompt.
Conventions (``docs/loss-semantics.md``, "Advantages"):

=========  ==========  =====  ==============================================
who        std         eps    call
=========  ==========  =====  ==============================================
ours       population  1e-8   ``group_advantages(r, G)``
TRL        sample      1e-4   ``group_advantages(r, G, std="sample", eps=1e-4)``
verl       sample      1e-6   ``group_advantages(r, G, std="sample", eps=1e-6)``
OpenRLHF   sample      1e-9   ``group_advantages(r, G, std="sample", eps=1e-9, clip=10.0)``
Dr. GRPO   (none)      -      ``group_advantages(r, G, scale="none")``
=========  ==========  =====  ==============================================

(``preset="trl" | "verl" | "openrlhf"`` sets a row's settings: OpenRLHF's ``group_norm`` advantage is its
normalized reward clamped to ``--reward.clip_range``, +-10 by default.)

A group whose rewards are all equal gets advantage 0 for every member (eps only avoids a
division by zero; such a group carries no signal), and its share is returned so that it
can be watched. A reward that could not be scored is NaN and is ignored by the group's
mean and std, as in TRL; a completion with no score at all gets advantage 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

STD_KINDS = ("population", "sample")
SCALES = ("group", "batch", "none")
COMBINES = ("sum_then_normalize", "normalize_then_sum")


@dataclasses.dataclass
class GroupAdvantages:
    advantages: torch.Tensor  # [B]
    zero_std_fraction: torch.Tensor  # 0-d: share of groups whose rewards are all equal (no signal)
    zero_std_groups: torch.Tensor  # [groups] bool: which groups those are (what dynamic sampling drops)


def _check_groups(rewards: torch.Tensor, group_size: int, name: str = "rewards") -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    B = rewards.shape[0]
    if B % group_size != 0:
        raise ValueError(f"{name} has {B} rows, not a multiple of group_size={group_size}: groups would mix prompts")
    return B // group_size


def _nan_mean_std(x: torch.Tensor, std: str):
    """Per-row mean and std over the last dim ignoring NaN; rows with no value get mean 0, std 0."""
    valid = ~torch.isnan(x)
    count = valid.sum(-1, keepdim=True)
    filled = torch.where(valid, x, 0.0)
    mean = filled.sum(-1, keepdim=True) / count.clamp(min=1)
    sq = torch.where(valid, (x - mean) ** 2, 0.0).sum(-1, keepdim=True)
    dof = count if std == "population" else count - 1
    var = torch.where(dof > 0, sq / dof.clamp(min=1), torch.zeros_like(sq))
    return mean, var.sqrt(), count


def _normalize(rewards: torch.Tensor, group_size: int, std: str, eps: float, scale: str):
    """[B] (may hold NaN) -> advantages [B] (NaN rows -> 0) and the zero-std group mask [groups]."""
    groups = rewards.view(-1, group_size)
    mean, group_std, count = _nan_mean_std(groups, std)
    centered = groups - mean
    # All valid rewards equal (or fewer than two scored): no signal in this group.
    spread = torch.where(torch.isnan(groups), mean, groups)
    zero_std = (spread.amax(-1) == spread.amin(-1)) | (count.squeeze(-1) < 2)
    if scale == "group":
        advantages = centered / (group_std + eps)
    elif scale == "batch":
        _, batch_std, _ = _nan_mean_std(rewards.view(1, -1), std)
        advantages = centered / (batch_std + eps)
    else:
        advantages = centered
    advantages = torch.where(zero_std.unsqueeze(-1) | torch.isnan(groups), 0.0, advantages)
    return advantages.reshape(-1), zero_std


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    std: str = "population",
    eps: float = 1e-8,
    scale: str = "group",
    weights: Sequence[float] | None = None,
    combine: str = "sum_then_normalize",
    preset: str | None = None,
    clip: float | None = None,
) -> GroupAdvantages:
    """Advantages [B] from rewards [B] or [B, K] (K reward functions, combined with ``weights``).

    ``combine``: "sum_then_normalize" (TRL: weighted sum of the K rewards, then the group
    normalization) or "normalize_then_sum" (GDPO: normalize each reward within its group,
    then the weighted sum). NaN in one of K rewards is skipped by the weighted sum (TRL's
    nansum); a row whose K rewards are all NaN is unscored. ``clip``: the advantages clamped to
    [-clip, clip] (OpenRLHF's ``--reward.clip_range``). ``preset`` ("trl", "verl", "openrlhf") sets that
    trainer's std, eps and clip, overriding the three arguments.
    """
    if preset is not None:
        from .options import ADVANTAGE_PRESETS

        if preset not in ADVANTAGE_PRESETS:
            raise ValueError(f"preset must be one of {sorted(ADVANTAGE_PRESETS)}, got {preset!r}")
        std, eps = ADVANTAGE_PRESETS[preset]["std"], ADVANTAGE_PRESETS[preset]["eps"]
        clip = ADVANTAGE_PRESETS[preset].get("clip")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
        raise ValueError(f"clip must be a positive number (the advantages' bound) or None, got {clip!r}")
    if std not in STD_KINDS:
        raise ValueError(f"std must be one of {list(STD_KINDS)}, got {std!r}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {list(SCALES)}, got {scale!r}")
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {list(COMBINES)}, got {combine!r}")
    if not isinstance(rewards, torch.Tensor) or rewards.dim() not in (1, 2):
        got = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a tensor [B] or [B, K], got {got}")
    rewards = rewards.float()
    _check_groups(rewards, group_size)
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(-1)
    K = rewards.shape[1]
    w = torch.ones(K) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    if w.shape != (K,):
        raise ValueError(f"weights must have one entry per reward function ({K}), got shape {tuple(w.shape)}")
    w = w.to(rewards.device)
    unscored = torch.isnan(rewards).all(-1)
    if combine == "sum_then_normalize":
        total = torch.where(unscored, float("nan"), torch.nansum(rewards * w, dim=-1))
        advantages, zero_std = _normalize(total, group_size, std, eps, scale)
    else:
        per_reward = [_normalize(rewards[:, k].contiguous(), group_size, std, eps, scale) for k in range(K)]
        advantages = sum(w[k] * adv for k, (adv, _) in enumerate(per_reward))
        zero_std = torch.stack([z for _, z in per_reward]).all(0)
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    return GroupAdvantages(advantages, zero_std.float().mean(), zero_std)


def process_advantages(
    step_rewards: torch.Tensor,
    step_end: torch.Tensor,
    completion_mask: torch.Tensor,
    group_size: int,
    *,
    std: str = "population",
    eps: float = 1e-8,
) -> torch.Tensor:
    """Per-token advantages [B, T] from per-step rewards (process supervision).

    ``step_rewards`` [B, K] (NaN where a completion has fewer than K steps) and
    ``step_end`` [B, K], the token index at which each step ends. All step rewards of a
    group are normalized together; a token's advantage is the sum of the normalized
    rewards of the steps that end at or after it; masked tokens get 0.
    """
    if std not in STD_KINDS:
        raise ValueError(f"std must be one of {list(STD_KINDS)}, got {std!r}")
    if step_rewards.dim() != 2 or step_end.shape != step_rewards.shape:
        raise ValueError(
            f"step_rewards and step_end must both be [B, K], got {tuple(step_rewards.shape)} and "
            f"{tuple(step_end.shape)}"
        )
    if step_end.dtype.is_floating_point:
        raise TypeError(f"step_end must be an integer tensor of token indices, got {step_end.dtype}")
    B, K = step_rewards.shape
    if completion_mask.dim() != 2 or completion_mask.shape[0] != B:
        raise ValueError(f"completion_mask must be [B, T] with B = {B}, got {tuple(completion_mask.shape)}")
    T = completion_mask.shape[1]
    _check_groups(step_rewards, group_size, "step_rewards")
    rewards = step_rewards.float()
    valid = ~torch.isnan(rewards)
    if ((step_end < 0) | (step_end >= T))[valid].any():
        raise ValueError(f"step_end must index a token in [0, T) = [0, {T}) wherever the step has a reward")
    group_rewards = rewards.view(-1, group_size * K)  # every step reward of the group's completions
    mean, group_std, _ = _nan_mean_std(group_rewards, std)
    normalized = ((group_rewards - mean) / (group_std + eps)).view(B, K)
    normalized = torch.where(valid, normalized, 0.0)
    positions = torch.arange(T, device=rewards.device).view(1, T, 1)
    ends_at_or_after = step_end.unsqueeze(1) >= positions  # [B, T, K]
    advantages = (normalized.unsqueeze(1) * ends_at_or_after).sum(-1)
    return advantages * (completion_mask != 0)
