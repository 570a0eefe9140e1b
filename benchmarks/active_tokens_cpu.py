"""The cost of the tokens that count: a loss call forward + backward with 100 %, 50 %, 10 % and 3 % of its tokens active
(scattered, as an agentic rollout's turns are), from logits and from hidden states, on the CPU torch path (one thread),
with the active-token compaction (``grpo_kernels.inputs.compacted``) and without it (``COMPACTION_SHARE = 0``: every
row computed, the package before it), in the same run; with the byte and FLOP model of each.

    python benchmarks/active_tokens_cpu.py --out benchmarks/results/active-tokens-cpu.json   # 8 x 512, V = 32000
    python benchmarks/active_tokens_cpu.py --smoke                      # a small shape, seconds

The byte model (logits [N, V] of b bytes, n active tokens): without compaction the torch path reads the logits twice
and writes their gradient (3 N V b); with it, it gathers the active rows (n V b read and written), reads them twice
and writes their gradient (3 n V b), then writes the whole gradient, zeros at the masked tokens (N V b), and
scatters the active rows into it (n V b): (N + 6 n) V b. From hidden states the head's products are the work: 8 N V H
FLOPs forward + backward (the backward recomputes the logits) without, 8 n V H with."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_kernels import fused_linear_grpo_loss, grpo_loss, inputs  # noqa: E402

SHARES = (1.0, 0.5, 0.1, 0.03)


def byte_model(form: str, N: int, n: int, V: int, H: int, compacted: bool) -> dict:
    """What a call moves (logits: bytes) or computes (hidden states: FLOPs), per the module's model."""
    if form == "logits":
        b = 4
        return {"bytes": ((N + 6 * n) if compacted else 3 * N) * V * b}
    return {"flops": 8 * (n if compacted else N) * V * H}


def timed(form: str, tensors: dict, mask: torch.Tensor, repeats: int) -> float:
    """The best of ``repeats`` forward + backward times (s)."""
    best = float("inf")
    for _ in range(repeats):
        if form == "logits":
            x = tensors["logits"].clone().requires_grad_()
            start = time.perf_counter()
            grpo_loss(x, tensors["ids"], mask, tensors["advantages"], backend="torch").loss.backward()
        else:
            h, w = tensors["hidden"].clone().requires_grad_(), tensors["weight"].clone().requires_grad_()
            start = time.perf_counter()
            fused_linear_grpo_loss(h, w, tensors["ids"], mask, tensors["advantages"], backend="torch").loss.backward()
        best = min(best, time.perf_counter() - start)
    return best


def run(B: int, T: int, V: int, H: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    tensors = dict(
        logits=torch.randn(B, T, V, generator=g),
        hidden=torch.randn(B, T, H, generator=g),
        weight=0.05 * torch.randn(V, H, generator=g),
        ids=torch.randint(0, V, (B, T), generator=g),
        advantages=torch.randn(B, generator=g),
    )
    rows = []
    share_before = inputs.COMPACTION_SHARE
    try:
        for form in ("logits", "hidden_states"):
            for share in SHARES:
                mask = (torch.rand(B, T, generator=torch.Generator().manual_seed(1)) < share).float()
                n = int(mask.sum())
                row = {"form": form, "active_share": share, "active_tokens": n, "tokens": B * T}
                for name, compaction in (("without", 0.0), ("with", share_before)):
                    inputs.COMPACTION_SHARE = compaction
                    row[f"seconds_{name}"] = round(timed(form, tensors, mask, repeats), 4)
                    model = byte_model(form, B * T, n, V, H, compacted=0 < n <= compaction * B * T)
                    row.update({f"{key}_{name}": value for key, value in model.items()})
                row["ratio_to_full"] = None  # filled below, against the fully active call with compaction
                rows.append(row)
    finally:
        inputs.COMPACTION_SHARE = share_before
    for row in rows:
        full = next(r for r in rows if r["form"] == row["form"] and r["active_share"] == 1.0)
        row["ratio_to_full"] = round(row["seconds_with"] / full["seconds_with"], 3)
    return {
        "shape": {"B": B, "T": T, "V": V, "H": H, "dtype": "fp32"},
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": 1, "torch": torch.__version__},
        "rows": rows,
    }


def table(result: dict) -> str:
    lines = [
        "| form | active | without compaction (s) | with (s) | with / fully active | model without | model with |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        unit, scale = ("bytes", 1e9) if r["form"] == "logits" else ("flops", 1e9)
        word = "GB" if unit == "bytes" else "GFLOP"
        lines.append(
            f"| {r['form']} | {100 * r['active_share']:g} % | {r['seconds_without']:.3f} | {r['seconds_with']:.3f} "
            f"| {r['ratio_to_full']:.2f} | {r[f'{unit}_without'] / scale:.2f} {word} | "
            f"{r[f'{unit}_with'] / scale:.2f} {word} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("--smoke", action="store_true", help="2 x 64 tokens, V = 1000, H = 32: every case in seconds")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    shape = (2, 64, 1000, 32) if args.smoke else (8, 512, 32000, 256)
    result = run(*shape, repeats=1 if args.smoke else args.repeats)
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
