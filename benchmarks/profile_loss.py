"""One end-to-end loss call under torch.profiler: every kernel it launches and its time, so that the time above the
main kernel is accounted for.

    python benchmarks/profile_loss.py --out FILE [--smoke]

The call is the benchmark suite's case at (B, T, V) = (16, 1024, 151936) bf16 (``cases.make_inputs``: the model's
[B, T + 1, V] logits, 1/8 padding, old and reference log-probs, beta 0.04): ``GRPOLoss(drop_last_position=True)``
forward and backward through ``torch.autograd.grad``, as the benchmark times it, after warm-up. Recorded: the
call's time between CUDA events (what the benchmark reports), the host's time to issue it, and per kernel (by
name) its launches and device time, largest first; the gap is the call's time less the largest kernel's. On a CPU
(``--smoke``, CI) the same call at a tiny shape, the profiler's CPU operators instead of kernels.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from cases import BETA, ON_GPU, TEMPERATURE, environment, make_inputs, sync  # noqa: E402

from grpo_kernels import GRPOLoss  # noqa: E402

GPU_SHAPE, SMOKE_SHAPE = (16, 1024, 151936), (2, 8, 1003)


def loss_call(inputs):
    loss_fn = GRPOLoss(beta=BETA, temperature=TEMPERATURE, drop_last_position=True, check_ids=False)

    def call():
        leaf = inputs["full_logits"].detach().requires_grad_()
        out = loss_fn(
            leaf,
            inputs["completion_ids"],
            inputs["completion_mask"],
            inputs["advantages"],
            old_logps=inputs["old_logps"],
            ref_logps=inputs["ref_logps"],
        )
        torch.autograd.grad(out.loss, leaf)

    return call


def timed(call) -> tuple:
    """(the call's time between CUDA events around it, the host's time to issue it), in ms; the host time twice
    on a CPU."""
    sync()
    start = time.perf_counter()
    if ON_GPU:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    call()
    host = (time.perf_counter() - start) * 1e3
    if ON_GPU:
        end.record()
    sync()
    return (begin.elapsed_time(end) if ON_GPU else (time.perf_counter() - start) * 1e3), host


def kernels(prof) -> list:
    """[{name, launches, device_ms}] of the profile's device kernels (CPU operators on a CPU), largest first."""
    from torch.autograd import DeviceType

    totals, counts = collections.Counter(), collections.Counter()
    for event in prof.events():
        on_device = getattr(event, "device_type", None) == DeviceType.CUDA
        if ON_GPU != on_device or (not ON_GPU and event.cpu_parent is not None):  # CPU: top-level operators
            continue
        totals[event.name] += event.time_range.elapsed_us() / 1e3
        counts[event.name] += 1
    return [{"name": name, "launches": counts[name], "device_ms": ms} for name, ms in totals.most_common()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    shape = SMOKE_SHAPE if args.smoke or not ON_GPU else GPU_SHAPE
    call = loss_call(make_inputs(*shape))
    for _ in range(3):  # compiles, caches, the allocator's pool
        call()
    wall = sorted(timed(call) for _ in range(5))[2]  # the median call
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if ON_GPU else [])
    with torch.profiler.profile(activities=activities) as prof:
        call()
        sync()
    found = kernels(prof)
    B, T, V = shape
    result = {
        "shape": {"B": B, "T": T, "V": V, "N": B * T},
        "dtype": "bfloat16" if ON_GPU else "float32",
        "call_ms": wall[0],
        "host_ms": wall[1],
        "kernels": found,
        "kernels_ms": sum(k["device_ms"] for k in found),
        "gap_above_largest_ms": wall[0] - (found[0]["device_ms"] if found else 0.0),
        **environment(),
    }
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print(
        f"one loss call at {B} x {T} x {V}: {wall[0]:.3f} ms (host {wall[1]:.3f} ms), "
        f"{len(found)} kernels {result['kernels_ms']:.3f} ms"
    )
    for k in found[:15]:
        print(f"  {k['device_ms']:8.3f} ms  {k['launches']:3d}x  {k['name'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
