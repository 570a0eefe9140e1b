#!/usr/bin/env bash
# The device command: everything one GPU run should produce, offline, in about 7 minutes on an H200.
#
#   bash benchmarks/gpu_suite.sh          # on the GPU machine (no network; peers from .whl/ if carried)
#   bash benchmarks/gpu_suite.sh          # without CUDA: the same stages in smoke mode (CI runs this)
#
# No pip against an index, ever: the package runs from this working tree (PYTHONPATH), and the
# peers (liger-kernel, trl's kernel file) come from wheels in .whl/ (scripts/device_wheels.sh
# fills it) installed with --no-index. Stages, in order of value, each under its own time limit
# sent as SIGINT (pytest-benchmark and the sweep still write what finished) with a kill grace:
#   a. tests on the compiled kernels      -> tests.txt (GRPO_SUITE_TESTS="pytest args" picks others)
#   b. the sweep that decides the configs -> sweep.json (winners: python benchmarks/sweep.py --apply);
#      on the GPU its winners are applied to this copy's tuned.json, so the benchmarks that follow
#      time the defaults a commit of that sweep would ship
#   c. logits-path benchmarks vs peers    -> bench.json (+ bench.png)
#   d. fused lm_head benchmarks vs peers  -> bench_fused_linear.json
#   e. a whole GRPO step of real model shapes, per loss path (benchmarks/train_step.py) -> steps.json
#   f. compute-sanitizer (memcheck, racecheck, synccheck) on every kernel -> appended to tests.txt
#   g. Nsight Compute counters            -> ncu.csv
#   h. a 2-way vocabulary-parallel step   -> steps.json (two ranks on the one GPU, gloo)
#   and report.md (every table), run.log (versions, GPU, each stage's status and output).
# The logits benchmarks' plot is drawn here, not there, from bench.json (report.py --plot): 8 files is the limit.
# At most 8 files in $OUT, the device tool's limit. Without CUDA: tiny shapes, Triton's
# interpreter, a test subset, the sweep runs two candidates and lists the rest, ncu is listed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    MODE=gpu
else
    MODE=smoke
    export TRITON_INTERPRET=1 GRPO_BENCH_SMOKE=1
fi
OUT=${OUT:-$( [ "$MODE" = gpu ] && echo benchmarks/results/gpu || mktemp -d )}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOG="$OUT/run.log"
: > "$LOG"
export TRITON_DEFAULT_FP_FUSION=1 PYTHONUNBUFFERED=1 PIP_NO_INDEX=1
# Stage limits in seconds (GPU). The first runs used tests 80, sweep 57, bench 69, fused 50, ncu 9 s of their
# limits (318 and 290 s in all): the limits below plan about 400 s in use plus start-up, under 420, so that a
# second run fits the device's 15 minutes.
T_TESTS=${T_TESTS:-105} T_BENCH=${T_BENCH:-72} T_FUSED=${T_FUSED:-52} T_SWEEP=${T_SWEEP:-62} T_NCU=${T_NCU:-25}
T_TRAIN=${T_TRAIN:-55} T_SAN=${T_SAN:-32} T_VP=${T_VP:-28}
GRACE=10
say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

say "grpo-kernels device suite, mode=$MODE, results in $OUT"
SITE=$(mktemp -d)
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
        >> "$LOG" 2>&1 && say "peers from .whl/: $(ls .whl | tr '\n' ' ')" || say "installing .whl/ failed (see above)"
else
    say "no .whl/ wheels: peers that are not installed are left out (scripts/device_wheels.sh fills .whl/)"
fi
export PYTHONPATH="$REPO:$REPO/benchmarks:$SITE${PYTHONPATH:+:$PYTHONPATH}"
python3 - >> "$LOG" 2>&1 <<'EOF'
import importlib.metadata, platform, torch, triton
print(f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}")
for dist in ("numpy", "pytest", "pytest-benchmark", "liger-kernel", "trl"):
    try:
        print(f"{dist} {importlib.metadata.version(dist)}")
    except importlib.metadata.PackageNotFoundError:
        print(f"{dist}: not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, "
          f"sm_{p.major}{p.minor}, CUDA {torch.version.cuda}")
else:
    print("no CUDA: smoke mode")
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >> "$LOG" 2>&1 || true
cat "$LOG"

# stage NAME SECONDS COMMAND...: run under a SIGINT time limit, log its status and its last lines.
stage() {
    local name=$1 limit=$2; shift 2
    say "stage $name (limit ${limit} s): $*"
    local start=$SECONDS
    timeout -s INT -k "$GRACE" "$limit" "$@" > "$OUT/.stage.txt" 2>&1
    local rc=$?
    say "stage $name: rc=$rc$( [ $rc -eq 124 ] && echo ' (time limit: partial results kept)') in $((SECONDS - start)) s"
    tail -n 15 "$OUT/.stage.txt" | tee -a "$LOG"
    return 0
}

if [ -n "${GRPO_SUITE_TESTS:-}" ]; then
    eval "TESTS=($GRPO_SUITE_TESTS)"  # pytest arguments as a shell would split them (quotes for -k)
