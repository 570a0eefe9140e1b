#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with the wheels the device suite uses on a GPU machine that has no
# network: the peers it compares against. Run here, where pip reaches the index; then carry .whl
# to the GPU machine with the working tree and run `bash benchmarks/gpu_suite.sh` there.
#   liger-kernel: triton_grpo_loss and LigerFusedLinearGRPOLoss (needs only torch and triton)
#   trl: only its Triton log-prob + entropy kernel file is loaded (benchmarks/cases.py), without
#        importing trl itself, whose dependencies (datasets, pandas, pyarrow) are not carried
#   transformers and its dependencies (numpy excepted: the machine has its own): the models of the
#        whole-step benchmark (benchmarks/train_step.py), built from configs (about 28 MB of wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    -d .whl "liger-kernel==0.8.5" "trl==1.16.0"
python3 -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d .whl "transformers==5.24.0"
rm -f .whl/numpy-*.whl
ls -la .whl
du -sh .whl
