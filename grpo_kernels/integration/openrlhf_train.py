"""OpenRLHF's PPO / GRPO launcher with this package's loss in every Ray worker.

    python -m grpo_kernels.integration.openrlhf_train <the arguments of openrlhf.cli.train_ppo_ray>

OpenRLHF trains in Ray actors (``PolicyModelActor`` and the rest), each in a worker process of its own that imports
OpenRLHF anew: a ``use_in_openrlhf()`` in the launcher process never reaches them. This launcher starts Ray with
``grpo_kernels.integration.openrlhf.ray_runtime_env()`` (a ``worker_process_setup_hook`` that calls
``use_in_openrlhf()`` in each worker before its first actor, and OpenRLHF's own ``env_vars``), applies the patch
in this process too, then runs OpenRLHF's own entry point, ``openrlhf.cli.train_ppo_ray`` as ``__main__`` (its
argument parsing and checks included), unchanged. With ``RAY_ADDRESS`` set it joins that cluster as a job whose
workers all run the hook. ``--help`` prints this, then OpenRLHF's own options, without starting Ray.
"""

from __future__ import annotations

import runpy
import sys

ENTRY_POINT = "openrlhf.cli.train_ppo_ray"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__.strip() + "\n\nOpenRLHF's options follow.\n", flush=True)
    else:
        import ray

        from .openrlhf import ray_runtime_env, use_in_openrlhf

        if not ray.is_initialized():
            ray.init(runtime_env=ray_runtime_env())
        use_in_openrlhf()
    sys.argv = [ENTRY_POINT, *argv]
    runpy.run_module(ENTRY_POINT, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
