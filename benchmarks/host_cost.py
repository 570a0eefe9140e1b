"""The host work of one GRPO forward + backward, with every Triton launch made a no-op.

On tiny CPU shapes, with the kernels' launches replaced by a counter, what is left of a loss call is
the Python, the dispatcher and the small torch ops around the kernels: the cost that decides the
end-to-end time at small shapes on a GPU. Per path: the aten ops dispatched in the forward and in the
backward (every op that reaches the dispatcher, views and allocations included), the Triton launches,
the host time per forward + backward (the median of repeats, the paths' rounds interleaved so that load on the
machine falls on all of them alike), and what Triton's JIT adds to it on a GPU
before each driver call: its binder specializing every argument of those same launches for sm_90
(pointer alignment, integer values, dtypes) and the kernel cache key, timed on the recorded arguments.
Liger-Kernel's ``triton_grpo_loss`` is measured the same way in the same run where it is installed, and so
is the floor of any loss written as a ``torch.autograd.Function`` (one that allocates its outputs and
gradient and computes nothing).

    python benchmarks/host_cost.py [--iters 300] [--repeats 5] [--json out.json]

What this does not see: the driver's launch call and the C launcher's argument packing (a few
microseconds a launch on a GPU); the device suite times host and GPU apart there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors on backend="triton": before triton is imported

import torch
from torch.utils._python_dispatch import TorchDispatchMode

B, T, V = 2, 8, 1003
TEMPERATURE, BETA = 0.7, 0.04


class OpCounter(TorchDispatchMode):
    """Counts every aten op that reaches the dispatcher inside the block."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_op_launches():
    """Every interpreted Triton kernel (ours and Liger's) launches nothing; yields the launch record: their
    count, and while ``record["launched"]`` is a list, each launch (the kernel, its arguments) appended."""
    from triton.runtime.interpreter import InterpretedFunction

    counter = {"launches": 0, "launched": None}
    run = InterpretedFunction.run

    def counted(self, *args, grid, warmup, **kwargs):
        counter["launches"] += 1
        if counter["launched"] is not None:
            counter["launched"].append((self, args, kwargs))

    InterpretedFunction.run = counted
    try:
        yield counter
    finally:
        InterpretedFunction.run = run


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T)
    mask[0, T // 2 :] = 0
    return dict(
        logits=torch.randn(B, T + 1, V, generator=g),
        completion_ids=torch.randint(0, V, (B, T), generator=g),
        completion_mask=mask,
        advantages=torch.randn(B, generator=g),
        old_logps=-torch.rand(B, T, generator=g),
        ref_logps=-torch.rand(B, T, generator=g),
    )


def paths() -> dict[str, Callable]:
    from grpo_kernels import GRPOLoss, grpo_loss

    def ours(**kw):
        def call(x, logits):
            return grpo_loss(
                logits,
                x["completion_ids"],
                x["completion_mask"],
                x["advantages"],
                x["old_logps"],
                x["ref_logps"],
                beta=BETA,
                temperature=TEMPERATURE,
                backend="triton",
                drop_last_position=True,
                **kw,
            ).loss

        return call

    module = GRPOLoss(beta=BETA, temperature=TEMPERATURE, backend="triton", drop_last_position=True, check_ids=False)
    found = {
        "grpo_loss one-pass": ours(one_pass=True),
        "grpo_loss one-pass, check_ids=False": ours(one_pass=True, check_ids=False),
        "grpo_loss two-pass": ours(one_pass=False),
        "GRPOLoss module, check_ids=False": lambda x, logits: (
            module(
                logits, x["completion_ids"], x["completion_mask"], x["advantages"], x["old_logps"], x["ref_logps"]
            ).loss
        ),
    }
    found["autograd.Function floor (no loss)"] = _floor
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except ImportError:
        return found

    def liger(x, logits):
        return triton_grpo_loss(
            logits,
            x["old_logps"],
            x["ref_logps"],
            x["completion_ids"],
            x["advantages"],
            x["completion_mask"],
            temperature=TEMPERATURE,
            beta=BETA,
            eps_low=0.2,
            eps_high=0.2,
            inplace=False,
            loss_type="grpo",
            reduce=True,
        )[0]

    found["Liger triton_grpo_loss"] = liger
    return found


class _Floor(torch.autograd.Function):
    """What any loss written as a torch.autograd.Function costs at least: it allocates its gradient and outputs
    (the loss, a metrics vector, the log-probs) and returns the gradient; nothing is computed or launched."""

    @staticmethod
    def forward(ctx, logits, ids, mask, advantages, old_logps, ref_logps):
        grad = torch.empty(logits.shape, dtype=logits.dtype)
        loss, metrics, logp = torch.empty(()), torch.empty(5), torch.empty(ids.shape)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(metrics, logp)
        return loss, metrics, logp

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        return ctx.saved_tensors[0], None, None, None, None, None


def _floor(x, logits):
    return _Floor.apply(
        logits, x["completion_ids"], x["completion_mask"], x["advantages"], x["old_logps"], x["ref_logps"]
    )[0]


def jit_binding_us(launched, iters: int, repeats: int) -> float:
    """Host time (us) Triton's JIT spends on these launches on an sm_90 GPU before the driver call: for each,
    its binder (every argument specialized: a pointer's 16-byte alignment, an integer's value, the dtypes;
    the options) and the kernel cache key, as ``JITFunction.run`` does on every call. Timed here on the
    recorded CPU arguments (the same specialization work as CUDA tensors'); median of repeats, summed."""
    from triton import knobs
    from triton.runtime.jit import JITFunction, compute_cache_key

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from aot import jit_binder

    # the options JITFunction.run adds to every call's keywords (the set differs between Triton versions)
    run_options = {"debug": False}
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(knobs.compilation, name):
            run_options[name] = getattr(knobs.compilation, name)
    total = 0.0
    for interpreted, args, kwargs in launched:
        # what triton.jit makes without the interpreter
        binder, _ = jit_binder(JITFunction(interpreted.fn, **interpreted.kwargs), 90)
        key_cache: dict = {}
        keywords = {**kwargs, **run_options}

        def bind(binder=binder, args=args, keywords=keywords, key_cache=key_cache):
            _, specialization, options = binder(*args, **keywords)
            compute_cache_key(key_cache, specialization, options)

        bind()  # the key cache warm, as on every call after a kernel's first
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(iters):
                bind()
            times.append((time.perf_counter() - start) / iters)
        total += statistics.median(times)
    return total * 1e6


def _counts(call: Callable) -> tuple:
    """(the counts of one forward + backward of ``call``, its launches as recorded), every launch a no-op."""
    x = inputs()
    with no_op_launches() as launches:
        logits = x["logits"].clone().requires_grad_()
        call(x, logits).backward()  # warm-up (imports, caches)
        logits.grad = None
        forward, backward = OpCounter(), OpCounter()
        before = launches["launches"]
        with forward:
            loss = call(x, logits)
        with backward:
            loss.backward()
        counted_launches = launches["launches"] - before
        # the launches' arguments, recorded in a call of their own: a kept reference to the gradient would make
        # autograd copy it into .grad (two more ops) in the counted call
        logits.grad, launches["launched"] = None, []
        call(x, logits).backward()
        launched, launches["launched"] = launches["launched"], None
    return {
        "aten_ops_forward": forward.count,
        "aten_ops_backward": backward.count,
        "triton_launches": counted_launches,
    }, launched


def measure_all(calls: dict[str, Callable], iters: int, repeats: int) -> dict[str, dict[str, float]]:
    """Each path's counts, host time per forward + backward (the median of ``repeats`` rounds of ``iters`` calls)
    and JIT binding. The rounds are interleaved, every path once a round, so that a stretch of load on the
    machine lands on every path alike, not on whichever was being timed (the paths are compared in one run)."""
    results, launched = {}, {}
    for name, call in calls.items():
        results[name], launched[name] = _counts(call)
    x = inputs()
    times = {name: [] for name in calls}
    with no_op_launches():
        logits = x["logits"].clone().requires_grad_()
        for _ in range(repeats):
            for name, call in calls.items():
                start = time.perf_counter()
                for _ in range(iters):
                    logits.grad = None
                    call(x, logits).backward()
                times[name].append((time.perf_counter() - start) / iters)
    for name in calls:
        results[name].update(
            host_us=round(statistics.median(times[name]) * 1e6, 1),
            jit_binding_us=round(jit_binding_us(launched[name], iters, repeats), 1),
        )
    return results


def main(argv=None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the table here too")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host time: one thread, no pool wake-ups
    try:
        results = measure_all(paths(), args.iters, args.repeats)
    finally:
        torch.set_num_threads(threads)
    print(
        f"host work of one forward + backward, every Triton launch a no-op (B, T, V = {B}, {T}, {V}; "
        f"torch {torch.__version__}, 1 thread)"
    )
    print(f"{'path':40s} {'aten fwd':>9s} {'aten bwd':>9s} {'launches':>9s} {'host us':>9s} {'+ JIT binding us':>17s}")
    for name, r in results.items():
        print(
            f"{name:40s} {r['aten_ops_forward']:9d} {r['aten_ops_backward']:9d} {r['triton_launches']:9d} "
            f"{r['host_us']:9.1f} {r['jit_binding_us']:17.1f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [B, T, V], "torch": torch.__version__, "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
