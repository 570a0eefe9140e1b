"""Each TRL loss type's forward + backward on the CPU: ours against the eager loss, torch.compile of it and TRL's
own path, in one run (rounds interleaved, so that load on the machine falls on every path alike).

Paths (``benchmarks/cases.py``'s, the pytest-benchmark suite's CPU paths, per loss type):

- ``ours``: ``grpo_loss`` on the chunked torch path (what ``backend="auto"`` runs on a CPU), from the model's
  [B, T + 1, V] logits with ``drop_last_position=True``;
- ``eager``: the fp32 log-softmax materialized, then the loss math (``eager_baseline.grpo_loss_eager``);
- ``torch.compile``: that eager function compiled (one graph a loss type; its compile time is not timed);
- ``trl``: TRL's ``selective_log_softmax`` and ``entropy_from_logits`` on the logits, then the loss math.

    python benchmarks/peers_cpu.py [--rounds 3] [--iters 3] [--json benchmarks/results/peers-cpu.json]

One thread (``torch.set_num_threads(1)``): the ratios are the point, not the absolute times. The figure
(``docs/figures.py``) plots each path's time over ours.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from cases import BETA, TEMPERATURE, make_inputs  # noqa: E402
from eager_baseline import grpo_loss_eager  # noqa: E402

from grpo_kernels import GRPOOptions, grpo_loss, objective  # noqa: E402

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo")
SHAPE = (4, 256, 32000)


def _options(loss_type: str, T: int) -> dict:
    options = dict(loss_type=loss_type, beta=BETA, temperature=TEMPERATURE)
    if loss_type == "dr_grpo":
        options["max_completion_length"] = T
    return options


def paths(T: int) -> dict:
    """name -> fn(inputs, loss_type) -> the loss, each from the model's [B, T + 1, V] logits (``inputs["leaf"]``)."""
    import torch._dynamo.config as dynamo_config
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    def ours(inputs, loss_type):
        return grpo_loss(
            inputs["leaf"], inputs["completion_ids"], inputs["completion_mask"], inputs["advantages"],
            inputs["old_logps"], inputs["ref_logps"], backend="torch", drop_last_position=True,
            **_options(loss_type, T),
        ).loss  # fmt: skip

    def eager(inputs, loss_type):
        return grpo_loss_eager(
            inputs["leaf"][:, :T], inputs["completion_ids"], inputs["completion_mask"], inputs["advantages"],
            inputs["old_logps"], inputs["ref_logps"], **_options(loss_type, T),
        ).loss  # fmt: skip

    def trl(inputs, loss_type):
        opts = GRPOOptions(**_options(loss_type, T))
        scaled = inputs["leaf"][:, :T] / TEMPERATURE
        lp = selective_log_softmax(scaled, inputs["completion_ids"])
        with torch.no_grad():
            entropy_from_logits(scaled)  # TRL's entropy metric
        mask = inputs["completion_mask"]
        terms = objective.per_token_terms(
            lp, mask, inputs["advantages"].unsqueeze(1), inputs["old_logps"], inputs["ref_logps"], None, opts
        )
        return objective.reduce_loss(terms.per_token_loss, mask, opts)

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)  # one graph a loss type
    compiled = {loss_type: torch.compile(eager, dynamic=False) for loss_type in LOSS_TYPES}
    return {
        "ours": ours,
        "eager": eager,
        "torch.compile": lambda inputs, loss_type: compiled[loss_type](inputs, loss_type),
        "trl": trl,
    }


def _step(fn, inputs, loss_type) -> float:
    inputs["leaf"].grad = None
    start = time.perf_counter()
    fn(inputs, loss_type).backward()
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    B, T, V = SHAPE
    inputs = make_inputs(B, T, V, device="cpu")
    inputs["leaf"] = inputs.pop("full_logits").requires_grad_()
    runs = paths(T)
    for loss_type in LOSS_TYPES:  # warm-up: the compiles, the caches
        for fn in runs.values():
            _step(fn, inputs, loss_type)
            _step(fn, inputs, loss_type)
    samples = {lt: {name: [] for name in runs} for lt in LOSS_TYPES}
    for r in range(args.rounds):
        for loss_type in LOSS_TYPES:
            names = list(runs) if r % 2 == 0 else list(reversed(runs))  # which goes first alternates
            for name in names:
                samples[loss_type][name] += [_step(runs[name], inputs, loss_type) for _ in range(args.iters)]
    results = {}
    for loss_type, by_path in samples.items():
        medians = {name: statistics.median(values) * 1e3 for name, values in by_path.items()}
        results[loss_type] = {
            "ms": medians,
            "over_ours": {name: ms / medians["ours"] for name, ms in medians.items() if name != "ours"},
        }
        print(loss_type, "  ".join(f"{name} {ms:.1f} ms" for name, ms in medians.items()), flush=True)
    import trl

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = dict(
        shape=dict(B=B, T=T, V=V, dtype="float32"),
        rounds=args.rounds,
        iters=args.iters,
        threads=1,
        torch=torch.__version__,
        trl=trl.__version__,
        machine=platform.processor() or platform.machine(),
        commit=commit,
        results=results,
    )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
