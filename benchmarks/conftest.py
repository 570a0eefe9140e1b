"""The benchmarks run the compiled kernels on a GPU; on a CPU they compare the CPU paths only."""

import os

import torch

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # only the kernels' import needs it; CPU cases use the torch path


SMOKE_NOTE = (
    "smoke mode (GRPO_BENCH_SMOKE=1): one small shape, 5 rounds a path, to show every path runs; each time "
    "still carries its path's fixed host cost (Python, dispatch, allocations), which training shapes "
    "amortize; for the speed at training shapes run without it"
)


def pytest_report_header(config):
    """A smoke run says what its times are, at the top of its output."""
    if os.environ.get("GRPO_BENCH_SMOKE") == "1":
        return SMOKE_NOTE
    return None


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """... and again under pytest-benchmark's table."""
    if os.environ.get("GRPO_BENCH_SMOKE") == "1":
        terminalreporter.write_line(SMOKE_NOTE)


def pytest_benchmark_generate_machine_info():
    """pytest-benchmark's machine info without py-cpuinfo, whose probe runs for seconds on a many-core
    machine: the device suite's time limit once landed inside it, and the run's JSON was lost.
    The CPU's name comes from /proc/cpuinfo; everything else is what pytest-benchmark records."""
    import platform

    cpu = {"count": os.cpu_count(), "arch": platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu["brand_raw"] = names[0]
    except OSError:
        pass
    return {
        "node": platform.node(),
        "processor": platform.processor(),
        "machine": platform.machine(),
        "python_compiler": platform.python_compiler(),
        "python_implementation": platform.python_implementation(),
        "python_implementation_version": platform.python_version(),
        "python_version": platform.python_version(),
        "python_build": platform.python_build(),
        "release": platform.release(),
        "system": platform.system(),
        "cpu": cpu,
    }
