#!/usr/bin/env bash
# The GPU suite in one prepared script (under 10 minutes on an H200): the tests on the compiled
# kernels, then the logits benchmarks and the fused lm_head benchmarks (each under its own
# time limit, so one overrun keeps the other's results), then the tables. Results go to $OUT
# (default benchmarks/results/gpu): commit them and copy the tables into the README.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export TRITON_DEFAULT_FP_FUSION=1
python -m pip install --quiet -e ".[test]" trl 2>&1 | tail -2
python -m pip install --quiet --no-deps liger-kernel 2>&1 | tail -2
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
timeout 180 python -m pytest tests -q -x -p no:cacheprovider --ignore=tests/test_trainer.py \
    --ignore=tests/test_distributed.py > "$OUT/tests.txt" 2>&1
echo "tests rc=$?" >> "$OUT/tests.txt"
timeout 200 python -m pytest benchmarks/test_bench_loss.py -q -p no:cacheprovider \
    --benchmark-json="$OUT/bench.json" > "$OUT/bench.txt" 2>&1
echo "bench rc=$?" >> "$OUT/bench.txt"
timeout 150 python -m pytest benchmarks/test_bench_fused_linear.py -q -p no:cacheprovider \
    --benchmark-json="$OUT/bench_fused_linear.json" > "$OUT/bench_fused_linear.txt" 2>&1
echo "bench rc=$?" >> "$OUT/bench_fused_linear.txt"
python benchmarks/report.py "$OUT/bench.json" --plot "$OUT/bench.png" > "$OUT/bench.md" 2>&1
python benchmarks/report.py "$OUT/bench_fused_linear.json" > "$OUT/bench_fused_linear.md" 2>&1
tail -n 3 "$OUT/tests.txt" "$OUT/bench.txt" "$OUT/bench_fused_linear.txt"
