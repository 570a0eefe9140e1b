"""What one step samples and trains on: the rollout of a rank's groups (``Rollout``), a step's batch
(``StepBatch``), what the sampler kept of the vocabulary at each token (``KeptSetRecorder``), and the small helpers
on prompts and rows that sampling and the tasks share."""

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


class KeptSetRecorder:
    """A logits processor run last in ``generate``'s chain: at each step the ids the sampler may draw (the finite
    entries of the scores after the temperature, top-k and top-p warpers) and the sampler's log-prob of the token it
    drew, for the trainer's replay (``grpo_kernels.KeptSet``). Holds one step's [B, V] log-probs at a time: a step's
    drawn token is read from the next step's input ids (the last one's from the completion, in ``replay``)."""

    def __init__(self):
        self._kept: list[torch.Tensor] = []  # per step: the kept ids [B, K_step], -1 after a row's last
        self._sampler_logps: list[torch.Tensor] = []  # per step: the drawn token's log-prob [B]
        self._pending: torch.Tensor | None = None  # the last step's log-softmax [B, V], its token not yet known

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._pending is not None:
            self._sampler_logps.append(self._pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        kept = torch.isfinite(scores)
        width = max(int(kept.sum(-1).max()), 1)
        order = torch.sort(kept.to(torch.int8), dim=-1, descending=True, stable=True).indices[:, :width]
        self._kept.append(torch.where(kept.gather(-1, order), order, -1))
        self._pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def replay(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> tuple:
        """(kept ids [B, T, K] padded with -1: prime-rl's form, the sampler's log-probs [B, T], 0 where masked) of
        the completion ``generate`` returned."""
        T = completion_ids.shape[1]
        logps = self._sampler_logps + [self._pending.gather(-1, completion_ids[:, T - 1 : T]).squeeze(-1)]
        width = max(k.shape[1] for k in self._kept[:T])
        kept = torch.stack([torch.nn.functional.pad(k, (0, width - k.shape[1]), value=-1) for k in self._kept[:T]], 1)
        sampler = torch.stack(logps[:T], 1)
        return kept, torch.where(completion_mask.bool(), sampler, 0.0)


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
    # with a truncating sampler (top-k / top-p): each token's kept ids [B, T, K] (-1: no entry) and the sampler's
    # log-prob of it [B, T] (``KeptSetRecorder``); None otherwise
    kept_ids: torch.Tensor | None = None
    sampler_logps: torch.Tensor | None = None

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
            *(None if t is None else t[index.to(t.device)] for t in (self.kept_ids, self.sampler_logps)),
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
            _kept_ids_of(parts, T),
            None if parts[0].sampler_logps is None else cat([p.sampler_logps for p in parts], T, 0.0, False),
        )


def _kept_ids_of(parts: Sequence[Rollout], T: int) -> torch.Tensor | None:
    """The parts' kept ids [B, T, K] as one, padded with -1 (no entry) in T and in K."""
    if parts[0].kept_ids is None:
        return None
    K = max(p.kept_ids.shape[2] for p in parts)
    wide = [torch.nn.functional.pad(p.kept_ids, (0, K - p.kept_ids.shape[2]), value=-1) for p in parts]
    return torch.cat([_pad_to(k, T, -1, False) for k in wide])


@dataclasses.dataclass
class StepBatch:
    """What one step trains on (``update``) and what it sampled to get it (``sampled``: every round's
    groups, kept or not; the step's reward, accuracy and zero-std share are measured on these)."""

    update: Rollout
    sampled: Rollout
