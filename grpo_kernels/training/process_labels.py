"""Automatic process labels (MATH-SHEPHERD, Wang et al. 2024) and their conversion to process advantages.

A step s_i of a solution is judged by completing the solution N times from s_i onward and
checking the final answers against the gold one: the *hard* label is 1 if any completion
reaches the gold answer, the *soft* label is the fraction that do. The labels of a
completion's steps, with the token index at which each step ends, are the ``step_rewards``
and ``step_end`` inputs of ``grpo_kernels.advantages.process_advantages``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .rewards import _same


def step_labels(
    step_answers: Sequence[Sequence[str | None]],
    gold: str,
    *,
    equal: Callable[[str, str], bool] | None = None,
) -> tuple[list[int], list[float]]:
    """Hard and soft labels, one per step.

    ``step_answers[i]`` holds the final answers of the N completions sampled from step i
    onward (None where a completion gave no answer). ``equal(answer, gold)`` decides a
    match (default: the numeric / normalized-text comparison of ``grpo_kernels.training.rewards``).
    """
    same = equal or (lambda answer, target: _same(answer, target, 1e-9))
    hard, soft = [], []
    for i, answers in enumerate(step_answers):
        if len(answers) == 0:
            raise ValueError(f"step_answers[{i}] is empty: each step needs at least one completion to judge it")
        hits = [a is not None and same(str(a), str(gold)) for a in answers]
        hard.append(int(any(hits)))
        soft.append(sum(hits) / len(hits))
    return hard, soft


def labels_to_step_rewards(
    labels: Sequence[Sequence[float]], step_ends: Sequence[Sequence[int]], *, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-completion step labels and step end indices -> ``(step_rewards [B, K], step_end [B, K])``.

    K is the largest number of steps; shorter completions are padded with NaN rewards (and
    end index 0, which ``process_advantages`` ignores where the reward is NaN).
    """
    if len(labels) != len(step_ends):
        raise ValueError(
            f"labels and step_ends must have one entry per completion, got {len(labels)} and {len(step_ends)}"
        )
    K = max((len(x) for x in labels), default=0)
    rewards = torch.full((len(labels), K), float("nan"), device=device)
    ends = torch.zeros((len(labels), K), dtype=torch.long, device=device)
    for b, (row_labels, row_ends) in enumerate(zip(labels, step_ends, strict=True)):
        if len(row_labels) != len(row_ends):
            raise ValueError(f"completion {b}: {len(row_labels)} labels but {len(row_ends)} step ends")
        if list(row_ends) != sorted(row_ends):
            raise ValueError(f"completion {b}: step ends must increase, got {list(row_ends)}")
        rewards[b, : len(row_labels)] = torch.tensor([float(x) for x in row_labels])
        ends[b, : len(row_ends)] = torch.tensor(list(row_ends), dtype=torch.long)
    return rewards, ends
