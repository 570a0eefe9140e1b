"""Each existing loss type's CPU time at this checkout against an earlier commit, in one run.

A change that adds loss types or options (the families, the rollout correction) must not slow the ones users
already run. This times a forward + backward of ``grpo_loss`` on the CPU torch path for each of TRL's loss types,
at this checkout and at ``--ref`` (checked out into a temporary git worktree), in interleaved rounds: each round
runs every loss type of both trees, each tree in its own process (which goes first alternates), so that load on the
machine falls on both alike.
It prints, per loss type, the median time of each tree and their ratio (this checkout / ref).

    python benchmarks/loss_types_cpu.py --ref 4502c8b --rounds 11 --iters 20 \
        --json benchmarks/results/loss-types-cpu.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")


def time_tree(iters: int, shape: tuple[int, int, int]) -> dict[str, float]:
    """In a child whose ``sys.path`` starts with a tree: the median seconds of a forward + backward per loss type."""
    import torch

    from grpo_kernels import grpo_loss

    torch.set_num_threads(1)
    B, T, V = shape
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.1).float()
    adv = torch.randn(B, generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old, ref = lp + 0.1 * torch.randn(B, T, generator=g), lp + 0.2 * torch.randn(B, T, generator=g)
    times = {}
    for loss_type in LOSS_TYPES:
        options = dict(loss_type=loss_type, beta=0.04)
        if loss_type == "dr_grpo":
            options["max_completion_length"] = T
        leaf = logits.clone().requires_grad_()
        samples = []
        for i in range(iters + 2):
            start = time.perf_counter()
            out = grpo_loss(leaf, ids, mask, adv, old, ref, backend="torch", **options)
            out.loss.backward()
            if i >= 2:  # the first two warm the caches
                samples.append(time.perf_counter() - start)
            leaf.grad = None
        times[loss_type] = statistics.median(samples)
    return times


def run_child(tree: pathlib.Path, iters: int, shape) -> dict[str, float]:
    code = (
        f"import sys; sys.path.insert(0, {str(tree)!r}); sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
        f"import json, loss_types_cpu; print(json.dumps(loss_types_cpu.time_tree({iters}, {tuple(shape)!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", required=True, help="the commit to compare with (a git revision)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--shape", type=int, nargs=3, default=(8, 128, 4096), metavar=("B", "T", "V"))
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    ref = subprocess.run(
        ["git", "rev-parse", "--short", args.ref], cwd=ROOT, capture_output=True, text=True, check=True
    )
    with tempfile.TemporaryDirectory(prefix="grpo-ref-") as scratch:
        ref_tree = pathlib.Path(scratch) / "ref"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(ref_tree), args.ref], cwd=ROOT, check=True, capture_output=True
        )
        try:
            rounds = {"head": [], "ref": []}
            trees = [("ref", ref_tree), ("head", ROOT)]
            for r in range(args.rounds):  # the order alternates: neither tree always runs first
                for name, tree in trees if r % 2 == 0 else trees[::-1]:
                    rounds[name].append(run_child(tree, args.iters, args.shape))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(ref_tree)], cwd=ROOT, capture_output=True)
    result = {
        "head": head.strip(),
        "ref": ref.stdout.strip(),
        "shape": list(args.shape),
        "rounds": args.rounds,
        "iters": args.iters,
        "loss_types": {},
    }
    print(
        f"{'loss type':10} {'ref ms':>9} {'head ms':>9} {'head / ref':>10}"
        f"  (B, T, V = {tuple(args.shape)}, fp32, 1 thread)"
    )
    for loss_type in LOSS_TYPES:
        old = statistics.median(r[loss_type] for r in rounds["ref"])
        new = statistics.median(r[loss_type] for r in rounds["head"])
        result["loss_types"][loss_type] = dict(ref_ms=1e3 * old, head_ms=1e3 * new, ratio=new / old)
        print(f"{loss_type:10} {1e3 * old:9.2f} {1e3 * new:9.2f} {new / old:10.3f}")
    ratios = [entry["ratio"] for entry in result["loss_types"].values()]
    result["geometric_mean_ratio"] = statistics.geometric_mean(ratios)
    print(f"geometric mean of the ratios: {result['geometric_mean_ratio']:.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
