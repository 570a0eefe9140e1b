"""What the device suite profiles with Nsight Compute: the one-pass kernel and the two-pass pair, big shape.

    ncu --clock-control none --page raw --csv --metrics ... \
        -k regex:"grpo_forward|logprob_backward" --launch-skip 4 --launch-count 3 \
        python benchmarks/ncu_target.py [--sweep OUT/sweep.json]

After the inputs' log-prob pass (1 launch), runs each mode twice at (N, V) = (16384, 151936)
bf16: a warm-up round (compiles; 3 launches: one-pass forward, two-pass forward, backward)
that ncu skips, then the 3 launches it profiles, in that order. With ``--sweep`` the sweep's
fastest exact configuration of each mode is profiled; else the launchers' defaults.
``--dry-run`` prints what it would run.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

SHAPE = (16, 1024, 151936)
KERNELS = "grpo_forward_kernel|logprob_backward_kernel"
METRICS = [
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "lts__t_sector_hit_rate.pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active",  # achieved occupancy
    "sm__inst_issued.avg.pct_of_peak_sustained_active",  # issue-slot utilization
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",  # MUFU (exp2, lg2) utilization
]
LAUNCHES_PER_ROUND = 3
LAUNCHES_BEFORE = 1 + LAUNCHES_PER_ROUND  # the inputs' log-prob pass, then the warm-up round


def ncu_command(python: str = "python", sweep: str | None = None) -> list:
    return (["ncu", "--clock-control", "none", "--page", "raw", "--csv", "--metrics", ",".join(METRICS),
             "-k", f"regex:{KERNELS}", "--launch-skip", str(LAUNCHES_BEFORE),
             "--launch-count", str(LAUNCHES_PER_ROUND), python, "benchmarks/ncu_target.py"]
            + (["--sweep", sweep] if sweep else []))


def best_configs(sweep_path: str | None) -> dict:
    """mode -> launch config: the sweep's fastest exact candidate at SHAPE's V, else None (defaults)."""
    best = {"one_pass": None, "two_pass": None}
    if not sweep_path:
        return best
    try:
        with open(sweep_path) as f:
            rows = json.load(f)["logits"]
    except (OSError, ValueError, KeyError):
        return best
    for mode in best:
        ok = [r for r in rows if r.get("status") == "ok" and r.get("exact") and r["mode"] == mode
              and r["V"] == SHAPE[2]]
        if ok:
            r = min(ok, key=lambda r: r["median_ms"])
            best[mode] = {"BLOCK_V": r["BLOCK_V"], "num_warps": r["num_warps"], "num_stages": r["num_stages"]}
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", help="a sweep.json whose winners to profile")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    configs = best_configs(args.sweep)
    if args.dry_run or not torch.cuda.is_available():
        print("ncu would run:", " ".join(ncu_command(sweep=args.sweep)))
        print(f"profiling at (B, T, V) = {SHAPE} bf16: one-pass {configs['one_pass'] or 'default config'}, "
              f"two-pass {configs['two_pass'] or 'default config'}; metrics: {', '.join(METRICS)}")
        return 0
    sys.path.insert(0, "benchmarks")
    from sweep import logits_inputs, run_logits

    x = logits_inputs(*SHAPE, "cuda")
    for _ in range(2):  # round 1 warms up (ncu skips it), round 2 is profiled
        for mode in ("one_pass", "two_pass"):
            config = configs[mode] or {"BLOCK_V": None, "num_warps": None, "num_stages": None}
            run_logits(x, {"mode": mode, **config})
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
