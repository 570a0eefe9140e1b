"""The top-k forward KL on the CPU: ours from logits and from hidden states against verl's own
``compute_forward_kl_topk`` (its default ``F.log_softmax`` path and its opt-in chunked path), forward + backward.

One shape (N tokens x V, K teacher ids a token, fp32; H = 256 for the hidden states), each path in a fresh process
(a clean heap: ``rss.py``), one thread; time and the peak resident memory above the inputs, and each path's ratios
to verl's default, in one run. verl's paths take the logits; ours from hidden states computes its logits a chunk at
a time and keeps none (the head's product is part of its time; verl's would add the [N, V] logits and their
gradient).

    python benchmarks/distillation_cpu.py [--n 1024] [--v 32000] [--k 64] [--json results/distillation-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform

from rss import measure, run_each

PATHS = ("verl default", "verl chunked", "ours logits", "ours hidden states")
H, TEMPERATURE = 256, 1.0


def run_one(path: str, n: int, v: int, k: int) -> dict:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    teacher = torch.log_softmax(torch.randn(n, v), -1).topk(k, -1)
    ids, logps = teacher.indices.unsqueeze(0), teacher.values.unsqueeze(0)  # [1, N, K]
    mask = torch.ones(1, n)

    if path.startswith("verl"):
        from verl.trainer.distillation.fsdp.losses import compute_forward_kl_topk
        from verl.workers.config import DistillationConfig, DistillationLossConfig

        config = DistillationConfig(
            distillation_loss=DistillationLossConfig(topk=k, use_chunked_topk=path.endswith("chunked"))
        )
        nested = lambda t: torch.nested.nested_tensor([t[0]], layout=torch.jagged)  # noqa: E731

        def step(inputs):
            out = compute_forward_kl_topk(inputs[0], nested(logps), nested(ids), config, "thd")
            losses = out["distillation_losses"].clamp_min(0.0).clamp(-10.0, 10.0)
            ((losses * mask).sum() / mask.sum()).backward()

        make = lambda: (torch.randn(1, n, v).requires_grad_(),)  # noqa: E731
    else:
        from grpo_kernels import fused_linear_topk_distillation_loss, topk_distillation_loss

        if path == "ours logits":

            def step(inputs):
                topk_distillation_loss(inputs[0], ids, logps, mask, TEMPERATURE, backend="torch").loss.backward()

            make = lambda: (torch.randn(1, n, v).requires_grad_(),)  # noqa: E731
        else:

            def step(inputs):
                hidden, weight = inputs
                fused_linear_topk_distillation_loss(
                    hidden, weight, ids, logps, mask, None, TEMPERATURE, backend="torch"
                ).loss.backward()

            make = lambda: (torch.randn(1, n, H).requires_grad_(), (0.05 * torch.randn(v, H)).requires_grad_())  # noqa: E731
    step(make())  # warm-up
    inputs = make()
    seconds, extra = measure(lambda: step(inputs))
    return {
        "path": path,
        "N": n,
        "V": v,
        "K": k,
        "H": H,
        "dtype": "float32",
        "seconds": seconds,
        "peak_extra_bytes": extra,
        "logits_bytes": n * v * 4,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--v", type=int, default=32000)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--json", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.n, args.v, args.k)))
        return
    results = run_each(__file__, PATHS, ["--n", str(args.n), "--v", str(args.v), "--k", str(args.k)])
    base = results[0]
    print(f"N x V = {args.n} x {args.v}, K = {args.k}, fp32, one thread (S = {base['logits_bytes'] / 2**20:.0f} MiB)")
    print("| path | seconds (fwd+bwd) | / verl default | peak extra memory | / verl default |")
    print("|---|---|---|---|---|")
    for r in results:
        r["time_ratio"] = r["seconds"] / base["seconds"]
        r["memory_ratio"] = r["peak_extra_bytes"] / max(base["peak_extra_bytes"], 1)
        print(
            f"| {r['path']} | {r['seconds']:.3f} | {r['time_ratio']:.2f} | {r['peak_extra_bytes'] / 2**20:.0f} MiB | "
            f"{r['memory_ratio']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
