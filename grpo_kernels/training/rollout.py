"""What one step samples and trains on: the rollout of a rank's groups (``Rollout``), a step's batch
(``StepBatch``), and the small helpers on prompts and rows that sampling and the tasks share."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


def left_padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows, numbered as ``generate()`` numbers them (0 at the first real token)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def reward_columns(rows: list[dict]) -> dict[str, list]:
    """The rows' fields other than "prompt", one list each: the keyword arguments of a TRL reward function."""
    return {key: [row[key] for row in rows] for key in rows[0] if key != "prompt"}


def _pad_to(t: torch.Tensor, width: int, value, left: bool) -> torch.Tensor:
    """``t`` [B, W, ...] padded with ``value`` to [B, width, ...], on the left or the right."""
    missing = width - t.shape[1]
    if missing == 0:
        return t
    pad = t.new_full((t.shape[0], missing, *t.shape[2:]), value)
    return torch.cat([pad, t] if left else [t, pad], 1)


@dataclasses.dataclass
class Rollout:
    """One rank's generation batch: B = groups x G rows, the rows of a group consecutive."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, T]
    completion_mask: torch.Tensor  # [B, T], 1 up to and including the first EOS
    advantages: torch.Tensor  # [B], or [B, T] with process supervision
    rewards: torch.Tensor  # [B, K], NaN where a reward function returned None
    zero_std: torch.Tensor  # [groups] bool: the groups whose rewards are all equal (no signal)
    rows: list[dict]  # [B]: the dataset row of each completion

    def groups(self, keep: torch.Tensor) -> Rollout:
        """The rollout of the groups ``keep`` [groups] (bool) selects, in order."""
        rows_kept = keep.repeat_interleave(self.completion_ids.shape[0] // keep.shape[0])
        index = rows_kept.nonzero().squeeze(1)
        return Rollout(
            *(
                t[index.to(t.device)]
                for t in (
                    self.prompt_ids,
                    self.prompt_mask,
                    self.completion_ids,
                    self.completion_mask,
                    self.advantages,
                    self.rewards,
                )
            ),
            self.zero_std[keep],
            [self.rows[i] for i in index.tolist()],
        )

    @staticmethod
    def concat(parts: Sequence[Rollout], pad_token_id: int) -> Rollout:
        """One rollout of several rounds' groups: prompts re-padded on the left, completions on the right."""
        if len(parts) == 1:
            return parts[0]
        P = max(p.prompt_ids.shape[1] for p in parts)
        T = max(p.completion_ids.shape[1] for p in parts)
        cat = lambda tensors, width, value, left: torch.cat([_pad_to(t, width, value, left) for t in tensors])  # noqa: E731
        per_token_advantages = parts[0].advantages.dim() == 2
        return Rollout(
            cat([p.prompt_ids for p in parts], P, pad_token_id, True),
            cat([p.prompt_mask for p in parts], P, 0, True),
            cat([p.completion_ids for p in parts], T, pad_token_id, False),
            cat([p.completion_mask for p in parts], T, 0, False),
            cat([p.advantages for p in parts], T, 0.0, False)
            if per_token_advantages
            else torch.cat([p.advantages for p in parts]),
            torch.cat([p.rewards for p in parts]),
            torch.cat([p.zero_std for p in parts]),
            [row for p in parts for row in p.rows],
        )


@dataclasses.dataclass
class StepBatch:
    """What one step trains on (``update``) and what it sampled to get it (``sampled``: every round's
    groups, kept or not; the step's reward, accuracy and zero-std share are measured on these)."""

    update: Rollout
    sampled: Rollout
