"""Turn saved benchmark results into markdown tables (and a plot) for benchmarks/README.md.

python benchmarks/report.py RUN.json [MORE.json] [--plot RUN.png] [--sweep sweep.json] [--ncu ncu.csv]
                            [--vocab-parallel vocab_parallel.json] [--train-step train_step.json]
python benchmarks/report.py --merge-steps OUT_DIR   # train_step, vocab_parallel, profile .json -> steps.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def load(path: str, suite: str = "loss"):
    """The cases of one suite: "loss" (from logits), "logprobs" (the log-prob pass), "sampling_distillation" (the
    kept set and the top-k forward KL) or "fused_linear" (from hidden states)."""
    with open(path) as f:
        data = json.load(f)
    infos = [b["extra_info"] for b in data["benchmarks"] if "path" in b.get("extra_info", {})]
    return [info for info in infos if info.get("suite", "loss") == suite]


def environment_line(rows) -> str:
    env = rows[0]
    return (
        f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}"
        + "".join(f", {k} {env[k]}" for k in ("trl", "liger_kernel") if k in env)
        + "\n\n"
    )


def fused_linear_table(rows) -> str:
    if not rows:
        return "(no fused lm_head cases)"
    lines = [
        "| N x H x V | dtype | pass | path | median ms | useful TFLOP/s | x unfused time | peak extra |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["N"] * r["V"], r["pass"], r["path"])):
        ratio = "-" if r.get("vs_unfused") is None else f"{r['vs_unfused']:.2f}"
        peak = "-" if r.get("peak_extra_bytes") is None else f"{r['peak_extra_bytes'] / 2**30:.2f} GiB"
        lines.append(
            f"| {r['N']} x {r['H']} x {r['V']} | {r['dtype']} | {r['pass']} | {r['path']} | "
            f"{r['median_ms']:.2f} | {r['useful_TFLOPs']:.0f} | {ratio} | {peak} |"
        )
    return environment_line(rows) + "\n".join(lines)


def smoke_note(rows) -> str:
    """What a smoke run's table measures, said above it."""
    if rows and rows[0].get("smoke"):
        return (
            "Smoke run (GRPO_BENCH_SMOKE=1): one small shape, 5 rounds a path, to show every path runs; each time "
            "still carries its path's fixed host cost (Python, dispatch, allocations), which training shapes "
            "amortize. For the speed at training shapes run without GRPO_BENCH_SMOKE.\n\n"
        )
    return ""


