"""GRPO loss from logits: forward and forward + backward, every path side by side.

Run: ``python -m pytest benchmarks/ --benchmark-json=benchmarks/results/run.json`` (the GPU
suite: ``bash benchmarks/gpu_suite.sh``); ``GRPO_BENCH_SMOKE=1`` runs tiny shapes only.
Each case's ``extra_info`` holds the shapes, dtype, device, versions, GB/s from the byte
model, the fraction of a device-to-device copy's bandwidth measured in the same run, and
peak memory above the inputs (GPU). Tables: ``python benchmarks/report.py RUN.json``.
"""

import statistics

import pytest
import torch
from cases import (
    DEVICE,
    ENTROPY_FAMILY,
    ON_GPU,
    available_paths,
    environment,
    host_and_timeline_ms,
    logits_bytes,
    logprob_paths,
    make_inputs,
    model_bytes,
    path_input,
    sampling_and_distillation_bytes,
    sampling_and_distillation_paths,
    shapes,
    sync,
    warm_up_and_time,
)

_INPUTS = {}
_COPY_SECONDS = {}


def inputs_for(shape):
    if shape not in _INPUTS:
        _INPUTS.clear()  # one shape's tensors at a time
        _INPUTS[shape] = make_inputs(*shape)
    return _INPUTS[shape]


def copy_seconds(shape) -> float:
    """Median time of a device-to-device copy of S bytes (reads S, writes S), contiguous to contiguous.

    Not of the ``[:, :-1]`` view itself: torch copies a strided view far slower than a contiguous
    buffer (1.7 against 4.3 TB/s on an H200), and the reference is the hardware's copy speed.
    """
    if shape not in _COPY_SECONDS:
        full = inputs_for(shape)["full_logits"]
        B, T1, V = full.shape
        src = torch.empty(B * (T1 - 1) * V, device=full.device, dtype=full.dtype)
        src.copy_(full[:, :-1].reshape(-1))
        dst = torch.empty_like(src)
        times = []
        for _ in range(25):
            sync()
            start = torch.cuda.Event(enable_timing=True) if ON_GPU else None
            if ON_GPU:
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src)
                end.record()
                sync()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                import time

                t0 = time.perf_counter()
                dst.copy_(src)
                times.append(time.perf_counter() - t0)
        _COPY_SECONDS[shape] = statistics.median(times[5:])
    return _COPY_SECONDS[shape]


def timing_record(
    inputs: dict, shape, path: str, passes: str, level: str, moved: int, peak_extra, seconds: float, S=None
):
    """A case's ``extra_info``: its shapes, dtype, time, bytes moved by the byte model and GB/s, the fraction of a
    device-to-device copy's bandwidth measured in the same run (a copy of the whole batch's logits), peak memory above
    the inputs and the versions. ``S``: the logits the path reads (a packed batch's active tokens' alone)."""
    copy_bandwidth = 2 * logits_bytes(inputs) / copy_seconds(shape)
    S = logits_bytes(inputs) if S is None else S
    B, T, V = shape
    return {
        "path": path,
        "N": B * T,
        "B": B,
        "T": T,
        "V": V,
        "dtype": str(inputs["full_logits"].dtype).replace("torch.", ""),
        "pass": passes,
        "level": level,
        "logits_bytes": S,
        "median_ms": seconds * 1e3,
        "model_bytes": moved,
        "model_GBps": moved / seconds / 1e9,
        "copy_GBps": copy_bandwidth / 1e9,
        "fraction_of_copy": moved / seconds / copy_bandwidth,
        "peak_extra_bytes": peak_extra,
        "peak_extra_over_S": None if peak_extra is None else peak_extra / S,
        **environment(),
    }


def _cases():
    """Every path, shape, pass and level; torch.compile only at the largest shape, token level (each
    of its cases compiles a graph for many seconds, and a first GPU run lost its time to them),
    and its cases last, as their compile time is what a time limit should cut first."""
    cases = []
    for level in ("token", "sequence"):
        level_shapes = shapes() if level == "token" else shapes()[-1:]
        for shape in level_shapes:
            for name in available_paths(level):
                if name in ("torch.compile", "ours one-pass packed", *ENTROPY_FAMILY) and (
                    level != "token" or shape != shapes()[-1]
                ):
                    continue
                for backward in (False, True):
                    label = f"{name}-{'x'.join(map(str, shape))}-{'fwd+bwd' if backward else 'fwd'}-{level}"
                    cases.append(pytest.param(name, shape, backward, level, id=label))
    return sorted(cases, key=lambda case: case.values[0] == "torch.compile")  # stable: the rest keep their order


