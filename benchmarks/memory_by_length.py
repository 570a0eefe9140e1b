"""CPU: peak memory above the inputs against the completion length, for the loss from materialized logits (eager
reference and ours), the fused lm_head and stock TRL 1.16's own fused head, forward + backward
(``cpu_fused_linear_memory.py``'s paths, each in a fresh process), B = 8 completions of T tokens, H = 256,
V = 32000, fp32. The byte model's line beside them: the logits (S = N V 4 bytes) and their gradient, 2 S, what a
loss from materialized logits cannot go below.

    cd benchmarks && python memory_by_length.py [--lengths 128 256 512 1024] [--json results/memory-by-length-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import subprocess

from rss import run_each

HERE = pathlib.Path(__file__).resolve().parent
B, H, V = 8, 256, 32000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from cpu_fused_linear_memory import PATHS

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()

    rows = []
    for T in args.lengths:
        n = B * T
        for r in run_each(
            str(HERE / "cpu_fused_linear_memory.py"),
            PATHS,
            ["--n", str(n), "--b", str(B), "--h", str(H), "--v", str(V)],
        ):
            if r["rows"] != B or r["N"] != n:
                raise RuntimeError(f"{r['path']} ran {r['rows']} rows, {r['N']} tokens; asked {B} rows of {T}")
            r.update(B=B, T=T, cpu=platform.processor() or platform.machine(), commit=commit)
            rows.append(r)
            print(
                f"T = {T:5}  {r['path']:22} {r['peak_extra_bytes'] / 2**20:8.0f} MiB  {r['seconds']:6.2f} s", flush=True
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
