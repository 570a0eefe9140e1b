"""MATH-SHEPHERD step labels on hand-worked cases, and their path into process advantages."""

import math

import pytest
import torch

from grpo_kernels.advantages import process_advantages
from grpo_kernels.training.process_labels import labels_to_step_rewards, step_labels


def test_hard_and_soft_labels_by_hand():
    # Step 1: 3 of 4 completions reach 12; step 2: 1 of 4 (as "12.0"); step 3: none (one gave no answer).
    answers = [["12", "12", "7", "12"], ["3", "12.0", "5", "8"], ["7", None, "9", "1"]]
    hard, soft = step_labels(answers, "12")
    assert hard == [1, 1, 0]
    assert soft == [0.75, 0.25, 0.0]


def test_custom_equality_and_empty_step():
    hard, soft = step_labels([["Paris", "paris "]], "PARIS", equal=lambda a, g: a.strip().lower() == g.lower())
    assert (hard, soft) == ([1], [1.0])
    with pytest.raises(ValueError, match=r"step_answers\[0\] is empty"):
        step_labels([[]], "1")


def test_labels_become_process_advantages():
    # Two completions of one prompt: steps ending at tokens (1, 3) and (2,), soft labels.
    rewards, ends = labels_to_step_rewards([[0.75, 0.25], [1.0]], [[1, 3], [2]])
    assert torch.equal(ends, torch.tensor([[1, 3], [2, 0]]))
    assert rewards[1, 1].isnan() and rewards[0].tolist() == [0.75, 0.25]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    adv = process_advantages(rewards, ends, mask, group_size=2)
    values = torch.tensor([0.75, 0.25, 1.0])
    z = (values - values.mean()) / (values.std(unbiased=False) + 1e-8)
    expected = torch.tensor([[z[0] + z[1], z[0] + z[1], z[1], z[1]], [z[2], z[2], z[2], 0.0]])
    torch.testing.assert_close(adv, expected)
    assert not math.isnan(adv.sum().item())


def test_bad_label_input():
    with pytest.raises(ValueError, match="one entry per completion"):
        labels_to_step_rewards([[1.0]], [])
    with pytest.raises(ValueError, match="step ends must increase"):
        labels_to_step_rewards([[1.0, 0.0]], [[3, 1]])
    with pytest.raises(ValueError, match="2 labels but 1 step ends"):
        labels_to_step_rewards([[1.0, 0.0]], [[3]])
