"""What the device suite profiles with Nsight Compute: the one-pass kernel on its read-once schedule (persistent,
the rows in flight within L2, eviction hints), the one-pass kernel a program a token, and the split-row kernel
with a chunk held in registers, big shape.

    ncu --clock-control none --page raw --csv --metrics ... \
        -k regex:"grpo_forward|split_row_forward" --launch-skip 4 --launch-count 3 \
        python benchmarks/ncu_target.py [--sweep OUT/sweep.json]

After the inputs' log-prob pass (1 launch), runs each schedule twice at (N, V) = (16384, 151936) bf16: a
warm-up round (compiles; 3 launches, in SCHEDULES' order) that ncu skips, then the 3 launches it profiles,
in that order. Each writes dlogits in its one launch: 2 S under the byte model if every logit is read from
HBM once (the DRAM read / S column says how close each comes; the L2 hit rate, why). With ``--sweep`` the
sweep's fastest exact configuration of each is profiled; else defaults (the two-pass pair and the split-row
kernel's streamed variant, measured by the first runs, are left out: the stage's time). ``--dry-run`` prints
what it would run.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from grpo_kernels.kernels.tuned import LOGITS_KEYS

SHAPE = (16, 1024, 151936)
KERNELS = "grpo_forward_kernel|split_row_forward_kernel"
METRICS = [
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "lts__t_sector_hit_rate.pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active",  # achieved occupancy
    "sm__inst_issued.avg.pct_of_peak_sustained_active",  # issue-slot utilization
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",  # MUFU (exp2, lg2) utilization
]
# (schedule, its label in the report, the kernel it launches, its configuration without a sweep), in launch order
SCHEDULES = [
    (
        "one_pass_l2",
        "one-pass, persistent within L2, L2 hints",
        "grpo_forward_kernel",
        {"programs_per_sm": "l2", "l2_hints": True, "BLOCK_V": 4096, "num_warps": 16},
    ),
    ("one_pass", "one-pass forward (writes dlogits), a program a token", "grpo_forward_kernel", {}),
    (
        "split_row_held",
        "split-row, a chunk held in registers",
        "split_row_forward_kernel",
        {"split_row": 64, "BLOCK_V": 4096, "num_warps": 4},
    ),
]
LAUNCHES_PER_ROUND = len(SCHEDULES)
LAUNCHES_BEFORE = 1 + LAUNCHES_PER_ROUND  # the inputs' log-prob pass, then the warm-up round


def ncu_command(python: str = "python", sweep: str | None = None) -> list:
    return [
        "ncu",
        "--clock-control",
        "none",
        "--page",
        "raw",
        "--csv",
        "--metrics",
        ",".join(METRICS),
        "-k",
        f"regex:{KERNELS}",
        "--launch-skip",
        str(LAUNCHES_BEFORE),
        "--launch-count",
        str(LAUNCHES_PER_ROUND),
        python,
        "benchmarks/ncu_target.py",
    ] + (["--sweep", sweep] if sweep else [])


def launch_labels(kernel_names) -> list:
    """The report's label of each profiled launch, from its kernel's name and how many of that kernel came
    before it (the rounds' order is SCHEDULES')."""
    seen: dict = {}
    labels = []
    for name in kernel_names:
        of_kernel = [label for _, label, kernel, _ in SCHEDULES if kernel in name]
        labels.append(of_kernel[seen.get(name, 0)] if seen.get(name, 0) < len(of_kernel) else name)
        seen[name] = seen.get(name, 0) + 1
    return labels


def schedule_of(row: dict) -> str:
    """Which schedule a sweep row (mode one_pass) runs: one of SCHEDULES, or "split_row_streamed" (not profiled)."""
    if not row.get("split_row"):
        return "one_pass_l2" if row.get("programs_per_sm") else "one_pass"
    from grpo_kernels.kernels import split_row_launch

    held = split_row_launch.split_row_chunks(row["V"], row["BLOCK_V"], row["split_row"]).held
    return "split_row_held" if held else "split_row_streamed"


def best_configs(sweep_path: str | None) -> dict:
    """schedule -> launch config: the sweep's fastest exact candidate of it at SHAPE's V, else SCHEDULES'."""
    best = {name: dict(default) for name, _, _, default in SCHEDULES}
    if not sweep_path:
        return best
    try:
        with open(sweep_path) as f:
            rows = json.load(f)["logits"]
    except (OSError, ValueError, KeyError):
        return best
    ok = [
        r for r in rows if r.get("status") == "ok" and r.get("exact") and r["mode"] == "one_pass" and r["V"] == SHAPE[2]
    ]
    for name in best:
        mine = [r for r in ok if schedule_of(r) == name]
        if mine:
            r = min(mine, key=lambda r: r["median_ms"])
            best[name] = {k: r.get(k) for k in LOGITS_KEYS}
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", help="a sweep.json whose winners to profile")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    configs = best_configs(args.sweep)
    if args.dry_run or not torch.cuda.is_available():
        print("ncu would run:", " ".join(ncu_command(sweep=args.sweep)))
        print(
            f"profiling at (B, T, V) = {SHAPE} bf16: "
            + "; ".join(f"{label} {configs[name] or 'default config'}" for name, label, _, _ in SCHEDULES)
            + f"; metrics: {', '.join(METRICS)}"
        )
        return 0
    sys.path.insert(0, "benchmarks")
    from sweep import logits_inputs, run_logits

    x = logits_inputs(*SHAPE, "cuda")
    for _ in range(2):  # round 1 warms up (ncu skips it), round 2 is profiled
        for name, _, _, _ in SCHEDULES:  # (run_logits: a schedule the config leaves unset is off)
            run_logits(x, {"mode": "one_pass", **{k: configs[name].get(k) for k in LOGITS_KEYS}})
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
