"""The multi-process harness itself: results come back, failures are never hidden, teardown cannot abort."""

import os

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_ranks


def _all_reduce_rank(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t


def _raising_rank(rank, world):
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    return rank


def _crashing_rank(rank, world):
    if rank == 0:
        os.abort()  # a crash inside the code under test, before any result exists
    return rank


def test_results_come_back_in_rank_order():
    results = run_ranks(_all_reduce_rank, 2)
    assert [r.item() for r in results] == [3.0, 3.0]


def test_a_rank_that_raises_fails_with_its_traceback():
    with pytest.raises(RuntimeError, match="rank 1 of 2 raised:(.|\n)*rank one fails on purpose"):
        run_ranks(_raising_rank, 2, timeout=120)


def test_a_rank_that_crashes_before_its_result_fails():
    with pytest.raises(RuntimeError, match="rank 0 of 2 exited with code -6 before it wrote its result"):
        run_ranks(_crashing_rank, 2, timeout=120)
