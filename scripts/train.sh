#!/usr/bin/env bash
# The main job: set up .venv on a fresh machine, then GRPO on the built-in task.
# Arguments go to `grpo-kernels train` (try --help); results land in runs/grpo/.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
grpo-kernels train "$@"
