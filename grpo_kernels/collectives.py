"""The collectives the loss math and the thin trainer need, over torch.distributed's default group, each with its
one fallback: where no process group is running (or it has one process), each returns this process's own values.

Who uses them: the high-entropy mask's quantile over every process's tokens (``objective``), Clip-Cov's and
KL-Cov's whole-batch selections (``policy_terms``), verl's batch-normalized rollout weights (``rollout_correction``),
the specification's gathers (``reference``) and the thin trainer's sums, extremes and gradient averaging. The
vocabulary-parallel all-reduces over a vocabulary's own group are that algorithm's (``vocab_parallel.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(this process's rank, the number of processes); (0, 1) where no process group is running."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def distributed() -> bool:
    """More than one process in the default group."""
    return world()[1] > 1


def collective_device() -> torch.device:
    """Where the default group's collectives take their tensors: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def summed(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over every process, in their dtype and on their device (fp64 on the way, so that counts
    stay exact); no gradient. This process's own, detached, without a group."""
    if not distributed():
        return values.detach()
    total = values.detach().to(device=collective_device(), dtype=torch.float64)
    dist.all_reduce(total)
    return total.to(device=values.device, dtype=values.dtype)


def sum_in_place(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over every process, in place (a parameter's gradient: no copy); ``t`` itself without a group."""
    if distributed():
        dist.all_reduce(t)
    return t


def smallest(value: int) -> int:
    """The smallest of every process's ``value``."""
    if not distributed():
        return value
    t = torch.tensor([value], device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def largest(value: int) -> int:
    """The largest of every process's ``value``."""
    return -smallest(-value)


def offsets(count: int) -> tuple[int, int]:
    """(the items on the processes before this one, the items on all of them), of each process's ``count``."""
    if not distributed():
        return 0, count
    rank, size = world()
    counts = torch.zeros(size, dtype=torch.int64, device=collective_device())
    counts[rank] = count
    dist.all_reduce(counts)
    counts = counts.cpu()
    return int(counts[:rank].sum()), int(counts.sum())


def gathered(values: torch.Tensor) -> torch.Tensor:
    """The 1-D ``values`` of every process, concatenated in rank order (lengths may differ), on ``values``' device;
    no gradient. This process's own without a group."""
    if not distributed():
        return values.detach()
    before, total = offsets(values.numel())
    everyone = torch.zeros(total, dtype=torch.float64, device=collective_device())
    everyone[before : before + values.numel()] = values.detach().to(everyone.device, torch.float64)
    dist.all_reduce(everyone)  # each process fills its own slice: the sum is the concatenation
    return everyone.to(device=values.device, dtype=values.dtype)


def all_gathered(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every process's ``t`` (one shape on all of them) in ``group``'s rank order; no gradient."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return parts


def from_first(t: torch.Tensor) -> torch.Tensor:
    """Process 0's ``t`` on every process (in place), ``t`` itself without a group."""
    if not distributed():
        return t
    on_collective = t.to(collective_device())
    dist.broadcast(on_collective, src=0)
    return on_collective.to(t.device)
