"""CPU: peak memory above the inputs and time, forward + backward, eager vs our chunked torch path.

    python benchmarks/cpu_memory.py [--n 4096 --v 32000] [--json benchmarks/results/cpu_memory.json]

Each path runs in a fresh process: the inputs are made, the kernel's peak-RSS mark is
reset (/proc/self/clear_refs), one forward + backward runs (after one warm-up), and the
peak RSS above the post-input baseline is read from /proc/self/status (VmHWM). S is the
size of the logits (N x V x 4 bytes, fp32). The logits are a leaf, so their gradient
(S bytes) is part of every path's extra memory, except in the in-place mode.
"""

from __future__ import annotations

import argparse
import json
import platform

from rss import measure, run_each

PATHS = ("eager", "ours", "ours in-place")


def run_one(path: str, n: int, v: int, temperature: float) -> dict:
    import torch
    from eager_baseline import grpo_loss_eager

    from grpo_kernels import grpo_loss

    torch.manual_seed(0)
    B, T = n // 512, 512
    hidden = torch.randn(B, T, 64)
    ids = torch.randint(0, v, (B, T))
    mask = torch.ones(B, T)
    adv = torch.randn(B)
    old = torch.full((B, T), -10.4)
    ref = torch.full((B, T), -10.4)

    def step(logits):
        kwargs = dict(beta=0.04, temperature=temperature)
        if path == "eager":
            loss = grpo_loss_eager(logits, ids, mask, adv, old, ref, **kwargs).loss
        else:
            loss = grpo_loss(
                logits,
                ids,
                mask,
                adv,
                old,
                ref,
                backend="torch",
                check_ids=False,
                in_place_backward=path.endswith("in-place"),
                **kwargs,
            ).loss
        loss.backward()

    S = n * v * 4
    # Build the logits before the baseline; what the step allocates above it is the extra memory.
    if path == "ours in-place":
        weight = torch.randn(v, 64, requires_grad=True)
        logits_fn = lambda: torch.nn.functional.linear(hidden, weight)  # noqa: E731
        step(logits_fn())  # warm-up
        weight.grad = None
        logits = logits_fn()
        # the logits (S) exist before the baseline; the weight's gradient (V x 64) is small
    else:
        warm = torch.randn(B, T, v).requires_grad_()
        step(warm)
        del warm
        logits = torch.randn(B, T, v).requires_grad_()
    seconds, extra = measure(lambda: step(logits))
    return {
        "path": path,
        "N": n,
        "V": v,
        "dtype": "float32",
        "temperature": temperature,
        "logits_bytes": S,
        "seconds": seconds,
        "peak_extra_bytes": extra,
        "peak_extra_over_S": extra / S,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--v", type=int, default=32000)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.n, args.v, args.temperature)))
        return
    results = run_each(
        __file__, PATHS, ["--n", str(args.n), "--v", str(args.v), "--temperature", str(args.temperature)]
    )
    print("| path | seconds (fwd+bwd) | peak extra memory | / S |")
    print("|---|---|---|---|")
    for r in results:
        extra_mib = r["peak_extra_bytes"] / 2**20
        print(f"| {r['path']} | {r['seconds']:.2f} | {extra_mib:.0f} MiB | {r['peak_extra_over_S']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
