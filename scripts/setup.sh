#!/usr/bin/env bash
# Set-up on a fresh machine: a virtual environment in .venv with the package, its test, train and docs extras and the
# peers.
# Sourced by .ci/run and scripts/train.sh; safe to run again (pip skips what is there).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -d .venv ] || python3 -m venv .venv
source .venv/bin/activate
python -m pip install --quiet --upgrade pip
# The CPU build of torch first: a plain "torch" requirement would pull a multi-GB CUDA build.
# On a CUDA machine, install your CUDA build of torch into .venv before running this.
python -c "import torch" >/dev/null 2>&1 || python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[test,lint,train,trl,verl,peft,docs]"
# verl without its own dependencies (vLLM, ...): the loss adapter needs only core_algos
python -c "import verl" >/dev/null 2>&1 || python -m pip install --quiet --no-deps "verl==0.9.1"
# megatron-core (2.6 MB; torch, numpy, packaging): verl's Megatron vocabulary-parallel functions, our oracle there
python -c "import megatron.core" >/dev/null 2>&1 || python -m pip install --quiet --no-deps "megatron-core==0.16.1"
# Liger-Kernel, a peer the tests check our numbers against (its own deps are torch and triton)
python -c "import liger_kernel" >/dev/null 2>&1 || python -m pip install --quiet --no-deps "liger-kernel==0.8.5"
# DeepSpeed (ZeRO-2 / ZeRO-3 on CPU ranks, tests/test_deepspeed.py): built against the torch installed here
# (--no-build-isolation: an isolated build would pull a CUDA torch), its dependencies first
python -c "import deepspeed" >/dev/null 2>&1 || { python -m pip install --quiet einops hjson ninja msgpack psutil py-cpuinfo \
    "pydantic>=2" && python -m pip install --quiet --no-deps --no-build-isolation "deepspeed==0.19.6"; }
# OpenRLHF's wheel, whose loss code the tests run (its package needs flash-attn and DeepSpeed: not installed,
# the tests load openrlhf/models/loss.py and utils.py from the wheel; tests/openrlhf_code.py)
ls .cache/wheels/openrlhf-0.11.2-*.whl >/dev/null 2>&1 || \
    python -m pip download --quiet --no-deps "openrlhf==0.11.2" -d .cache/wheels || \
    echo "setup.sh: could not download OpenRLHF's wheel; its parity tests will say so and skip" >&2
# SkyRL's wheel (0.9 MB), whose prompt-mean reduction and PPO loss the tests run from its files (its package
# imports Ray and its trainer's config at the top; tests/skyrl_code.py)
ls .cache/wheels/skyrl-0.3.0-*.whl >/dev/null 2>&1 || \
    python -m pip download --quiet --no-deps "skyrl==0.3.0" -d .cache/wheels || \
    echo "setup.sh: could not download SkyRL's wheel; its parity tests will say so and skip" >&2
