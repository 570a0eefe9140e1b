"""The TRL adapter inside DeepSpeed ZeRO-2 and ZeRO-3 (through accelerate, on 2 CPU ranks over gloo) equals stock
TRL under the same config: the loss and every logged metric at each step, each step's gradients (gathered from
ZeRO's partitions) and the parameters after the steps; the logits path and the fused lm_head, tied and untied
heads. Each run is its own ``torchrun`` (tests/deepspeed_train.py)."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (scripts/setup.sh installs it)")
pytest.importorskip("trl", reason="the trl extra is not installed")

from grpo_kernels.training.tasks import compare  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "deepspeed_train.py")
# what TRL's log holds besides the loss's numbers
NOT_COMPARED = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths = {}
    for head in ("tied", "untied"):
        path = tmp_path_factory.mktemp(f"tiny-{head}")
        tokenizer = compare.build_tokenizer()
        model = compare.build_model(tokenizer, hidden_size=32, seed=1)
        if head == "untied":
            model.config.tie_word_embeddings = False
            model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 0.7)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[head] = str(path)
    return paths


def _train(stage, which, model_dir, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           SCRIPT, str(stage), which, model_dir, str(out)], capture_output=True, text=True,
                          env=env, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return torch.load(out, weights_only=False)


def _gradients(run):
    """Each SGD step's gradient, from the whole parameters before and after it."""
    steps, lr = run["steps"], run["lr"]
    return [{name: (before[name] - after[name]) / lr for name in before} for before, after in zip(steps, steps[1:])]


@pytest.mark.parametrize("head", ["tied", "untied"])
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_matches_stock_trl(stage, head, models, tmp_path):
    stock = _train(stage, "stock", models[head], tmp_path / "stock.pt")
    stock_grads = _gradients(stock)
    assert len(stock_grads) == 2 and sum(float(g.abs().sum()) for g in stock_grads[1].values()) > 0
    for which in ("logits", "fused"):
        ours = _train(stage, which, models[head], tmp_path / f"{which}.pt")
        assert len(ours["log"]) == len(stock["log"])
        for expected, actual in zip(stock["log"], ours["log"]):
            assert set(actual) == set(expected), which
            for key, value in expected.items():
                if key not in NOT_COMPARED and isinstance(value, float):
                    assert actual[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), (which, key)
        for expected, actual in zip(stock_grads, _gradients(ours)):
            for name, grad in expected.items():
                torch.testing.assert_close(actual[name], grad, atol=1e-6, rtol=1e-4, msg=f"{which} d{name}")
        for name, value in stock["parameters"].items():
            torch.testing.assert_close(ours["parameters"][name], value, atol=1e-7, rtol=1e-6, msg=f"{which} {name}")
