"""CPU: peak memory above the inputs, fused lm_head + GRPO loss vs materialized logits (forward + backward).

    python benchmarks/cpu_fused_linear_memory.py [--n 2048 --h 256 --v 32000] [--json OUT.json]

Each path runs in a fresh process (peak RSS reset with /proc/self/clear_refs after the
inputs exist, read back from VmHWM), fp32, temperature 0.7, beta 0.04. "materialized" is
``hidden @ weight.T`` then the eager reference; "ours, unfused" is the same logits through
our chunked loss; "ours, fused" is ``fused_linear_grpo_loss``; "stock TRL 1.16 head" is TRL's own fused head
(``add_fused_lm_head``'s chunked log-probs, torch tiles of 4096 tokens x 32768 entries on a CPU) with TRL's loss
(``trl_head.py``).
"""

from __future__ import annotations

import argparse
import json

from rss import measure, run_each

PATHS = ("materialized (eager)", "ours, unfused", "ours, fused", "stock TRL 1.16 head")


def run_one(path: str, n: int, h: int, v: int, b: int | None = None) -> dict:
    import torch
    from eager_baseline import grpo_loss_eager

    from grpo_kernels import fused_linear_grpo_loss, grpo_loss

    torch.manual_seed(0)
    B, T = (b, n // b) if b else (max(1, n // 512), min(n, 512))  # (rows of 512 tokens unless told the rows)
    hidden = torch.randn(B, T, h, requires_grad=True)
    weight = (0.05 * torch.randn(v, h)).requires_grad_()
    ids, mask, adv = torch.randint(0, v, (B, T)), torch.ones(B, T), torch.randn(B)
    old = ref = torch.full((B, T), -10.4)
    kw = dict(beta=0.04, temperature=0.7)

    def step():
        if path == "ours, fused":
            loss = fused_linear_grpo_loss(hidden, weight, ids, mask, adv, old, ref, backend="torch", **kw).loss
        elif path == "ours, unfused":
            loss = grpo_loss(hidden @ weight.T, ids, mask, adv, old, ref, backend="torch", **kw).loss
        elif path == "stock TRL 1.16 head":
            from trl_head import trl_fused_grpo_loss

            loss = trl_fused_grpo_loss(hidden, weight, ids, mask, adv, old, ref, **kw)
        else:
            loss = grpo_loss_eager(hidden @ weight.T, ids, mask, adv, old, ref, **kw).loss
        loss.backward()

    step()  # warm-up; the gradients it leaves are inputs-sized and stay allocated
    seconds, extra = measure(step)
    return {
        "path": path,
        "N": B * T,
        "rows": B,
        "H": h,
        "V": v,
        "seconds": seconds,
        "peak_extra_bytes": extra,
        "logits_fp32_bytes": B * T * v * 4,
        "torch": torch.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--h", type=int, default=256)
    parser.add_argument("--v", type=int, default=32000)
    parser.add_argument("--json", default=None)
    parser.add_argument("--b", type=int, default=None, help="rows (default: rows of 512 tokens)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.n, args.h, args.v, args.b)))
        return
    results = run_each(__file__, PATHS, ["--n", str(args.n), "--h", str(args.h), "--v", str(args.v)])
    base = results[0]["peak_extra_bytes"]
    print("| path | seconds (fwd+bwd) | peak memory above the inputs | vs materialized |")
    print("|---|---|---|---|")
    for r in results:
        print(
            f"| {r['path']} | {r['seconds']:.2f} | {r['peak_extra_bytes'] / 2**20:.0f} MiB | "
            f"{r['peak_extra_bytes'] / base:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
