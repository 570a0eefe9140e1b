"""The collectives the loss math and the trainer share (``grpo_kernels.collectives``): on two gloo ranks each equals
the same computation over both ranks' values written out here, and with no process group each is the process's own."""

import torch
from gloo_ranks import run_ranks

from grpo_kernels import collectives


def _values(rank):
    """Each rank's values: rank 0 three, rank 1 two (unequal lengths)."""
    return torch.tensor([1.5, -2.0, 4.0]) if rank == 0 else torch.tensor([0.25, 8.0])


def _on_ranks(rank, world):
    values = _values(rank)
    grad = torch.full((2,), float(rank + 1))
    drawn = torch.tensor([7, 9]) if rank == 0 else torch.tensor([0, 0])
    return dict(
        world=collectives.world(),
        distributed=collectives.distributed(),
        summed=collectives.summed(torch.stack([values.sum(), torch.tensor(float(values.numel()))])).tolist(),
        smallest=collectives.smallest(10 - rank),
        largest=collectives.largest(10 - rank),
        offsets=collectives.offsets(values.numel()),
        gathered=collectives.gathered(values).tolist(),
        from_first=collectives.from_first(drawn).tolist(),
        sum_in_place=collectives.sum_in_place(grad).tolist(),
    )


def test_every_collective_over_two_ranks():
    both = torch.cat([_values(0), _values(1)])
    results = run_ranks(_on_ranks, 2)
    for rank, r in enumerate(results):
        assert tuple(r["world"]) == (rank, 2) and r["distributed"]
        assert r["summed"] == [both.sum().item(), 5.0]
        assert r["smallest"] == 9 and r["largest"] == 10
        assert tuple(r["offsets"]) == (0 if rank == 0 else 3, 5)
        assert r["gathered"] == both.tolist()  # in rank order, unequal lengths
        assert r["from_first"] == [7, 9]
        assert r["sum_in_place"] == [3.0, 3.0]


def test_without_a_process_group_each_is_this_processs_own():
    values = _values(0)
    assert collectives.world() == (0, 1) and not collectives.distributed()
    assert torch.equal(collectives.summed(values), values) and torch.equal(collectives.gathered(values), values)
    assert collectives.smallest(3) == 3 and collectives.largest(3) == 3 and collectives.offsets(3) == (0, 3)
    t = torch.tensor([1, 2])
    assert collectives.from_first(t) is t and collectives.sum_in_place(t) is t
