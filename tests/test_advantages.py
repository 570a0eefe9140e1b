"""Group advantages: the worked examples, TRL's and verl's conventions, NaN rewards, process supervision."""

import math

import pytest
import torch

from grpo_kernels.advantages import group_advantages, process_advantages


def test_worked_examples_from_the_design():
    out = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4)
    torch.testing.assert_close(out.advantages, torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-6, rtol=0)
    same = group_advantages(torch.tensor([1.0, 1.0, 1.0, 1.0]), 4)
    assert torch.equal(same.advantages, torch.zeros(4)) and same.zero_std_fraction.item() == 1.0


def test_groups_are_never_mixed_and_zero_std_fraction_counts_groups():
    rewards = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.0, 4.0])
    out = group_advantages(rewards, 2)
    torch.testing.assert_close(out.advantages, torch.tensor([1.0, -1.0, 0.0, 0.0, -1.0, 1.0]), atol=1e-6, rtol=0)
    assert out.zero_std_fraction.item() == pytest.approx(1 / 3)
    assert out.zero_std_groups.tolist() == [False, True, False]  # the groups dynamic sampling drops


@pytest.mark.parametrize("std, eps", [("sample", 1e-4), ("sample", 1e-6)])  # TRL, verl
def test_trl_and_verl_conventions_match_torch_std(std, eps):
    rewards = torch.tensor([0.2, 0.9, 0.4, 0.7, 1.0, 0.0, 0.5, 0.5])
    groups = rewards.view(2, 4)
    expected = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + eps)).view(-1)
    torch.testing.assert_close(group_advantages(rewards, 4, std=std, eps=eps).advantages, expected)


def test_batch_scale_and_no_scale():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    centered = torch.tensor([0.5, -0.5, 1.0, -1.0])
    torch.testing.assert_close(group_advantages(rewards, 2, scale="none").advantages, centered)
    batch_std = rewards.std(unbiased=False)
    torch.testing.assert_close(group_advantages(rewards, 2, scale="batch").advantages, centered / (batch_std + 1e-8))


def test_nan_rewards_are_ignored_and_unscored_rows_get_zero():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 1.0])
    out = group_advantages(rewards, 4)
    valid = torch.tensor([1.0, 0.0, 1.0])
    expected = (valid - valid.mean()) / (valid.std(unbiased=False) + 1e-8)
    torch.testing.assert_close(out.advantages, torch.tensor([expected[0], 0.0, expected[1], expected[2]]))
    assert not torch.isnan(out.advantages).any()


def test_several_reward_functions_sum_then_normalize_and_normalize_then_sum():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    weights = [2.0, 1.0]
    total = torch.tensor([2.0, 1.0, 3.0, 0.0])
    expected = (total - total.mean()) / (total.std(unbiased=False) + 1e-8)
    torch.testing.assert_close(group_advantages(rewards, 4, weights=weights).advantages, expected)
    col = lambda c: (c - c.mean()) / (c.std(unbiased=False) + 1e-8)  # noqa: E731
    gdpo = 2.0 * col(rewards[:, 0]) + 1.0 * col(rewards[:, 1])
    torch.testing.assert_close(
        group_advantages(rewards, 4, weights=weights, combine="normalize_then_sum").advantages, gdpo
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(group_size=3), "rewards has 4 rows, not a multiple of group_size=3"),
        (dict(group_size=0), "group_size must be a positive int, got 0"),
        (dict(group_size=2, std="bessel"), "std must be one of"),
        (dict(group_size=2, weights=[1.0, 2.0]), r"weights must have one entry per reward function \(1\)"),
    ],
)
def test_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(torch.ones(4), **kwargs)


def test_process_supervision_by_hand():
    # One group of 2 completions, T = 5. Completion 0: steps ending at tokens 1 and 4 with
    # rewards 1 and 0; completion 1: one step ending at token 2 with reward 1 (second is NaN).
    step_rewards = torch.tensor([[1.0, 0.0], [1.0, float("nan")]])
    step_end = torch.tensor([[1, 4], [2, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    # Group rewards {1, 0, 1}: mean 2/3, population std sqrt(2)/3.
    hi, lo = (1 - 2 / 3) / (math.sqrt(2) / 3 + 1e-8), (0 - 2 / 3) / (math.sqrt(2) / 3 + 1e-8)
    expected = torch.tensor([[hi + lo, hi + lo, lo, lo, lo], [hi, hi, hi, 0.0, 0.0]])
    torch.testing.assert_close(process_advantages(step_rewards, step_end, mask, 2), expected)


def test_process_supervision_bad_input():
    with pytest.raises(ValueError, match="step_end must index a token in"):
        process_advantages(torch.ones(2, 1), torch.tensor([[5], [0]]), torch.ones(2, 5), 2)
    with pytest.raises(ValueError, match="not a multiple of group_size=2"):
        process_advantages(torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long), torch.ones(3, 5), 2)
