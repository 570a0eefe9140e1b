"""What the sampler's kept set costs on the CPU torch path: a forward + backward with ``kept_set`` against the same
call without it, in one run (rounds interleaved, so that load on the machine falls on both alike).

Cases: ``grpo_loss`` from logits (B, T, V = 8, 128, 32000 fp32) and ``fused_linear_grpo_loss`` from hidden states
(H = 256), each with top-k sets (K = 50 ids a token, vLLM's CSR) and with wide top-p sets (K = 1000, padded).

    python benchmarks/kept_set_cpu.py [--rounds 7] [--iters 3] [--json benchmarks/results/kept-set-cpu.json]

One thread (``torch.set_num_threads(1)``): the ratio is the point, not the absolute time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from grpo_kernels import KeptSet, fused_linear_grpo_loss, grpo_loss

B, T, V, H = 8, 128, 32000, 256
OPTIONS = dict(beta=0.04, temperature=0.8, backend="torch")


def _sets(ids: torch.Tensor, K: int, form: str, seed: int = 0) -> KeptSet:
    """K ids a token, the target among them: CSR (vLLM's) or padded (prime-rl's)."""
    g = torch.Generator().manual_seed(seed)
    N = ids.numel()
    others = torch.randint(0, V, (N, K), generator=g)
    others[:, 0] = ids.reshape(-1)
    kept = torch.sort(others, dim=-1).values
    kept = torch.where(torch.cat([torch.ones(N, 1, dtype=torch.bool), kept[:, 1:] != kept[:, :-1]], 1), kept, -1)
    if form == "padded":
        return KeptSet.from_padded(kept.view(B, T, K))
    present = kept >= 0
    offsets = torch.nn.functional.pad(present.sum(1).cumsum(0), (1, 0))
    return KeptSet.from_vllm(kept[present].to(torch.int32), offsets)


def _inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(
        completion_ids=torch.randint(0, V, (B, T), generator=g),
        completion_mask=torch.ones(B, T),
        advantages=torch.randn(B, generator=g),
        old_logps=-torch.rand(B, T, generator=g) * 5,
        ref_logps=-torch.rand(B, T, generator=g) * 5,
    )


def cases() -> dict:
    """name: (call without the set, call with it)."""
    batch = _inputs()
    logits = torch.randn(B, T, V)
    hidden, weight = torch.randn(B, T, H), torch.randn(V, H) * 0.05

    def from_logits(kept):
        def call():
            x = logits.clone().requires_grad_()
            grpo_loss(x, **batch, kept_set=kept, **OPTIONS).loss.backward()

        return call

    def from_hidden(kept):
        def call():
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            fused_linear_grpo_loss(h, w, **batch, kept_set=kept, **OPTIONS).loss.backward()

        return call

    found = {}
    for K, form in ((50, "csr"), (1000, "padded")):
        kept = _sets(batch["completion_ids"], K, form)
        found[f"logits top-k K={K} {form}"] = (from_logits(None), from_logits(kept))
        found[f"hidden states K={K} {form}"] = (from_hidden(None), from_hidden(kept))
    return found


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for name, (plain, with_set) in cases().items():
        plain(), with_set()  # warm up both
        times = {"without": [], "with": []}
        for r in range(args.rounds):
            order = (("without", plain), ("with", with_set)) if r % 2 == 0 else (("with", with_set), ("without", plain))
            for label, call in order:
                start = time.perf_counter()
                for _ in range(args.iters):
                    call()
                times[label].append((time.perf_counter() - start) / args.iters * 1e3)
        without, with_ = statistics.median(times["without"]), statistics.median(times["with"])
        results[name] = dict(without_ms=round(without, 2), with_ms=round(with_, 2), ratio=round(with_ / without, 3))
        print(f"{name:32} without {without:8.2f} ms  with {with_:8.2f} ms  ratio {with_ / without:.3f}", flush=True)
    record = dict(
        shapes=dict(B=B, T=T, V=V, H=H, dtype="fp32"),
        torch=torch.__version__,
        machine=platform.processor() or platform.machine(),
        rounds=args.rounds,
        iters=args.iters,
        results=results,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
