"""Turn a saved pytest-benchmark JSON into a markdown table (and a plot) for the README.

    python benchmarks/report.py benchmarks/results/RUN.json [--plot benchmarks/results/RUN.png]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def load(path: str, suite: str = "loss"):
    """The cases of one suite: "loss" (from logits) or "fused_linear" (from hidden states)."""
    with open(path) as f:
        data = json.load(f)
    infos = [b["extra_info"] for b in data["benchmarks"] if "path" in b.get("extra_info", {})]
    return [info for info in infos if info.get("suite", "loss") == suite]


def environment_line(rows) -> str:
    env = rows[0]
    return (f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}"
            + "".join(f", {k} {env[k]}" for k in ("trl", "liger_kernel") if k in env) + "\n\n")


def fused_linear_table(rows) -> str:
    if not rows:
        return "(no fused lm_head cases)"
    lines = ["| N x H x V | dtype | pass | path | median ms | useful TFLOP/s | x unfused time | peak extra |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["N"] * r["V"], r["pass"], r["path"])):
        ratio = "-" if r.get("vs_unfused") is None else f"{r['vs_unfused']:.2f}"
        peak = "-" if r.get("peak_extra_bytes") is None else f"{r['peak_extra_bytes'] / 2**30:.2f} GiB"
        lines.append(f"| {r['N']} x {r['H']} x {r['V']} | {r['dtype']} | {r['pass']} | {r['path']} | "
                     f"{r['median_ms']:.2f} | {r['useful_TFLOPs']:.0f} | {ratio} | {peak} |")
    return environment_line(rows) + "\n".join(lines)


def table(rows) -> str:
    if not rows:
        return "(no cases)"
    head = environment_line(rows)
    lines = ["| N x V | dtype | level | pass | path | median ms | GB/s (byte model) | x copy bw | peak extra / S "
             "| speed-up vs eager |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    eager = {(r["N"], r["V"], r["level"], r["pass"]): r["median_ms"] for r in rows if r["path"] == "eager"}
    for r in sorted(rows, key=lambda r: (r["level"] != "token", r["N"] * r["V"], r["pass"], -r["median_ms"])):
        base = eager.get((r["N"], r["V"], r["level"], r["pass"]))
        peak = "-" if r.get("peak_extra_over_S") is None else f"{r['peak_extra_over_S']:.3f}"
        lines.append(f"| {r['N']} x {r['V']} | {r['dtype']} | {r['level']} | {r['pass']} | {r['path']} | "
                     f"{r['median_ms']:.3f} | {r['model_GBps']:.0f} | {r['fraction_of_copy']:.2f} | {peak} | "
                     f"{base / r['median_ms']:.1f}x |" if base else "- |")
    return head + "\n".join(lines)


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = defaultdict(dict)
    for r in rows:
        if r["pass"] == "fwd+bwd" and r["level"] == "token":
            groups[f"{r['N']}x{r['V']}"][r["path"]] = r["median_ms"]
    paths = sorted({p for g in groups.values() for p in g})
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(paths), 1)
    for i, p in enumerate(paths):
        xs = [j + i * width for j in range(len(groups))]
        ax.bar(xs, [groups[g].get(p, 0) for g in groups], width, label=p)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], list(groups))
    ax.set_ylabel("ms (forward + backward)")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    rows, fused_rows = load(args.json), load(args.json, "fused_linear")
    if rows or not fused_rows:
        print(table(rows))
    if fused_rows:
        print(fused_linear_table(fused_rows))
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
