"""OpenRLHF trains in Ray actors, each in a worker process of its own: the documented ways in reach them.

With OpenRLHF 0.11.2's real package (every file of its wheel, ``tests/openrlhf_code.py``; five modules it imports
at the top and this machine lacks stand in, flash-attn and vLLM among them) and a real local Ray (2 CPUs), each
test's driver runs in a process of its own (``tests/openrlhf_ray_driver.py``) and creates OpenRLHF's own
``PolicyModelActor``; inside that worker it asks which functions OpenRLHF's actor calls, and runs OpenRLHF's real
``ActorPPOTrainer.training_step`` (``tests/openrlhf_actor_step.py``: a tiny Llama in OpenRLHF's ``Actor``, three
configurations, an uneven second rank's batch info). The expected numbers are the same step in a plain process
with OpenRLHF's own functions: loss, every logged metric, every parameter's gradient.

- ``ray_runtime_env()`` passed to the user's own ``ray.init``: every name is ours in the worker, OpenRLHF's numbers;
- ``python -m grpo_kernels.integration.openrlhf_train``: the same through the launcher (OpenRLHF's entry point
  stood in for by the driver: OpenRLHF's own would ask for GPUs);
- ``use_in_openrlhf()`` in the driver alone, what the README once said: the worker still runs OpenRLHF's own
  functions (the bug this fixes; the check that the tests above can fail).
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from openrlhf_actor_step import CONFIGS
from openrlhf_code import openrlhf_tree

TESTS = pathlib.Path(__file__).resolve().parent
REPO = TESTS.parent
OURS = {
    "ppo_actor.PolicyLoss": "grpo_kernels.integration.openrlhf.PolicyLoss",
    "ppo_actor.aggregate_loss": "grpo_kernels.conventions.openrlhf_aggregate_loss",  # (re-exported by the adapter)
    "ppo_actor.compute_approx_kl": "grpo_kernels.integration.openrlhf.compute_approx_kl",
    "actor.log_probs_from_logits": "grpo_kernels.integration.openrlhf.patch_actor.<locals>.log_probs_from_logits",
    "actor.compute_entropy": "grpo_kernels.integration.openrlhf.patch_actor.<locals>.compute_entropy",
}
TIMEOUT = 900  # a Ray start and a worker importing OpenRLHF: a minute on an idle machine, never a failure when slow


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    pytest.importorskip("ray")
    return openrlhf_tree(tmp_path_factory.mktemp("openrlhf"))


def _env(tree: pathlib.Path) -> dict:
    # OpenRLHF's compute_entropy is torch.compile'd: eager here (no C++ toolchain needed), the same values
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(map(str, (tree, TESTS, REPO))),
        "TORCHDYNAMO_DISABLE": "1",
        "RAY_DEDUP_LOGS": "0",
    }


def _run(command, tree, out):
    run = subprocess.run(command, env=_env(tree), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0 and out.exists(), run.stdout[-3000:] + run.stderr[-5000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def openrlhfs_own(tree, tmp_path_factory):
    """The training step with OpenRLHF's own functions, in a plain process (no Ray, no patch)."""
    out = tmp_path_factory.mktemp("reference") / "steps.pt"
    script = (
        "import sys, torch, openrlhf_actor_step as s; "
        "torch.save({c: s.training_step(c) for c in s.CONFIGS}, sys.argv[1])"
    )
    steps = _run([sys.executable, "-c", script, str(out)], tree, out)
    for step in steps.values():
        assert not step["names"]["hook ran"] and all(
            v.startswith("openrlhf.") for k, v in step["names"].items() if k != "hook ran"
        ), step["names"]
    return steps


def _assert_ours_with_openrlhfs_numbers(result, expected_steps):
    assert result["pid"] != result["driver pid"]  # a worker process of its own
    assert result["names"] == {**OURS, "hook ran": True}
    for config, expected in expected_steps.items():
        step = result["steps"][config]
        assert step["names"] == result["names"]
        torch.testing.assert_close(step["loss"], expected["loss"], atol=1e-6, rtol=1e-6, msg=config)
        assert step["metrics"].keys() == expected["metrics"].keys(), config
        for name, value in expected["metrics"].items():
            torch.testing.assert_close(step["metrics"][name], value, atol=1e-6, rtol=1e-5, msg=f"{config}: {name}")
        for name, grad in expected["grads"].items():
            torch.testing.assert_close(step["grads"][name], grad, atol=1e-7, rtol=1e-5, msg=f"{config}: {name}")


def test_the_runtime_env_hook_reaches_openrlhfs_ray_workers(tree, openrlhfs_own, tmp_path):
    """The user starts Ray with ``ray_runtime_env()``: OpenRLHF's PolicyModelActor worker runs our loss, log-probs
    and entropy, and its training step gives OpenRLHF's numbers."""
    out = tmp_path / "worker.pt"
    result = _run([sys.executable, str(TESTS / "openrlhf_ray_driver.py"), str(out)], tree, out)
    assert set(result["steps"]) == set(CONFIGS)
    _assert_ours_with_openrlhfs_numbers(result, openrlhfs_own)


def test_the_launcher_reaches_openrlhfs_ray_workers(tree, openrlhfs_own, tmp_path):
    """``python -m grpo_kernels.integration.openrlhf_train ARGS``: Ray started with the hook, then OpenRLHF's entry
    point run as ``__main__`` with ARGS (here a stand-in that runs the driver: OpenRLHF's own would ask for GPUs)."""
    launched = tmp_path / "tree"
    shutil.copytree(tree, launched)
    (launched / "openrlhf" / "cli" / "train_ppo_ray.py").write_text(
        '"""A stand-in for OpenRLHF\'s entry point (tests/test_openrlhf_ray.py)."""\n'
        "import sys\n\nimport openrlhf_ray_driver\n\n"
        'if __name__ == "__main__":\n    openrlhf_ray_driver.run(sys.argv[sys.argv.index("--out") + 1])\n'
    )
    out = tmp_path / "worker.pt"
    result = _run([sys.executable, "-m", "grpo_kernels.integration.openrlhf_train", "--out", str(out)], launched, out)
    _assert_ours_with_openrlhfs_numbers(result, openrlhfs_own)


def test_use_in_openrlhf_in_the_driver_alone_does_not_reach_the_workers(tree, tmp_path):
    """What the README once said (``use_in_openrlhf()`` in the launcher): the Ray worker imports OpenRLHF anew and
    runs its own functions."""
    out = tmp_path / "worker.pt"
    script = (
        "import sys, ray, openrlhf_ray_driver\n"
        "from grpo_kernels.integration.openrlhf import use_in_openrlhf\n"
        "use_in_openrlhf()\n"
        "ray.init(num_cpus=2, include_dashboard=False)\n"
        "import openrlhf_actor_step\n"
        "openrlhf_actor_step.CONFIGS = {}\n"  # (the names are the point here, not the steps)
        "openrlhf_ray_driver.run(sys.argv[1])\n"
        "ray.shutdown()\n"
    )
    result = _run([sys.executable, "-c", script, str(out)], tree, out)
    assert not result["names"]["hook ran"]
    assert all(result["names"][name].startswith("openrlhf.models.") for name in OURS), result["names"]