def table(rows) -> str:
    if not rows:
        return "(no cases)"
    head = smoke_note(rows) + environment_line(rows)
    lines = [
        "| N x V | dtype | level | pass | path | median ms | GB/s (byte model) | x copy bw | peak extra / S "
        "| host ms / GPU-timeline ms | speed-up vs eager | speed-up vs torch.compile |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # each path against eager and the torch.compile'd eager loss (where that shape has one) of the same pass
    baselines = [
        {(r["N"], r["V"], r["level"], r["pass"]): r["median_ms"] for r in rows if r["path"] == name}
        for name in ("eager", "torch.compile")
    ]
    for r in sorted(rows, key=lambda r: (r["level"] != "token", r["N"] * r["V"], r["pass"], -r["median_ms"])):
        bases = [baseline.get((r["N"], r["V"], r["level"], r["pass"])) for baseline in baselines]
        peak = "-" if r.get("peak_extra_over_S") is None else f"{r['peak_extra_over_S']:.3f}"
        split = (
            "-"
            if r.get("host_ms") is None
            else f"{r['host_ms']:.3f} / " + ("-" if r.get("timeline_ms") is None else f"{r['timeline_ms']:.3f}")
        )
        lines.append(
            f"| {r['N']} x {r['V']} | {r['dtype']} | {r['level']} | {r['pass']} | {r['path']} | "
            f"{r['median_ms']:.3f} | {r['model_GBps']:.0f} | {r['fraction_of_copy']:.2f} | {peak} | {split} | "
            + " | ".join(f"{base / r['median_ms']:.2f}x" if base else "-" for base in bases)
            + " |"
        )
    return head + "\n".join(lines)


def logprobs_table(rows) -> str:
    """The log-prob pass (old / reference log-probs, no gradient): each path against eager and Liger at its shape."""
    lines = [
        "| N x V | dtype | path | median ms | GB/s (S) | x copy bw | peak extra / S | x eager time | x Liger time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_path = {(r["N"], r["V"], r["path"]): r["median_ms"] for r in rows}
    for r in sorted(rows, key=lambda r: (r["N"] * r["V"], r["median_ms"])):
        peak = "-" if r.get("peak_extra_over_S") is None else f"{r['peak_extra_over_S']:.3f}"
        ratios = [by_path.get((r["N"], r["V"], other)) for other in ("eager", "liger")]
        lines.append(
            f"| {r['N']} x {r['V']} | {r['dtype']} | {r['path']} | {r['median_ms']:.3f} | "
            f"{r['model_GBps']:.0f} | {r['fraction_of_copy']:.2f} | {peak} | "
            + " | ".join("-" if base is None else f"{r['median_ms'] / base:.2f}" for base in ratios)
            + " |"
        )
    return (
        "The log-prob pass (old / reference log-probs: forward only, no gradient)\n\n"
        + smoke_note(rows)
        + "\n".join(lines)
    )


def sampling_distillation_table(rows) -> str:
    """The sampler's kept set (against the same loss without it) and the top-k forward KL (against the eager one),
    forward + backward, at each shape."""
    lines = [
        "| N x V | dtype | path | median ms | GB/s (byte model) | x copy bw | peak extra / S | x its anchor's time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_path = {(r["N"], r["V"], r["path"]): r["median_ms"] for r in rows}

    def anchor(r):
        if "kept set" in r["path"]:
            return by_path.get((r["N"], r["V"], "ours, no kept set"))
        if r["path"].startswith("ours, top-k"):
            return by_path.get((r["N"], r["V"], r["path"].replace("ours", "eager", 1)))
        return None

    for r in sorted(rows, key=lambda r: (r["N"] * r["V"], r["path"])):
        peak = "-" if r.get("peak_extra_over_S") is None else f"{r['peak_extra_over_S']:.3f}"
        base = anchor(r)
        ratio = "-" if base is None else f"{r['median_ms'] / base:.2f}"
        lines.append(
            f"| {r['N']} x {r['V']} | {r['dtype']} | {r['path']} | {r['median_ms']:.3f} | {r['model_GBps']:.0f} | "
            f"{r['fraction_of_copy']:.2f} | {peak} | {ratio} |"
        )
    return (
        "The kept set and distillation (forward + backward; the kept set against the loss without it, ours against "
        "the eager top-k forward KL)\n\n" + smoke_note(rows) + "\n".join(lines)
    )


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


def _sweep_config(kind: str, row: dict) -> str:
    """A sweep row's configuration in a table cell: its mode (the log-prob pass has none) and the keys it sets."""
    if kind == "fused_linear":
        keys = ("BLOCK_N", "BLOCK_V", "BLOCK_H", "num_warps", "num_stages")
        return f"{row['mode']} " + (" ".join(f"{k}={row[k]}" for k in keys) if row.get(keys[0]) else "(cuBLAS)")
    keys = ("BLOCK_V", "num_warps", "num_stages", "loop_stages", "l2_hints", "programs_per_sm", "split_row")
    shown = " ".join(
        f"{k}={row[k]}"
        for k in keys
        if row.get(k) not in (None, False) and not (k in ("num_stages", "loop_stages") and row[k] == 1)
    )
    return f"{row['mode']} {shown}" if kind == "logits" else shown


def sweep_table(path: str, top: int = 5) -> str:
    """The sweep's fastest exact candidates per shape, its errors, and the winners it would commit."""
    with open(path) as f:
        results = json.load(f)
    env = results["environment"]
    lines = [
        f"Sweep on {env['device']} ({env['arch']}); torch {env['torch']}, triton {env['triton']}"
        + (" (smoke: tiny shapes in the interpreter)" if results.get("smoke") else "")
        + (" (stopped by its time limit)" if results.get("interrupted") else "")
        + "\n"
    ]
    for kind, shape_keys in (("logits", ("N", "V")), ("logprobs", ("N", "V")), ("fused_linear", ("N", "H", "V"))):
        rows = results.get(kind, [])
        if not rows:
            continue
        streaming = kind != "fused_linear"
        counts = defaultdict(int)
        for r in rows:
            counts[r.get("status", "?").split(":")[0]] += 1
        lines.append(f"{kind}: " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items())))
        by_shape = defaultdict(list)
        for r in rows:
            if r.get("status") == "ok":
                by_shape[tuple(r[k] for k in shape_keys)].append(r)
        for shape, ok in sorted(by_shape.items()):
            lines += [
                "",
                f"| {' x '.join(shape_keys)} = {' x '.join(map(str, shape))} | config | median ms | "
                + ("GB/s (byte model) | x copy bw | exact |" if streaming else "useful TFLOP/s | exact |"),
                "|---|---|---|---|" + ("---|---|" if streaming else "---|"),
            ]
            for r in sorted(ok, key=lambda r: r["median_ms"])[:top]:
                lines.append(
                    f"| | {_sweep_config(kind, r)} | {r['median_ms']:.3f} | "
                    + (
                        f"{r['model_GBps']:.0f} | {r['fraction_of_copy']:.2f}"
                        if streaming
                        else f"{r['useful_TFLOPs']:.0f}"
                    )
                    + f" | {r.get('exact')} |"
                )
            references = sorted({(r["mode"], r["reference"]) for r in ok if r.get("reference")})
            if references:
                lines.append("\nexact: " + "; ".join(f"{mode} against {ref}" for mode, ref in references))
        lines.append("")
    winners = results.get("winners", {})
    lines.append(
        "Winners (`python benchmarks/sweep.py --apply` writes them to grpo_kernels/kernels/tuned.json): "
        + (json.dumps(winners) if any(winners.values()) else "none (no GPU result)")
    )
    return "\n".join(lines)


def vocab_parallel_table(path: str) -> str:
    """benchmarks/vocab_parallel.py's sharded step against the unsharded one."""
    with open(path) as f:
        results = json.load(f)
    env = results["environment"]
    head = (
        f"Vocabulary-parallel step on {env['device']} ({env['gpus']} GPU(s), {env['transport']}); torch {env['torch']}"
    )
    if env["transport"] == "gloo" and env["gpus"] == 1:
        head += " (the ranks share one GPU: the difference is the protocol's cost, not a speed-up)"
    if "error" in results:
        return head + f"\n\nfailed: {results['error']}"
    lines = [
        head,
        "",
        "| B x T x V | dtype | ranks | sharded step ms | unsharded ms | sharded / unsharded | "
        "GB/s (2 S) sharded | unsharded | matches |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.get("cases", []):
        lines.append(
            f"| {r['B']} x {r['T']} x {r['V']} | {r['dtype']} | {r['P']} | {r['sharded_ms']:.3f} | "
            f"{r['unsharded_ms']:.3f} | {r['sharded_ms'] / r['unsharded_ms']:.2f} | "
            f"{r['sharded_GBps']:.0f} | {r['unsharded_GBps']:.0f} | {r['matches_unsharded']} |"
        )
    return "\n".join(lines)


def train_step_table(path: str) -> str:
    """benchmarks/train_step.py's whole GRPO steps, one row a (model, batch, loss path)."""
    with open(path) as f:
        results = json.load(f)
    if "error" in results:
        return f"Whole GRPO step: not run ({results['error']})"
    head = (
        f"Whole GRPO step (policy forward over {results['prompt_tokens']} prompt + the completion tokens, "
        f"gradient checkpointing, the loss, backward, AdamW) on {results['device']}, {results['dtype']}, "
        f"torch {results['torch']}, transformers {results['transformers']}; beta {results['beta']}:"
    )
    lines = [
        head,
        "",
        "| model | completions x length | loss path | step ms | tokens/s | peak GiB | loss share | "
        "longest completion that fits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results.get("cases", []):
        shape = f"{r['completions']} x {r['completion_length']}"
        if r.get("oom"):
            lines.append(f"| {r['model']} | {shape} | {r['path']} | out of memory | | | | |")
            continue
        peak = "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**30:.1f}"
        fit = r.get("fit")
        longest = "-" if not fit else f"{fit['longest']}" + (" (capped)" if fit["capped"] else "")
        lines.append(
            f"| {r['model']} | {shape} | {r['path']} | {1e3 * r['step_s']:.1f} | {r['tokens_per_s']:.0f} | "
            f"{peak} | {100 * r['loss_share']:.0f} % | {longest} |"
        )
    return "\n".join(lines)


def merge_steps(out_dir: str) -> None:
    """train_step.json, vocab_parallel.json and profile.json of a device run into one steps.json (the device returns
    8 files)."""
    import pathlib

    out = pathlib.Path(out_dir)
    steps = {}
    for name in ("train_step", "vocab_parallel", "profile"):
        f = out / f"{name}.json"
        if f.exists() and f.stat().st_size:
            steps[name] = json.loads(f.read_text())
            f.unlink()
    (out / "steps.json").write_text(json.dumps(steps, indent=1))


def profile_table(path: str, top: int = 12) -> str:
    """benchmarks/profile_loss.py's one loss call: its time, its kernels', and what the largest kernel leaves."""
    with open(path) as f:
        r = json.load(f)
    shape = r["shape"]
    gpu = r["dtype"] == "bfloat16"  # (the GPU run's case; a CPU's smoke run profiles operators, fp32)
    what = "kernels" if gpu else "CPU operators"
    lines = [
        f"One loss call (GRPOLoss forward + backward) at {shape['B']} x {shape['T']} x {shape['V']} {r['dtype']} on "
        f"{r['device']}: {r['call_ms']:.3f} ms ({'between CUDA events' if gpu else 'wall clock'}), the host "
        f"issuing it in {r['host_ms']:.3f} ms; {len(r['kernels'])} {what}, {r['kernels_ms']:.3f} ms; the call "
        f"less its largest {r['gap_above_largest_ms']:.3f} ms",
        "",
        f"| {what[:-1]} | launches | ms | share of the call |",
        "|---|---|---|---|",
    ]
    for k in r["kernels"][:top]:
        lines.append(
            f"| {k['name'][:80]} | {k['launches']} | {k['device_ms']:.3f} | {k['device_ms'] / r['call_ms']:.2f} |"
        )
    return "\n".join(lines)


def ncu_summary(path: str, logits_bytes: int) -> str:
    """Nsight Compute's raw CSV (one row a kernel launch) against the byte model: DRAM bytes over S."""
    import csv

    with open(path) as f:
        text = f.read()
    start = text.find('"ID"')
    if start < 0:
        return "ncu: no profile in " + path + "\n\n" + text[-2000:]
    rows = list(csv.DictReader(text[start:].splitlines()))
    rows = [r for r in rows if r.get("ID", "").strip().isdigit()]  # drop the units row
    from ncu_target import launch_labels

    labels = launch_labels([r.get("Kernel Name", "?") for r in rows])
    lines = [
        f"Counters at S = {logits_bytes / 1e9:.2f} GB of logits (byte model: each launch reads the logits and "
        "writes dlogits, 2 S, if every logit comes from HBM once):",
        "",
        "| launch | kernel | time ms | DRAM read / S | DRAM write / S | L2 hit % | occupancy % | issue % | MUFU % |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    num = lambda r, k: float(str(r.get(k, "nan")).replace(",", "") or "nan")  # noqa: E731
    for i, r in enumerate(rows):
        ns = num(r, "gpu__time_duration.sum")
        lines.append(
            f"| {labels[i]} | {r.get('Kernel Name', '?')[:40]} | {ns / 1e6:.3f} | "
            f"{num(r, 'dram__bytes_read.sum') / logits_bytes:.2f} | "
            f"{num(r, 'dram__bytes_write.sum') / logits_bytes:.2f} | "
            f"{num(r, 'lts__t_sector_hit_rate.pct'):.0f} | "
            f"{num(r, 'sm__warps_active.avg.pct_of_peak_sustained_active'):.0f} | "
            f"{num(r, 'sm__inst_issued.avg.pct_of_peak_sustained_active'):.0f} | "
            f"{num(r, 'sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active'):.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="*", help="pytest-benchmark JSON files (logits and fused lm_head suites)")
    parser.add_argument("--plot", default=None)
    parser.add_argument("--sweep", default=None, help="a benchmarks/sweep.py results JSON")
    parser.add_argument("--ncu", default=None, help="Nsight Compute raw CSV of benchmarks/ncu_target.py")
    parser.add_argument("--vocab-parallel", default=None, help="a benchmarks/vocab_parallel.py results JSON")
    parser.add_argument("--train-step", default=None, help="a benchmarks/train_step.py results JSON")
    parser.add_argument("--profile", default=None, help="a benchmarks/profile_loss.py results JSON")
    parser.add_argument("--merge-steps", default=None, metavar="OUT_DIR", help="merge a device run's step files")
    args = parser.parse_args()
    if args.merge_steps:
        merge_steps(args.merge_steps)
        return
    rows, fused_rows, logprob_rows, new_pass_rows = [], [], [], []
    for path in args.json:
        rows += load(path)
        fused_rows += load(path, "fused_linear")
        logprob_rows += load(path, "logprobs")
        new_pass_rows += load(path, "sampling_distillation")
    if rows or (args.json and not fused_rows and not logprob_rows and not new_pass_rows):
        print(table(rows) + "\n")
    if logprob_rows:
        print(logprobs_table(logprob_rows) + "\n")
    if new_pass_rows:
        print(sampling_distillation_table(new_pass_rows) + "\n")
    if fused_rows:
        print(fused_linear_table(fused_rows) + "\n")
    if args.sweep:
        print(sweep_table(args.sweep) + "\n")
    if args.train_step:
        print(train_step_table(args.train_step) + "\n")
    if args.vocab_parallel:
        print(vocab_parallel_table(args.vocab_parallel) + "\n")
    if args.profile:
        print(profile_table(args.profile) + "\n")
    if args.ncu:
        B, T, V = 16, 1024, 151936  # benchmarks/ncu_target.py's shape, bf16
        print(ncu_summary(args.ncu, B * T * V * 2))
    if args.plot and rows:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
