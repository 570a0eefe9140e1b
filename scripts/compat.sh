#!/usr/bin/env bash
# The versions pyproject.toml declares, tried as a user gets them: each set in a fresh virtual environment
# from PyPI's own wheels, then the README's example, `grpo-kernels --help`, a short `grpo-kernels train`, and
# a test subset. One Markdown row a set in benchmarks/results/compat/<set>.md (the README's table).
#
#   bash scripts/compat.sh                 # every set
#   bash scripts/compat.sh floor newest    # some of them
#
# Sets (the floors are pyproject's; "newest" is what an unpinned install resolves to today):
#   floor      torch 2.7.0 (triton 3.3.0, a CUDA build: PyPI has no other), transformers 4.46.0, numpy < 2.4
#              (Triton's interpreter before 3.7 needs it), the oldest of what the package requires
#   floor-trl  TRL 1.10.0 (the adapter's floor) with the oldest transformers, accelerate and datasets it takes,
#              torch 2.13.0 (CPU)
#   newest     the newest torch, triton, transformers and TRL (a CUDA build of torch)
# Each venv is 1 to 6 GB, under $COMPAT_DIR (default /tmp/grpo-compat), made again on every run.
# Nothing here needs a GPU: the Triton cases run in the interpreter, as in CI.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
COMPAT_DIR=${COMPAT_DIR:-/tmp/grpo-compat}
RESULTS=$ROOT/benchmarks/results/compat
mkdir -p "$COMPAT_DIR" "$RESULTS"
SETS=("$@")
[ ${#SETS[@]} -gt 0 ] || SETS=(floor floor-trl newest)

# an empty constraint file: a machine-wide pip cap on torch must not stand between a set and its torch
: > "$COMPAT_DIR/no-constraints.txt"
export PIP_CONSTRAINT=$COMPAT_DIR/no-constraints.txt PIP_DISABLE_PIP_VERSION_CHECK=1

# the fast subset: the API, the loss (torch path and Triton cases), the fused lm_head's Triton cases, the
# version checks; the TRL adapter's tests where TRL is in the set
CORE_TESTS=(tests/test_api.py tests/test_loss.py tests/test_versions.py)
TRITON_TESTS=(tests/test_fused_linear.py -k "triton")
TRL_TESTS=(tests/test_trl_integration.py)

requirements() {  # the pip arguments of a set
  case $1 in
    floor) echo "torch==2.7.0 transformers==4.46.0 numpy<2.4" ;;
    floor-trl) echo "torch==2.13.0 trl==1.10.0 transformers==4.56.2 accelerate==1.4.0 datasets==4.7.0 numpy<2.4" ;;
    newest) echo "torch triton transformers trl" ;;
    *) echo "unknown set $1 (floor, floor-trl, newest)" >&2; return 1 ;;
  esac
}

readme_example() {  # the README's "Example" block, run outside the checkout
  python - "$ROOT/README.md" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
block = re.search(r"## From logits\n\n```python\n(.*?)```", text, re.S).group(1)
exec(compile(block, "README.md#From logits", "exec"), {})
EOF
}

check() {  # check NAME LOG COMMAND...: "pass" or "FAIL (LOG)", the command's output in LOG
  local name=$1 log=$2; shift 2
  if "$@" > "$log" 2>&1; then echo "pass"; else echo "FAIL: $(basename "$log")"; fi
}

for set in "${SETS[@]}"; do
  args=$(requirements "$set") || exit 2
  venv=$COMPAT_DIR/$set
  logs=$COMPAT_DIR/$set-logs
  rm -rf "$venv" "$logs" && mkdir -p "$logs"
  echo "== $set: pip install $args" >&2
  python3 -m venv "$venv"
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
  python -m pip install --quiet --upgrade pip
  # the set's pins and the package together, so that pip resolves them as one (a floor the package excludes
  # fails here)
  extras=test,train; case $args in *trl*) extras=test,train,trl ;; esac
  # shellcheck disable=SC2086
  if ! python -m pip install --quiet $args "$ROOT[$extras]" > "$logs/install.log" 2>&1; then
    row="| $set | $args | install FAILED (\`$logs/install.log\`) | | | | |"
  else
    versions=$(python -c "import importlib.metadata as m
names = ['torch', 'triton', 'transformers', 'numpy', 'trl']
print(', '.join(f'{n} {m.version(n)}' for n in names if any(d.metadata['Name'] == n for d in m.distributions())))")
    cd "$COMPAT_DIR"  # outside the checkout: the installed package, not the source tree
    example=$(check example "$logs/example.log" readme_example)
    help=$(check help "$logs/help.log" grpo-kernels --help)
    train=$(check train "$logs/train.log" grpo-kernels train --steps 3 --warmup-steps 2 --output-dir "$logs/run")
    cd "$ROOT"
    tests=("${CORE_TESTS[@]}")
    python -c "import trl" 2>/dev/null && tests+=("${TRL_TESTS[@]}")
    core=$(check tests "$logs/tests.log" python -m pytest -q -x -p no:cacheprovider "${tests[@]}")
    core="$core ($(tail -n 1 "$logs/tests.log" | sed 's/=//g; s/^ *//; s/ *$//'))"
    fused=$(check triton "$logs/fused.log" python -m pytest -q -x -p no:cacheprovider "${TRITON_TESTS[@]}")
    fused="$fused ($(tail -n 1 "$logs/fused.log" | sed 's/=//g; s/^ *//; s/ *$//'))"
    row="| $set | $versions | $example | $help | $train | $core | $fused |"
  fi
  deactivate
  echo "$row" | tee "$RESULTS/$set.md"
done
echo "| set | versions | README example | --help | train (3 steps) | ${CORE_TESTS[*]}${TRL_TESTS:+ (+ ${TRL_TESTS[*]} with TRL)} | fused lm_head, Triton cases |" >&2
