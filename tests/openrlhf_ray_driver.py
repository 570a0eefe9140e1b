"""A Ray driver of the OpenRLHF Ray tests (``tests/test_openrlhf_ray.py``), run as its own process with OpenRLHF's
tree (``tests/openrlhf_code.py``) and ``tests/`` on PYTHONPATH:

    python tests/openrlhf_ray_driver.py OUT        # starts Ray itself with ray_runtime_env(), as a user would

or called by a stand-in for ``openrlhf.cli.train_ppo_ray`` under ``python -m grpo_kernels.integration.openrlhf_train``
(the launcher has started Ray then). It creates OpenRLHF's own ``PolicyModelActor`` (``openrlhf.trainer.ray.
ppo_actor``, a ``@ray.remote`` actor, built as its launcher builds it; no GPU asked: a CPU cluster), and inside
that worker asks which functions OpenRLHF's actor would call and runs its real ``training_step`` on each
configuration (``openrlhf_actor_step``), saving what the worker returned to OUT (``torch.save``).
"""

from __future__ import annotations

import os
import sys

import ray
import torch


def _in_worker(actor, config_names):
    import openrlhf_actor_step

    return {
        "names": openrlhf_actor_step.names_in_use(),
        "pid": os.getpid(),
        "steps": {name: openrlhf_actor_step.training_step(name) for name in config_names},
    }


def run(out: str) -> None:
    import openrlhf_actor_step
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor

    actor = PolicyModelActor.options(num_gpus=0, num_cpus=1).remote(1, 0, None, None)
    result = ray.get(actor.__ray_call__.remote(_in_worker, list(openrlhf_actor_step.CONFIGS)))
    result["driver pid"] = os.getpid()
    torch.save(result, out)


if __name__ == "__main__":
    from grpo_kernels.integration.openrlhf import ray_runtime_env

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env=ray_runtime_env(
            {"env_vars": {k: os.environ[k] for k in ("PYTHONPATH", "TORCHDYNAMO_DISABLE") if k in os.environ}}
        ),
    )
    try:
        run(sys.argv[1])
    finally:
        ray.shutdown()
