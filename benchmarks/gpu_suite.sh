#!/usr/bin/env bash
# The device command: everything one GPU run should produce, offline, in at most 9 minutes on an H100 / H200.
#
#   bash benchmarks/gpu_suite.sh          # on the GPU machine (no network; peers from .whl/ if carried)
#   bash benchmarks/gpu_suite.sh          # without CUDA: the same stages in smoke mode (CI runs this)
#
# No pip against an index, ever: the package runs from this working tree (PYTHONPATH), and the
# peers (liger-kernel, trl's kernel file) come from wheels in .whl/ (scripts/device_wheels.sh
# fills it) installed with --no-index. Stages, in order of value, each under its own time limit
# sent as SIGINT (pytest-benchmark and the sweep still write what finished) with a kill grace:
#   a. tests on the compiled kernels      -> tests.txt (GRPO_SUITE_TESTS="pytest args" picks others): the
#      schedules and workspaces changed last first, then the kernels' wider tests while the limit lasts
#   b. the sweep that decides the configs -> sweep.json (winners: python benchmarks/sweep.py --apply);
#      on the GPU its winners are applied to this copy's tuned.json, so the benchmarks that follow
#      time the defaults a commit of that sweep would ship
#   c. logits-path benchmarks vs peers    -> bench.json (+ bench.png): the loss (fwd, fwd+bwd) against
#      Liger and TRL's kernel at three shapes, the log-prob pass (old / reference log-probs), then the
#      sampler's kept set (against the loss without it) and the top-k forward KL (against the eager one)
#   d. fused lm_head benchmarks vs peers  -> bench_fused_linear.json: fwd and fwd+bwd against stock TRL's
#      own head and Liger's, time and peak memory
#   e. a whole GRPO step of real model shapes, per loss path (benchmarks/train_step.py) -> steps.json:
#      Qwen2.5-0.5B and 1.5B at 16 x 1024 first; ours fused, stock TRL, ours logits, Liger, eager
#   f. torch.profiler of one end-to-end loss call, every kernel and its time -> steps.json
#   g. compute-sanitizer (memcheck, then racecheck, synccheck) on every kernel and schedule once
#      (benchmarks/sanitize_cases.py)      -> appended to tests.txt
#   h. Nsight Compute counters (the read-once one-pass schedule: DRAM read / S, L2 hit) -> ncu.csv
#   i. a 2-way vocabulary-parallel step   -> steps.json (two ranks on the one GPU, gloo; GPU: only with T_VP set)
#   and report.md (every table), run.log (versions, GPU, each stage's status and output).
# The whole run is held to SUITE_LIMIT seconds: a stage gets at most what is left of it.
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
# Stage limits in seconds (GPU). The H200 run of 2026-12-04 (424 s in all) hit the limits of tests (105), bench
# (72), fused (52) and the whole step (55) with rows missing, and the sanitizer's pytest selection did not finish
# in 28 s; ncu took 10 s, the vocabulary-parallel step 13. The limits below plan 435 s of stages, each cut by
# SIGINT (pytest-benchmark and the sweep keep what finished) and killed GRACE s later, and the run as a whole
# is held to SUITE_LIMIT (9 minutes, the device call's planned length, with room left for a second call).
T_TESTS=${T_TESTS:-55} T_SWEEP=${T_SWEEP:-85} T_BENCH=${T_BENCH:-70} T_FUSED=${T_FUSED:-50} T_TRAIN=${T_TRAIN:-105}
T_PROFILE=${T_PROFILE:-15} T_SAN=${T_SAN:-35} T_NCU=${T_NCU:-20} T_VP=${T_VP:-$( [ "$MODE" = gpu ] && echo 0 || echo 60 )}
SUITE_LIMIT=${SUITE_LIMIT:-540}
GRACE=5
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

# clamp SECONDS: a stage's limit, at most what SUITE_LIMIT leaves (less a kill's grace and the report's 15 s)
clamp() {
    local left=$((SUITE_LIMIT - SECONDS - GRACE - 15))
    echo $(( $1 < left ? $1 : left ))
}

# stage NAME SECONDS COMMAND...: run under a SIGINT time limit (clamped), log its status and its last lines; a
# limit under 5 s (0: the stage is off) skips it.
stage() {
    local name=$1 asked=$2; shift 2
    local limit
    limit=$(clamp "$asked")
    if [ "$limit" -lt 5 ]; then
        say "stage $name: skipped ($( [ "$asked" -eq 0 ] && echo 'off' || echo "the suite's ${SUITE_LIMIT} s are spent"))"
        : > "$OUT/.stage.txt"
        return 0
    fi
    say "stage $name (limit ${limit} s): $*"
    local start=$SECONDS
    timeout -s INT -k "$GRACE" "$limit" "$@" > "$OUT/.stage.txt" 2>&1
    local rc=$?
    say "stage $name: rc=$rc$( [ $rc -eq 124 ] && echo ' (time limit: partial results kept)') in $((SECONDS - start)) s"
    tail -n 15 "$OUT/.stage.txt" | tee -a "$LOG"
    return 0
}

FIRST_TESTS=()
if [ -n "${GRPO_SUITE_TESTS:-}" ]; then
    eval "TESTS=($GRPO_SUITE_TESTS)"  # pytest arguments as a shell would split them (quotes for -k)
