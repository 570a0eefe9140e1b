"""A vocabulary-parallel loss step (P ranks, each holding logits [B, T, V / P]) against the unsharded step.

    python benchmarks/vocab_parallel.py --out FILE [--ranks 2] [--smoke]

Each rank runs ``grpo_loss(..., vocab_parallel_group=...)`` on its slice, forward + backward, the
default one-pass kernel; the ranks exchange three all-reduces of O(B * T) values. A step is timed
from a barrier to a barrier after every rank's GPU work has finished, so it is the slowest rank's
step with the exchange. Rank 0 then times the unsharded loss on the whole vocabulary on the same
device while the other ranks wait, and checks that the sharded loss and the sums of each rank's
gradient slice equal the unsharded ones (the tests prove exact equality; this guards the timing).

Transports:
- P GPUs or more: one GPU a rank, NCCL. The sharded step's time against the unsharded one is the
  speed-up of splitting the vocabulary.
- One GPU (the device suite's machine): the P ranks share it and talk through gloo, which stages
  the CUDA tensors through host memory. The GPU then does the whole vocabulary's work either way,
  so the difference from the unsharded step is what the protocol costs (the exchange, P processes'
  launches), not a speed-up.
- No GPU: gloo on the CPU, tiny shapes (CI runs this as a smoke test of the harness).

Ranks are spawned with the tests' harness (``tests/gloo_ranks.py``): a rank's failure comes back as
its traceback, and gloo's teardown cannot abort the run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]

from gloo_ranks import run_ranks  # noqa: E402

from grpo_kernels import grpo_loss, token_logprobs  # noqa: E402

TEMPERATURE, BETA = 0.7, 0.04
GPU_SHAPES = [(16, 1024, 151936), (4, 1024, 32000)]
SMOKE_SHAPES = [(2, 8, 1004)]


def _shard(B: int, T: int, V: int, P: int, shard: int, device, dtype) -> torch.Tensor:
    """Shard ``shard`` of the logits [B, T, V], the same wherever it is made (its own seeded generator)."""
    g = torch.Generator(device=device).manual_seed(1000 + shard)
    return torch.randn(B, T, V // P, device=device, dtype=dtype, generator=g)


def _per_token_inputs(B: int, T: int, V: int, device) -> dict:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(B, T)
    mask[:, T - T // 8 :] = 0  # some padding, as in real batches
    return {
        k: v.to(device)
        for k, v in dict(
            completion_ids=torch.randint(0, V, (B, T), generator=g),
            completion_mask=mask,
            advantages=torch.randn(B, generator=g),
            noise=0.05 * torch.randn(2, B, T, generator=g),
        ).items()
    }


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(logits, x, group):
    leaf = logits.detach().requires_grad_()
    out = grpo_loss(
        leaf,
        x["completion_ids"],
        x["completion_mask"],
        x["advantages"],
        x["old_logps"],
        x["ref_logps"],
        beta=BETA,
        temperature=TEMPERATURE,
        check_ids=False,
        vocab_parallel_group=group,
    )
    out.loss.backward()
    return out.loss.detach(), leaf.grad


def _timed(step, rounds: int, device, barrier=None) -> list:
    """Milliseconds of ``rounds`` calls of ``step`` after two warm-up calls (compile, caches)."""
    times = []
    for i in range(rounds + 2):
        if barrier:
            barrier()
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        if barrier:
            barrier()
        if i >= 2:
            times.append(1e3 * (time.perf_counter() - start))
    return times


def _rank(rank: int, world: int, shapes, rounds: int) -> list:
    import torch.distributed as dist

    group = dist.group.WORLD
    cuda = torch.cuda.is_available()
    device = (
        torch.device("cuda", torch.cuda.current_device() if dist.get_backend() == "nccl" else 0)
        if cuda
        else torch.device("cpu")
    )
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for B, T, V in shapes:
        x = _per_token_inputs(B, T, V, device)
        mine = _shard(B, T, V, world, rank, device, dtype)
        lp = token_logprobs(mine, x["completion_ids"], temperature=TEMPERATURE, vocab_parallel_group=group)
        x["old_logps"], x["ref_logps"] = lp + x["noise"][0], lp + x["noise"][1]
        sharded_ms = _timed(lambda mine=mine, x=x: _step(mine, x, group), rounds, device, barrier=dist.barrier)
        loss, grad = _step(mine, x, group)
        sums = [None] * world  # as objects: gloo gathers no CUDA tensors
        dist.all_gather_object(sums, grad.double().abs().sum().item())
        del grad
        row = dict(
            B=B,
            T=T,
            V=V,
            P=world,
            dtype=str(dtype).replace("torch.", ""),
            device=str(device),
            transport=dist.get_backend(),
            sharded_ms=statistics.median(sharded_ms),
            rounds=rounds,
        )
        if rank == 0:  # the unsharded step, on the whole vocabulary, while the other ranks wait
            full = torch.cat([_shard(B, T, V, world, r, device, dtype) for r in range(world)], dim=-1)
            row["unsharded_ms"] = statistics.median(_timed(lambda full=full, x=x: _step(full, x, None), rounds, device))
            full_loss, full_grad = _step(full, x, None)
            expected = [
                full_grad[..., r * (V // world) : (r + 1) * (V // world)].double().abs().sum().item()
                for r in range(world)
            ]
            got = sums
            row["loss_difference"] = abs(loss.item() - full_loss.item())
            row["grad_sum_relative_difference"] = max(
                abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got, expected, strict=True)
            )
            row["matches_unsharded"] = (
                row["loss_difference"] <= 1e-3 * max(1.0, abs(full_loss.item()))
                and row["grad_sum_relative_difference"] <= 1e-2
            )
            S = B * T * V * full.element_size()
            row["S_bytes"] = S
            row["sharded_GBps"] = 2 * S / row["sharded_ms"] / 1e6  # one-pass: 2 S in all, 2 S / P a rank
            row["unsharded_GBps"] = 2 * S / row["unsharded_ms"] / 1e6
            del full, full_grad
        dist.barrier()
        rows.append(row)
        if cuda:
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (the default without CUDA)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    smoke = args.smoke or not cuda
    shapes = SMOKE_SHAPES if smoke else GPU_SHAPES
    rounds = args.rounds or (3 if smoke else 20)
    backend = "nccl" if cuda and torch.cuda.device_count() >= args.ranks else "gloo"
    started = time.time()
    result = dict(
        environment=dict(
            torch=torch.__version__,
            device=torch.cuda.get_device_name() if cuda else "cpu",
            gpus=torch.cuda.device_count() if cuda else 0,
            transport=backend,
            interpreter=os.environ.get("TRITON_INTERPRET") == "1",
        )
    )
    try:
        per_rank = run_ranks(_rank, args.ranks, shapes, rounds, timeout=args.timeout, backend=backend)
        result["cases"] = per_rank[0]
        for row, *others in zip(
            *per_rank, strict=True
        ):  # the step ends at a barrier, so every rank's time is the step's
            row["sharded_ms_per_rank"] = [row["sharded_ms"]] + [o["sharded_ms"] for o in others]
    except Exception as error:  # noqa: BLE001 - the suite keeps what ran; the error is the result
        result["error"] = f"{type(error).__name__}: {error}"
    result["seconds"] = round(time.time() - started, 1)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    if "error" in result:
        sys.exit(1)


if __name__ == "__main__":
    main()
