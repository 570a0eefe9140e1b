"""Whole TRL ``train()`` runs on 2 CPU ranks (tests/distributed_train.py under ``torchrun``), and the comparison of
our adapter's run with stock TRL's: tests/test_deepspeed.py and tests/test_two_processes.py."""

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

from grpo_kernels.training.tasks import compare

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed_train.py")
# what TRL's log holds besides the loss's numbers
NOT_COMPARED = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time")


def start_deepspeed_on_gloo() -> None:
    """``deepspeed.init_distributed`` over gloo, without building DeepSpeed's shared-memory all-reduce: its CPU
    accelerator compiles that C++ extension (about 40 s on a clean machine, once) when its communication starts,
    and only ``inference_all_reduce`` uses it, never ZeRO's collectives, which go through torch.distributed (gloo).
    The runs are the same with and without it."""
    import importlib

    import deepspeed

    # (by its module's name: the package's attribute ``deepspeed.comm.torch`` is torch itself)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")


def save_tiny_models(make_dir) -> dict:
    """A tiny model with a tied head and one with an untied head, saved: {"tied": path, "untied": path}."""
    paths = {}
    for head in ("tied", "untied"):
        path = make_dir(f"tiny-{head}")
        tokenizer = compare.build_tokenizer()
        model = compare.build_model(tokenizer, hidden_size=32, seed=1)
        if head == "untied":
            model.config.tie_word_embeddings = False
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 0.7)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[head] = str(path)
    return paths


def train_runs(stack, runs, model_dir, out_dir, **config) -> dict:
    """tests/distributed_train.py on 2 ranks, each of ``runs`` (stock, logits, fused) in turn in one launch: rank
    0's log, parameters at each step and final state dict, by run."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            SCRIPT,
            stack,
            ",".join(runs),
            model_dir,
            str(out_dir),
            *(f"{k}={json.dumps(v)}" for k, v in config.items()),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200 * len(runs),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return {which: torch.load(os.path.join(out_dir, f"{which}.pt"), weights_only=False) for which in runs}


def gradients(run):
    """Each SGD step's gradient, from the whole parameters before and after it."""
    steps, lr = run["steps"], run["lr"]
    return [{name: (before[name] - after[name]) / lr for name in before} for before, after in itertools.pairwise(steps)]


def assert_same_training(stock, ours, label):
    """The same loss and logged metrics at every step (the gradient's norm among them), the same gradients at each
    step (from the whole parameters before and after it), the same final parameters, and at each of our loss calls
    the loss's log-probs equal to the model's own forward's (the fused lm_head reads the weight the model uses)."""
    assert any(entry.get("grad_norm", 0) > 0 for entry in stock["log"]), "a vacuous comparison"
    differences = ours["logp_differences"]
    assert differences, f"{label}: no loss call recorded its log-probs"
    assert max(differences) <= 1e-5, (label, "log-probs beyond fp32 rounding of the model's forward", differences)
    stock_grads = gradients(stock)
    assert len(stock_grads) == len(stock["log"]) - 1 > 0, (label, "a step without its parameters recorded")
    assert len(ours["log"]) == len(stock["log"]), label
    for expected, actual in zip(stock["log"], ours["log"], strict=True):
        assert set(actual) == set(expected), (label, set(actual) ^ set(expected))
        for key, value in expected.items():
            if key not in NOT_COMPARED and isinstance(value, float):
                assert actual[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), (label, key)
    for expected, actual in zip(stock_grads, gradients(ours), strict=True):
        for name, grad in expected.items():
            torch.testing.assert_close(actual[name], grad, atol=1e-6, rtol=1e-4, msg=f"{label} d{name}")
    for name, value in stock["parameters"].items():
        torch.testing.assert_close(ours["parameters"][name], value, atol=1e-7, rtol=1e-6, msg=f"{label} {name}")