elif [ "$MODE" = gpu ]; then
    # first what changed last (batch invariance on the compiled default schedules, the read-once schedule,
    # pipelining, the eviction hints, 128-bit loads over many warps, the lm_head's tiled workspaces), then the
    # kernels' tests (the torch-path cases and torch.compile did not fit in the time), the reduction kernels' own
    # last (the loss tests above run them too)
    FIRST="invariant or on_policy or persistent or pipelining or many_warps or bounded or without_gradient"
    FIRST_TESTS=(tests/test_batch_invariance.py tests/test_loss.py tests/test_fused_linear.py
                 -k "$FIRST or three_products_mode_matches")
    TESTS=(tests/test_cuda_graph.py tests/test_split_row.py tests/test_loss.py tests/test_fused_linear.py
           tests/test_reliability.py tests/test_lean_backward.py tests/test_api.py tests/test_methods.py
           tests/test_liger_parity.py tests/test_drop_last_position.py tests/test_entropy_bonus.py
           tests/test_policy_masks.py tests/test_packed.py tests/test_reduce.py -k "not torch")
else  # the stage's mechanics on a few of the CPU suite's own cases (it runs all 36 of them itself)
    TESTS=("tests/test_reliability.py::test_randomized_against_an_fp64_oracle_with_padding_garbage["{0,1,2,3}"]")
fi
# the first set (if any), then the rest in what the stage's limit leaves, as one command for the time limit
RUN_TESTS="python3 -m pytest $(printf '%q ' "${TESTS[@]}") -q -p no:cacheprovider --durations=10"
if [ ${#FIRST_TESTS[@]} -gt 0 ]; then
    RUN_TESTS="python3 -m pytest $(printf '%q ' "${FIRST_TESTS[@]}") -q -p no:cacheprovider --durations=5; $RUN_TESTS"
fi
stage tests "$T_TESTS" bash -c "$RUN_TESTS"
cp "$OUT/.stage.txt" "$OUT/tests.txt"
L=$(clamp "$T_SWEEP")
stage sweep "$L" python3 benchmarks/sweep.py --out "$OUT/sweep.json" --budget $((L - 10)) \
    $( [ "$MODE" = smoke ] && echo --smoke )
if [ "$MODE" = gpu ] && [ -s "$OUT/sweep.json" ]; then
    python3 benchmarks/sweep.py --apply "$OUT/sweep.json" >> "$LOG" 2>&1 || say "applying the sweep's winners failed"
fi
stage bench "$T_BENCH" python3 -m pytest benchmarks/test_bench_loss.py -q -p no:cacheprovider -o addopts="" \
    --benchmark-json="$OUT/bench.json"
stage bench_fused_linear "$T_FUSED" python3 -m pytest benchmarks/test_bench_fused_linear.py -q -p no:cacheprovider \
    -o addopts="" --benchmark-json="$OUT/bench_fused_linear.json"
L=$(clamp "$T_TRAIN")
stage train_step "$L" python3 benchmarks/train_step.py --out "$OUT/train_step.json" --budget $((L - 8)) \
    $( [ "$MODE" = smoke ] && echo --smoke )
stage profile "$T_PROFILE" python3 benchmarks/profile_loss.py --out "$OUT/profile.json" \
    $( [ "$MODE" = smoke ] && echo --smoke )
L=$(clamp "$T_SAN")
stage sanitize "$L" python3 benchmarks/sanitize.py --budget $((L - 4)) $( [ "$MODE" = smoke ] && echo --dry-run )
{ echo; echo "== compute-sanitizer (benchmarks/sanitize.py)"; cat "$OUT/.stage.txt"; } >> "$OUT/tests.txt"
if [ "$MODE" = gpu ] && command -v ncu > /dev/null; then
    NCU=$(python3 -c "import ncu_target as n, shlex; print(shlex.join(n.ncu_command('python3', '$OUT/sweep.json')))")
    stage ncu "$T_NCU" bash -c "$NCU > '$OUT/ncu.csv'"
else
    stage ncu 60 python3 benchmarks/ncu_target.py --dry-run --sweep "$OUT/sweep.json"
fi
L=$(clamp "$T_VP")
stage vocab_parallel "$L" python3 benchmarks/vocab_parallel.py --out "$OUT/vocab_parallel.json" \
    --timeout $((L - 5))

REPORT=(python3 benchmarks/report.py)
for f in bench.json bench_fused_linear.json; do [ -s "$OUT/$f" ] && REPORT+=("$OUT/$f"); done
[ "$MODE" = smoke ] && [ -s "$OUT/bench.json" ] && REPORT+=(--plot "$OUT/bench.png")
[ -s "$OUT/vocab_parallel.json" ] && REPORT+=(--vocab-parallel "$OUT/vocab_parallel.json")
[ -s "$OUT/train_step.json" ] && REPORT+=(--train-step "$OUT/train_step.json")
[ -s "$OUT/profile.json" ] && REPORT+=(--profile "$OUT/profile.json")
[ -s "$OUT/sweep.json" ] && REPORT+=(--sweep "$OUT/sweep.json")
[ -s "$OUT/ncu.csv" ] && REPORT+=(--ncu "$OUT/ncu.csv")
"${REPORT[@]}" > "$OUT/report.md" 2>> "$LOG" || say "report failed (see above)"
# the whole-step, vocabulary-parallel and profile stages in one file (8 files is the device's limit)
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
