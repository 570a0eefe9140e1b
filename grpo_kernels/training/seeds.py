"""``grpo-kernels seeds``: one training command over several seeds, judged by its spread.

RL turns a last-bit difference in floating point (another CPU, another BLAS) into another
trajectory within a few steps, so one run says little about a recipe: this runs ``grpo-kernels
train`` once per seed (``--jobs`` at a time, the cores shared among them) and reports, per seed
and as minimum / median / maximum, the held-out accuracy at the start and the end, the best
evaluation and how far the end fell below it (a collapse), the zero-std share of the last steps
and the time (``--script`` runs another training script the same way, such as the reward-model
example). Each run keeps its own folder (``seed-N/``: metrics, curves, checkpoints, log, and ``run.json``
once it has finished); the table goes to ``seeds.json`` beside them. Started again after a kill with the same
command, a sweep reuses the finished seeds and resumes the unfinished ones from their checkpoints.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

LAST_STEPS = 10  # the zero-std share at the end: the mean over this many last steps
TARGET_ACCURACY = 0.9  # sample efficiency: what a run sampled before its held-out accuracy first reached this
# Student's t, the 97.5 % quantile by degrees of freedom (a two-sided 95 % interval of a mean over n seeds takes n - 1)
T_975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    16: 2.120,
    17: 2.110,
    18: 2.101,
    19: 2.093,
    20: 2.086,
    25: 2.060,
    30: 2.042,
    40: 2.021,
    60: 2.000,
    120: 1.980,
}


def mean_ci95(values: Sequence[float]) -> dict[str, float] | None:
    """The mean over seeds with its 95 % confidence interval (Student's t with n - 1 degrees of freedom, the largest
    tabled at or below it; an interval of one seed is unknown): {"mean", "low", "high", "half_width", "n"}."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    n, mean = len(values), statistics.fmean(values)
    if n == 1:
        return {"mean": mean, "low": None, "high": None, "half_width": None, "n": 1}
    t = T_975[max(df for df in T_975 if df <= n - 1)]
    half = t * statistics.stdev(values) / n**0.5
    return {"mean": mean, "low": mean - half, "high": mean + half, "half_width": half, "n": n}


def sampled_to_target(records: list[dict], target: float) -> dict[str, int | None]:
    """The completions and tokens a run sampled in its GRPO steps before its held-out accuracy first reached
    ``target`` (None where it never did; 0 where it started there)."""
    completions = tokens = 0
    for record in records:
        if "eval_accuracy" in record and record["eval_accuracy"] >= target:
            return {"completions_to_target": completions, "tokens_to_target": tokens}
        completions += record.get("completions_sampled", 0)
        tokens += record.get("tokens_sampled", 0)
    return {"completions_to_target": None, "tokens_to_target": None}


