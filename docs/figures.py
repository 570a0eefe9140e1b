"""The results page's figures, each drawn from a committed measurement file (never by hand), each labelled with the
hardware and the commit or date that measured it:

- ``memory-by-length.png``: peak memory above the inputs against the completion length, the loss from materialized
  logits (the eager reference, ours) and the fused lm_head, on the CPU, beside the byte model's 2 S
  (``benchmarks/results/memory-by-length-cpu.json``, ``benchmarks/memory_by_length.py``);
- ``peers-cpu.png``: each loss type's forward + backward on the CPU, the eager loss, torch.compile of it and TRL's
  own path over ours (``benchmarks/results/peers-cpu.json``, ``benchmarks/peers_cpu.py``);
- ``cpu-ratios.png``: the CPU torch path against the eager reference in one run: each loss type against the commit
  before the families (``loss-types-cpu.json``), the kept set's and the distillation's ratios
  (``kept-set-cpu.json``, ``distillation-cpu.json``);
- ``learning-seeds.png``: held-out accuracy at step 0 and at the end of each seed of each recipe
  (``benchmarks/results/learning/*.json``);
- ``gpu-loss-time.png``: forward + backward time of the loss per shape on the GPU against Liger-Kernel, TRL's Triton
  kernel and the eager reference, and each as GB/s from the byte model (2 S over the time)
  (``benchmarks/results/gpu/bench.json``: its machine and commit).

    python docs/figures.py [--out docs/figures]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _load(relative: str):
    return json.loads((RESULTS / relative).read_text())


def _save(plt, fig, path: pathlib.Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def memory_by_length(plt, out: pathlib.Path) -> None:
    rows = _load("memory-by-length-cpu.json")
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for path in dict.fromkeys(r["path"] for r in rows):
        mine = sorted((r for r in rows if r["path"] == path), key=lambda r: r["T"])
        ax.plot([r["T"] for r in mine], [r["peak_extra_bytes"] / 2**20 for r in mine], marker="o", label=path)
    lengths = sorted({r["T"] for r in rows})
    first = rows[0]
    two_s = [2 * first["B"] * T * first["V"] * 4 / 2**20 for T in lengths]
    ax.plot(lengths, two_s, linestyle="--", color="gray", label="byte model: logits + gradient (2 S)")
    ax.set(
        xlabel="completion length T (B = 8)",
        ylabel="peak memory above the inputs (MiB)",
        title=f"Loss forward + backward, V = {first['V']}, H = {first['H']}, fp32\n"
        f"CPU ({first['cpu']}), torch {first['torch']}, commit {first.get('commit', '?')}",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.legend(fontsize=8, loc="center right")
    _save(plt, fig, out / "memory-by-length.png")


def cpu_ratios(plt, out: pathlib.Path) -> None:
    types = _load("loss-types-cpu.json")
    kept = _load("kept-set-cpu.json")
    distill = _load("distillation-cpu.json")
    labels, values = [], []
    for name, r in types["loss_types"].items():
        labels.append(f"{name}: this / {types['ref']}")
        values.append(r["ratio"])
    for name, r in kept["results"].items():
        labels.append(f"kept set, {name}")
        values.append(r["ratio"])
    for r in distill:
        labels.append(f"distillation, {r['path']} / verl default")
        values.append(r["time_ratio"])
    fig, ax = plt.subplots(figsize=(7, 0.32 * len(labels) + 1.4))
    ax.barh(
        range(len(labels)),
        values,
        color=["tab:blue"] * len(types["loss_types"]) + ["tab:orange"] * (len(labels) - len(types["loss_types"])),
    )
    ax.axvline(1.0, color="gray", linestyle="--")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set(
        xlabel="time ratio (1 = the same)",
        title=f"CPU time ratios, one run each (torch {kept['torch']}, {kept['machine']})",
    )
    _save(plt, fig, out / "cpu-ratios.png")


def learning_seeds(plt, out: pathlib.Path) -> None:
    files = sorted((RESULTS / "learning").glob("*.json"))
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(files) + 1.4))
    for i, path in enumerate(files):
        runs = json.loads(path.read_text())["runs"]
        firsts = [r["first_eval_accuracy"] * 100 for r in runs]
        finals = [r["final_eval_accuracy"] * 100 for r in runs]
        ax.scatter(firsts, [i - 0.12] * len(runs), color="tab:gray", s=12, label="step 0" if i == 0 else None)
        ax.scatter(finals, [i + 0.12] * len(runs), color="tab:green", s=12, label="at the end" if i == 0 else None)
    ax.set_yticks(range(len(files)), [f"{p.stem} ({len(json.loads(p.read_text())['runs'])})" for p in files],
                  fontsize=8)  # fmt: skip
    ax.invert_yaxis()
    ax.set(xlabel="held-out greedy accuracy (%)", title="The built-in task, each seed (2-core AMD EPYC, CPU)")
    ax.legend(fontsize=8, loc="lower left")
    _save(plt, fig, out / "learning-seeds.png")


def gpu_loss_time(plt, out: pathlib.Path) -> None:
    bench = _load("gpu/bench.json")
    commit = bench.get("commit_info", {}).get("id", "?")[:7]
    times: dict = {}
    for b in bench["benchmarks"]:
        match = re.match(r"test_grpo_loss\[(.+)-(\d+x\d+x\d+)-fwd\+bwd-token\]", b["name"])
        if match:
            times.setdefault(match.group(2), {})[match.group(1)] = b["stats"]["median"] * 1e3
    paths = ["ours one-pass", "ours two-pass", "liger", "trl (triton kernel)", "eager"]
    shapes = list(times)
    fig, (ax, bw) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(paths)
    for k, path in enumerate(paths):
        xs = [i + k * width for i in range(len(shapes))]
        ms = [times[s].get(path, 0.0) for s in shapes]
        ax.bar(xs, ms, width, label=path)
        # the byte model: forward + backward moves at least 2 S (read the bf16 logits once, write their gradient)
        two_s = [2 * 2 * _tokens_times_vocab(s) for s in shapes]
        bw.bar(xs, [b / (m * 1e-3) / 1e9 if m else 0.0 for b, m in zip(two_s, ms, strict=True)], width, label=path)
    labels = [s.replace("x", " x ") for s in shapes]
    for axis in (ax, bw):
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], labels, fontsize=8)
    ax.set_yscale("log")
    gpu = bench.get("machine_info", {}).get("gpu", "one H200")
    ax.set(xlabel="B x T x V (bf16)", ylabel="forward + backward, median (ms)", title="Time")
    bw.set(xlabel="B x T x V (bf16)", ylabel="GB/s from the byte model (2 S / time)",
           title="Bandwidth (the byte model's 2 S over the time)")  # fmt: skip
    ax.legend(fontsize=8)
    fig.suptitle(f"The loss on the GPU ({gpu}), commit {commit}")
    _save(plt, fig, out / "gpu-loss-time.png")


def _tokens_times_vocab(shape: str) -> int:
    B, T, V = (int(x) for x in shape.split("x"))
    return B * T * V


def peers_cpu(plt, out: pathlib.Path) -> None:
    run = _load("peers-cpu.json")
    loss_types = list(run["results"])
    paths = list(next(iter(run["results"].values()))["over_ours"])
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(paths)
    for k, path in enumerate(paths):
        ax.bar([i + k * width for i in range(len(loss_types))],
               [run["results"][t]["over_ours"][path] for t in loss_types], width, label=path)  # fmt: skip
    ax.axhline(1.0, color="gray", linestyle="--")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(loss_types))], loss_types, fontsize=8)
    shape = run["shape"]
    ax.set(
        ylabel="time / ours (above 1: ours is faster)",
        title=f"Forward + backward on the CPU, {shape['B']} x {shape['T']} x {shape['V']} fp32, one thread\n"
        f"(torch {run['torch']}, TRL {run['trl']}, {run['machine']}, commit {run['commit']})",
    )
    ax.legend(fontsize=8)
    _save(plt, fig, out / "peers-cpu.png")


FIGURES = (memory_by_length, peers_cpu, cpu_ratios, learning_seeds, gpu_loss_time)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "figures"))
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for figure in FIGURES:
        figure(plt, out)
        print(f"{figure.__name__}: {out}")


if __name__ == "__main__":
    main()
