#!/usr/bin/env bash
# One device call: GPU tests, correctness sweep, benchmarks. JSON under $OUT, a short table last.
# Usage (on the device machine, repo root): bash benchmarks/run_gpu.sh [--quick] [pytest -k expr]
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export CUBRIDGE_CACHE_DIR=/tmp/cubridge-cache
nvidia-smi -L
QUICK=${1:-}
K=${2:-}
python3 -m pytest tests/test_gpu.py tests/test_launch_gpu.py -q -x ${K:+-k "$K"} --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
python3 benchmarks/bench_attention.py $QUICK --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -40