@pytest.mark.parametrize("name, shape, backward, level", _cases())
def test_grpo_loss(benchmark, name, shape, backward, level):
    inputs = inputs_for(shape)
    fn = available_paths(level)[name]
    full = inputs["full_logits"]

    def call():
        leaf, given = path_input(name, full, inputs, requires_grad=backward)
        if backward:
            torch.autograd.grad(fn(inputs, given), leaf)
        else:
            with torch.no_grad():
                fn(inputs, given)

    def step():
        call()
        sync()

    # pytest-benchmark's table a group a (shape, pass, level): fwd beside fwd, fwd+bwd beside fwd+bwd
    benchmark.group = f"loss {'x'.join(map(str, shape))} {'fwd+bwd' if backward else 'fwd'} {level} level"
    peak_extra = warm_up_and_time(benchmark, step, rounds=5 if DEVICE == "cpu" else 20)
    if benchmark.stats is None:  # --benchmark-disable: the path ran once, nothing was timed
        return
    host_ms, timeline_ms = host_and_timeline_ms(call, repeats=3 if DEVICE == "cpu" else 5)  # (the stage's time limit)
    seconds = benchmark.stats.stats.median
    S = logits_bytes(inputs)
    if name.endswith("packed"):  # only the active tokens' logits exist
        S = S * float((inputs["completion_mask"] != 0).float().mean())
    moved = model_bytes(name, S, backward)
    passes = "fwd+bwd" if backward else "fwd"
    benchmark.extra_info.update(
        {
            **timing_record(inputs, shape, name, passes, level, moved, peak_extra, seconds, S),
            "host_ms": host_ms,
            "timeline_ms": timeline_ms,
        }
    )


@pytest.mark.parametrize(
    "name, shape",
    [
        pytest.param(name, shape, id=f"logprobs-{name}-{'x'.join(map(str, shape))}")
        for shape in shapes()
        for name in logprob_paths()
    ],
)
def test_logprob_pass(benchmark, name, shape):
    """The old / reference log-prob pass (``cases.logprob_paths``): forward only, no gradient; byte model S."""
    inputs = inputs_for(shape)
    fn = logprob_paths()[name]

    def step():
        with torch.no_grad():
            fn(inputs)
        sync()

    benchmark.group = f"log-prob pass {'x'.join(map(str, shape))} fwd"
    peak_extra = warm_up_and_time(benchmark, step, rounds=5 if DEVICE == "cpu" else 20)
    if benchmark.stats is None:
        return
    seconds = benchmark.stats.stats.median
    record = timing_record(inputs, shape, name, "fwd", "token", logits_bytes(inputs), peak_extra, seconds)
    benchmark.extra_info.update({"suite": "logprobs", **record})


@pytest.mark.parametrize(
    "name, shape",
    [
        pytest.param(name, shape, id=f"sampling-distillation-{name}-{'x'.join(map(str, shape))}")
        for shape in shapes()
        for name in sampling_and_distillation_paths()
    ],
)
def test_kept_set_and_distillation(benchmark, name, shape):
    """What the sampler's kept set adds to the loss (forward + backward, against the same call without it), and the
    top-k forward KL of distillation against the eager one: time, GB/s by the byte model, peak memory."""
    inputs = inputs_for(shape)
    fn = sampling_and_distillation_paths()[name]
    full = inputs["full_logits"]

    def step():
        leaf = full.detach().requires_grad_()
        torch.autograd.grad(fn(inputs, leaf), leaf)
        sync()

    benchmark.group = f"kept set and distillation {'x'.join(map(str, shape))} fwd+bwd"
    peak_extra = warm_up_and_time(benchmark, step, rounds=5 if DEVICE == "cpu" else 20)
    if benchmark.stats is None:
        return
    seconds = benchmark.stats.stats.median
    moved = sampling_and_distillation_bytes(name, logits_bytes(inputs), inputs)
    record = timing_record(inputs, shape, name, "fwd+bwd", "token", moved, peak_extra, seconds)
    benchmark.extra_info.update({"suite": "sampling_distillation", **record})
