#!/usr/bin/env bash
# One device call: GPU tests (every test marked gpu), then the benchmarks. JSON and logs under $OUT,
# the GPU name first, a short table last. (test_llm_backend needs openai, whose httpx is not on the device.)
# Usage (on the device machine, repo root): bash benchmarks/run_gpu.sh [--quick|--no-bench|--serving|--train] [pytest -k expr]
# --train: the GPU tests, then only the forward-plus-backward benchmarks (bench_train.py, bench_train_model.py)
# --serving: the GPU tests, then only the decode benchmarks (the kernel, the flash API's block-table decode), the
# warm-start/host-time one and generate tokens/s
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export CUBRIDGE_CACHE_DIR=/tmp/cubridge-cache
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
# the exit status is the tests' (pipefail: pytest's own, not tail's); the benchmarks report in their logs
STATUS=0
MODE=${1:-}
K=${2:-}
# the GPU tests spend most of their time verifying in float64 on the CPU: with pytest-xdist (a wheel
# carried in .whl) they run in WORKERS processes sharing the one GPU, each with a few CPU threads
XDIST=""
if python3 -c "import xdist" 2>/dev/null; then XDIST="-n ${WORKERS:-6} --dist load"; export OMP_NUM_THREADS=2; fi
python3 -m pytest tests -m gpu -q -p no:cacheprovider -p no:logging --ignore tests/transfer/test_llm_backend.py $XDIST ${K:+-k "$K"} --junitxml="$OUT/gpu_tests.xml" \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -30 || STATUS=$?
# CPU tests that depend on the torch version's symbolic shapes (2.11 pinned every size once)
python3 -m pytest tests/capture/test_guards.py -q -p no:cacheprovider 2>&1 | tee "$OUT/guards_tests.log" | tail -3 || STATUS=$?
if [ "$MODE" = "--train" ]; then
  python3 benchmarks/bench_train.py --out "$OUT" 2>&1 | tee "$OUT/train.log" | tail -12
  python3 benchmarks/bench_train_model.py --out "$OUT" 2>&1 | tee "$OUT/train_model.log" | tail -4
  exit $STATUS
fi
if [ "$MODE" != "--no-bench" ] && [ "$MODE" != "--serving" ]; then
  python3 benchmarks/bench_attention.py $MODE --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -40
fi
if [ "$MODE" != "--no-bench" ]; then
  python3 benchmarks/bench_decode.py --out "$OUT" 2>&1 | tee "$OUT/decode.log" | tail -6
  python3 benchmarks/bench_flash_api.py --out "$OUT" 2>&1 | tee "$OUT/flash_api.log" | tail -10
  python3 benchmarks/warm_start.py --out "$OUT" 2>&1 | tee "$OUT/warm_start.log" | tail -6
  python3 benchmarks/cold_race.py --out "$OUT" 2>&1 | tee "$OUT/cold_race.log" | tail -10
  python3 benchmarks/bench_generate.py --rows 1x4096,8x4096 --out "$OUT" 2>&1 | tee "$OUT/generate.log" | tail -6
  python3 -m torch_cubridge bench tests/support/zoo.py:causal_sdpa --shape 4,16,4096,128 --out "$OUT/cli_bench" 2>&1 | tail -5
fi
exit $STATUS