def run_summary(metrics_path: str, target: float = TARGET_ACCURACY) -> dict[str, float]:
    """One run's figures from its ``metrics.jsonl`` (and its ``summary.json``, where the run wrote one: its peak
    memory)."""
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    written = _read_json(os.path.join(os.path.dirname(metrics_path), "summary.json")) or {}
    evals = [r["eval_accuracy"] for r in records if "eval_accuracy" in r]
    steps = [r for r in records if "reward" in r]
    tail = steps[-LAST_STEPS:]
    warmup = next((r for r in records if "warmup_steps" in r), {})
    eval_malformed = [r["eval_malformed"] for r in records if "eval_malformed" in r]
    return {
        **{k: v for k, v in warmup.items() if k != "step"},  # the format warm-up's steps, rate and time
        "final_eval_malformed": eval_malformed[-1] if eval_malformed else None,
        "first_eval_accuracy": evals[0] if evals else None,
        "final_eval_accuracy": evals[-1] if evals else None,
        "best_eval_accuracy": max(evals) if evals else None,
        "drop_from_best": max(evals) - evals[-1] if evals else None,
        "final_zero_std_groups": sum(r["zero_std_groups"] for r in tail) / len(tail) if tail else None,
        "steps": steps[-1]["step"] if steps else 0,
        "completions_sampled": sum(r.get("completions_sampled", 0) for r in steps),
        "tokens_sampled": sum(r.get("tokens_sampled", 0) for r in steps),
        **sampled_to_target(records, target),
        **{k: written[k] for k in ("peak_rss_mib", "peak_cuda_mib") if k in written},
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


RUN_RECORD = "run.json"  # in seed-N/: the finished run's summary and the command it ran, written last
CONSOLE_LOG = "console.log"  # in seed-N/: what the run printed (its own train.log is beside it)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _train_one(
    seed: int,
    output_dir: str,
    train_args: Sequence[str],
    threads: int,
    script: str | None,
    target: float = TARGET_ACCURACY,
) -> dict[str, float]:
    """One seed's run and its summary. A sweep that was killed and started again with the same command reuses
    a seed's finished run (its ``run.json``) and resumes an unfinished ``grpo-kernels train`` run from its last
    checkpoint (``--resume``): no seed runs twice, none is counted twice."""
    from .checkpoint import latest_checkpoint

    run_dir = os.path.join(output_dir, f"seed-{seed}")
    os.makedirs(run_dir, exist_ok=True)
    program = [script] if script else ["-m", "grpo_kernels", "train", "--no-progress"]
    command = [*program, *train_args, "--seed", str(seed), "--output-dir", run_dir]
    finished = _read_json(os.path.join(run_dir, RUN_RECORD))
    if finished is not None and finished.get("command") == command:  # (its figures again: another target, say)
        summary = {**finished["summary"], **run_summary(os.path.join(run_dir, "metrics.jsonl"), target)}
        return {**summary, "reused": True}
    started_before = _read_json(os.path.join(run_dir, "attempt.json"))
    resume = (
        script is None
        and started_before is not None
        and started_before.get("command") == command
        and latest_checkpoint(run_dir) is not None
    )
    with open(os.path.join(run_dir, "attempt.json"), "w") as f:
        json.dump({"command": command}, f)
    # each run its share of the cores, its OpenMP threads waiting passively (a spinning pool slowed a run sharing 2
    # cores with one busy process 4x, 1.9x once passive)
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
    )
    started = time.time()
    with open(os.path.join(run_dir, CONSOLE_LOG), "a" if resume else "w") as log:
        done = subprocess.run(
            [sys.executable, *command, *(["--resume"] if resume else [])], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    if done.returncode != 0:
        raise RuntimeError(
            f"seed {seed}: `{' '.join(command)}` exited with {done.returncode}; "
            f"see {os.path.join(run_dir, CONSOLE_LOG)} and train.log there"
        )
    summary = {
        "seed": seed,
        **run_summary(os.path.join(run_dir, "metrics.jsonl"), target),
        "seconds": round(time.time() - started, 1),  # (a resumed run's: since the resume)
        **({"resumed": True} if resume else {}),
    }
    tmp = os.path.join(run_dir, RUN_RECORD + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"command": command, "summary": summary}, f)
    os.replace(tmp, os.path.join(run_dir, RUN_RECORD))
    return summary