elif [ "$MODE" = gpu ]; then
    # the kernels' tests (the torch-path cases and torch.compile did not fit in the time); the reduction kernels'
    # own tests last (the loss tests above run them too): a time limit cuts them first
    TESTS=(tests/test_split_row.py tests/test_cuda_graph.py tests/test_loss.py tests/test_fused_linear.py tests/test_reliability.py
           tests/test_lean_backward.py tests/test_api.py tests/test_family.py tests/test_liger_parity.py
           tests/test_drop_last_position.py tests/test_entropy_bonus.py tests/test_policy_masks.py tests/test_packed.py
           tests/test_reduce.py -k "not torch")
else
    TESTS=(tests/test_reliability.py -k "randomized_against_an_fp64_oracle and not lm_head")
fi
stage tests "$T_TESTS" python3 -m pytest "${TESTS[@]}" -q -p no:cacheprovider --durations=10
cp "$OUT/.stage.txt" "$OUT/tests.txt"
stage sweep "$T_SWEEP" python3 benchmarks/sweep.py --out "$OUT/sweep.json" --budget $((T_SWEEP - 10)) \
    $( [ "$MODE" = smoke ] && echo --smoke )
if [ "$MODE" = gpu ] && [ -s "$OUT/sweep.json" ]; then
    python3 benchmarks/sweep.py --apply "$OUT/sweep.json" >> "$LOG" 2>&1 || say "applying the sweep's winners failed"
fi
stage bench "$T_BENCH" python3 -m pytest benchmarks/test_bench_loss.py -q -p no:cacheprovider -o addopts="" \
    --benchmark-json="$OUT/bench.json"
stage bench_fused_linear "$T_FUSED" python3 -m pytest benchmarks/test_bench_fused_linear.py -q -p no:cacheprovider \
    -o addopts="" --benchmark-json="$OUT/bench_fused_linear.json"
stage train_step "$T_TRAIN" python3 benchmarks/train_step.py --out "$OUT/train_step.json" --budget $((T_TRAIN - 8)) \
    $( [ "$MODE" = smoke ] && echo --smoke )
stage sanitize "$T_SAN" python3 benchmarks/sanitize.py --budget $((T_SAN - 4)) $( [ "$MODE" = smoke ] && echo --dry-run )
{ echo; echo "== compute-sanitizer (benchmarks/sanitize.py)"; cat "$OUT/.stage.txt"; } >> "$OUT/tests.txt"
if [ "$MODE" = gpu ] && command -v ncu > /dev/null; then
    NCU=$(python3 -c "import ncu_target as n, shlex; print(shlex.join(n.ncu_command('python3', '$OUT/sweep.json')))")
    stage ncu "$T_NCU" bash -c "$NCU > '$OUT/ncu.csv'"
else
    stage ncu 60 python3 benchmarks/ncu_target.py --dry-run --sweep "$OUT/sweep.json"
fi
stage vocab_parallel "$T_VP" python3 benchmarks/vocab_parallel.py --out "$OUT/vocab_parallel.json" \
    --timeout $((T_VP - 5))

REPORT=(python3 benchmarks/report.py)
for f in bench.json bench_fused_linear.json; do [ -s "$OUT/$f" ] && REPORT+=("$OUT/$f"); done
[ "$MODE" = smoke ] && [ -s "$OUT/bench.json" ] && REPORT+=(--plot "$OUT/bench.png")
[ -s "$OUT/vocab_parallel.json" ] && REPORT+=(--vocab-parallel "$OUT/vocab_parallel.json")
[ -s "$OUT/train_step.json" ] && REPORT+=(--train-step "$OUT/train_step.json")
[ -s "$OUT/sweep.json" ] && REPORT+=(--sweep "$OUT/sweep.json")
[ -s "$OUT/ncu.csv" ] && REPORT+=(--ncu "$OUT/ncu.csv")
"${REPORT[@]}" > "$OUT/report.md" 2>> "$LOG" || say "report failed (see above)"
# the two whole-step stages in one file (8 files is the device's limit)
python3 benchmarks/report.py --merge-steps "$OUT" >> "$LOG" 2>&1 || say "merging steps.json failed"
rm -f "$OUT/.stage.txt" "$OUT/sweep.tmp"
say "done in $SECONDS s; files: $(ls "$OUT" | tr '\n' ' ')"
# In smoke mode a stage that failed is a failed suite: CI must not land a suite that breaks.
if [ "$MODE" = smoke ]; then
    grep -q "passed" "$OUT/tests.txt" && ! grep -qE "[0-9]+ (failed|error)" "$OUT/tests.txt" || { say "smoke: tests failed"; exit 1; }
    for f in bench.json bench_fused_linear.json sweep.json steps.json report.md; do
        [ -s "$OUT/$f" ] || { say "smoke: $f is missing"; exit 1; }
    done
    grep -q "rc=[^0]" "$LOG" && { say "smoke: a stage failed"; exit 1; }
fi
exit 0
