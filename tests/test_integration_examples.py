"""The top-level integration/ examples run as written."""

import importlib
import json
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_trl_example_trains(tmp_path):
    pytest.importorskip("trl", reason="the trl extra is not installed (pip install 'grpo-kernels[trl]')")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "integration" / "trl_grpo.py"), "--max-steps", "3", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and math.isfinite(summary["training_loss"])
    # something visibly happens: after the format warm-up the rewards vary within groups, so there are advantages
    # and a gradient (a model fresh from its config gets reward 0 everywhere and a gradient of ~1e-8)
    assert len(summary["per_step"]) == 3
    assert all(step["reward_std"] > 0 and step["grad_norm"] > 1e-3 for step in summary["per_step"]), summary
    assert "step 3: reward" in proc.stdout


def test_the_verl_config_names_what_exists():
    core_algos = pytest.importorskip(
        "verl.trainer.ppo.core_algos",
        reason="verl is not installed (pip install --no-deps verl; pip install '.[verl]')",
    )
    from omegaconf import OmegaConf
    from verl.utils import torch_functional

    config = OmegaConf.load(ROOT / "integration" / "verl_grpo_kernels.yaml")
    name = config.actor_rollout_ref.model.external_lib
    original = torch_functional.logprobs_from_logits
    sys.modules.pop(name, None)  # imported fresh, as in a verl worker (another test may have imported it)
    try:
        importlib.import_module(name)
        loss = core_algos.get_policy_loss_fn(config.actor_rollout_ref.actor.policy_loss.loss_mode)
        from grpo_kernels.integration import verl as adapter

        assert loss is adapter.vanilla_policy_loss
        assert torch_functional.logprobs_from_logits is not original
    finally:  # undo the patch everywhere it reached, and let the next import run the module again
        patched = torch_functional.logprobs_from_logits
        for module in list(sys.modules.values()):
            if module is not None and getattr(module, "logprobs_from_logits", None) is patched:
                module.logprobs_from_logits = original
        sys.modules.pop(name, None)