def run_seeds(
    seeds: Sequence[int],
    output_dir: str,
    train_args: Sequence[str],
    jobs: int = 1,
    script: str | None = None,
    target: float = TARGET_ACCURACY,
) -> dict:
    """Train once per seed (``jobs`` at a time) and summarize; writes ``output_dir/seeds.json`` and
    ``output_dir/curves.png`` (every seed's held-out accuracy and reward, the band across seeds).

    Reported apart, as the GRPO guide asks: the final held-out accuracy as its mean over seeds with a 95 %
    confidence interval (and the min / median / max), sample efficiency (completions and tokens sampled before
    the held-out accuracy first reached ``target``), wall-clock time and peak memory per run.

    ``script``: a Python script to run instead of ``grpo-kernels train`` (the reward-model example), which
    takes ``--seed`` and ``--output-dir`` and writes the trainer's ``metrics.jsonl`` there."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if not seeds:
        raise ValueError("seeds must name at least one seed, got none")
    for flag in ("--seed", "--output-dir"):
        if any(a == flag or a.startswith(flag + "=") for a in train_args):
            raise ValueError(f"{flag} is set per run by `grpo-kernels seeds`; drop it from the training arguments")
    os.makedirs(output_dir, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // min(jobs, len(seeds)))
    started = time.time()
    runs: list[dict] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for run in pool.map(lambda s: _train_one(s, output_dir, train_args, threads, script, target), seeds):
            runs.append(run)
            print(format_run(run), flush=True)
    finals = [r["final_eval_accuracy"] for r in runs]
    result = {
        "command": script or "grpo-kernels train",
        "train_args": list(train_args),
        "jobs": jobs,
        "threads_per_run": threads,
        "runs": runs,
        "final_eval_accuracy": spread(finals),
        "final_eval_accuracy_mean": mean_ci95(finals),
        "first_eval_accuracy": spread([r["first_eval_accuracy"] for r in runs]),
        "target_accuracy": target,
        "reached_target": sum(r["completions_to_target"] is not None for r in runs),
        "completions_to_target": _spread_of_known([r["completions_to_target"] for r in runs]),
        "tokens_to_target": _spread_of_known([r["tokens_to_target"] for r in runs]),
        "peak_rss_mib": _spread_of_known([r.get("peak_rss_mib") for r in runs]),
        "peak_cuda_mib": _spread_of_known([r.get("peak_cuda_mib") for r in runs]),
        "largest_drop_from_best": max(r["drop_from_best"] for r in runs),
        "final_zero_std_groups": spread([r["final_zero_std_groups"] for r in runs]),
        "seconds_per_run": spread([r["seconds"] for r in runs]),
        "wall_seconds": round(time.time() - started, 1),
    }
    with open(os.path.join(output_dir, "seeds.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot_band(
        [os.path.join(output_dir, f"seed-{r['seed']}", "metrics.jsonl") for r in runs],
        os.path.join(output_dir, "curves.png"),
    )
    return result


def _spread_of_known(values: Sequence[float | None]) -> dict[str, float] | None:
    known = [v for v in values if v is not None]
    return spread(known) if known else None


def plot_band(metrics_paths: Sequence[str], path: str) -> None:
    """``curves.png`` of a sweep: each seed's held-out accuracy and reward (thin lines), their mean (bold) and the
    band from the lowest to the highest seed at each step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {"eval_accuracy": {}, "reward": {}}
    for metrics_path in metrics_paths:
        with open(metrics_path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        for key, by_seed in series.items():
            by_seed[metrics_path] = {r["step"]: r[key] for r in records if key in r and r[key] is not None}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for axis, (key, by_seed) in zip(axes, series.items(), strict=True):
        steps = sorted({s for points in by_seed.values() for s in points})
        for points in by_seed.values():
            axis.plot(sorted(points), [points[s] for s in sorted(points)], color="0.7", linewidth=0.8)
        shared = [s for s in steps if all(s in points for points in by_seed.values())]
        if shared:
            at = [[points[s] for points in by_seed.values()] for s in shared]
            axis.fill_between(shared, [min(v) for v in at], [max(v) for v in at], alpha=0.25, label="min to max")
            axis.plot(shared, [statistics.fmean(v) for v in at], linewidth=2, label=f"mean of {len(by_seed)} seeds")
        axis.set_title("held-out accuracy" if key == "eval_accuracy" else "reward of the sampled completions")
        axis.set_xlabel("GRPO step")
        axis.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_run(run: dict) -> str:
    return (
        f"seed {run['seed']}: {100 * run['first_eval_accuracy']:.1f} % -> {100 * run['final_eval_accuracy']:.1f} %"
        f" (best {100 * run['best_eval_accuracy']:.1f} %), zero-std share at the end "
        f"{100 * run['final_zero_std_groups']:.0f} %, {run['seconds']:.0f} s"
    )


def format_summary(result: dict) -> str:
    pct = lambda d: f"{100 * d['min']:.1f} / {100 * d['median']:.1f} / {100 * d['max']:.1f} %"  # noqa: E731
    secs = result["seconds_per_run"]
    mean = result["final_eval_accuracy_mean"]
    interval = (
        f"{100 * mean['mean']:.1f} % +- {100 * mean['half_width']:.1f} (95 % CI over {mean['n']} seeds)"
        if mean and mean["half_width"] is not None
        else "one seed: no interval"
    )
    target, reached = result["target_accuracy"], result["reached_target"]
    to_target = result["completions_to_target"]
    tokens = result["tokens_to_target"]
    efficiency = (
        f"median {to_target['median']:.0f} completions / {tokens['median']:.0f} tokens sampled "
        f"({reached} of {len(result['runs'])} seeds got there)"
        if to_target
        else f"no seed reached it in {len(result['runs'])}"
    )
    memory = result["peak_rss_mib"]
    return "\n".join(
        [
            f"{len(result['runs'])} seeds:",
            f"  held-out accuracy at the end  {interval}",
            f"  sample efficiency, to {100 * target:.0f} % held-out accuracy  {efficiency}",
            "  min / median / max:",
            f"  held-out accuracy at step 0   {pct(result['first_eval_accuracy'])}",
            f"  held-out accuracy at the end  {pct(result['final_eval_accuracy'])}",
            f"  largest drop from a seed's best evaluation  {100 * result['largest_drop_from_best']:.1f} points",
            f"  zero-std share, last {LAST_STEPS} steps  {pct(result['final_zero_std_groups'])}",
            f"  time per run  {secs['min']:.0f} / {secs['median']:.0f} / {secs['max']:.0f} s "
            f"({result['jobs']} at a time, {result['threads_per_run']} threads each; "
            f"{result['wall_seconds']:.0f} s in all)",
            *(
                [
                    f"  peak memory per run (resident)  {memory['min']:.0f} / {memory['median']:.0f} / "
                    f"{memory['max']:.0f} MiB"
                ]
                if memory
                else []
            ),
            *(
                [f"  peak CUDA memory per run  {result['peak_cuda_mib']['median']:.0f} MiB (median)"]
                if result["peak_cuda_mib"]
                else []
            ),
        ]
    )
