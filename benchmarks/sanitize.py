"""The compiled kernels under NVIDIA's compute-sanitizer: memcheck, racecheck (and synccheck), errors per kernel.

    python benchmarks/sanitize.py [--budget SECONDS] [--dry-run]

Runs ``benchmarks/sanitize_cases.py`` (every kernel and schedule once at small shapes, the split-row
schedule's cooperative launch with its cross-program wait included; no pytest: a sanitized pytest selection
did not finish memcheck in the H200 run's 28 s) under each tool, then prints, per tool, the error count of
every kernel the sanitizer named, the tool's ERROR SUMMARY and how many cases ran. The bar is 0 everywhere.
The tools run one after the other while the budget lasts (memcheck first: out of bounds and misaligned
accesses are the errors a kernel change is likeliest to make). Without a GPU or without compute-sanitizer
(``--dry-run``): the commands are printed, nothing runs.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import time

# every kernel and schedule once, small shapes (a sanitized launch is 10x to 100x slower)
CASES = "benchmarks/sanitize_cases.py"
TOOLS = ("memcheck", "racecheck", "synccheck")
# where an error happened: "at 0x1a0 in kernel_name" or "at kernel_name+0x1a0" (memcheck, racecheck, synccheck)
KERNEL = re.compile(r"at (?:0x[0-9a-f]+ in )?([A-Za-z_][A-Za-z0-9_]*)(?:\+0x[0-9a-f]+|\(|\s|$)")
ERROR_START = ("Invalid", "Race", "Barrier", "Misaligned", "Error", "Uninitialized", "Divergent")
SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")


def command(tool: str, script: str = CASES) -> list:
    return [
        "compute-sanitizer",
        "--tool",
        tool,
        "--print-limit",
        "50",
        "--target-processes",
        "all",
        sys.executable,
        script,
    ]


def errors_per_kernel(text: str) -> dict:
    """Kernel name -> number of reported errors, from compute-sanitizer's '=========' lines: each error's
    first line, then its location within the next few lines."""
    lines = [line[len("=========") :].strip() for line in text.splitlines() if line.startswith("=========")]
    counts = collections.Counter()
    for i, line in enumerate(lines):
        if not line.startswith(ERROR_START) or line.startswith("ERROR SUMMARY"):
            continue
        name = "(unnamed)"
        for candidate in lines[i : i + 4]:
            found = KERNEL.search(candidate)
            if found and found.group(1) != "0x":
                name = found.group(1)
                break
        counts[name] += 1
    return dict(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=30.0)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget
    available = shutil.which("compute-sanitizer") is not None
    if args.dry_run or not available:
        print("compute-sanitizer " + ("is not installed" if not available else "dry run") + ": the commands are")
        for tool in TOOLS:
            print("  " + " ".join(command(tool)))
        return
    for tool in TOOLS:
        left = deadline - time.monotonic()
        if left < 5:
            print(f"{tool}: left out (budget spent)")
            continue
        start = time.monotonic()
        try:
            run = subprocess.run(command(tool), capture_output=True, text=True, timeout=left)
            text, status = run.stdout + run.stderr, f"rc={run.returncode}"
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            status = "time limit (partial)"
        summary = SUMMARY.findall(text)
        per_kernel = errors_per_kernel(text)
        cases = re.findall(r"\d+ of \d+ cases ran", text)
        failed = re.findall(r"^(.*): FAILED$", text, re.MULTILINE)
        print(
            f"{tool}: {status} in {time.monotonic() - start:.0f} s; ERROR SUMMARY {summary[-1] if summary else '?'} "
            f"errors; {cases[-1] if cases else 'cases: ?'}" + (f"; failed: {', '.join(failed)}" if failed else "")
        )
        for kernel, n in sorted(per_kernel.items()):
            print(f"  {kernel}: {n} errors")
        if per_kernel:
            print(
                "  first report:\n"
                + "\n".join("    " + line for line in text.split("========= ", 2)[1].splitlines()[:12])
            )


if __name__ == "__main__":
    main()
