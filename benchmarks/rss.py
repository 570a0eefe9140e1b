"""Peak resident memory of one step above what is resident before it (Linux /proc), for the CPU benchmarks.

The peak-RSS mark is reset (``/proc/self/clear_refs``) after the inputs exist, the step
runs, and the peak (VmHWM) minus the baseline (VmRSS) is what the step allocated.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(step: Callable[[], None]) -> tuple[float, int]:
    """(seconds, peak bytes above the baseline) of one call of ``step`` (warm it up first)."""
    gc.collect()
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark to the current RSS
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return seconds, (_status_kib("VmHWM") - base) * 1024


def run_each(script: str, paths: Sequence[str], extra_args: list[str]) -> list[dict]:
    """Run ``script --one PATH`` in a fresh process per path (a clean heap each) and collect its JSON line."""
    results = []
    for path in paths:
        out = subprocess.run(
            [sys.executable, script, "--one", path, *extra_args], capture_output=True, text=True, check=True
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results
