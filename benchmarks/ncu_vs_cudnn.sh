#!/usr/bin/env bash
# ncu counters of our forward kernel next to SDPA's cuDNN kernel on the same inputs (full and causal,
# D 128 and 64, 4k): where the remaining gap to cuDNN goes (tensor pipe, L2 and DRAM throughput, issue
# stalls). Device call, repo root, $OUT set. Unlocked clocks (--clock-control none), as the benchmarks.
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUBRIDGE_CACHE_DIR=/tmp/cc
nvidia-smi -L; git log --oneline -1 | cut -c1-60
for plan in ${PLANS:-4096:128 4096:64}; do for v in ${VARIANTS:-full causal}; do
f=$OUT/ncu_${v}_${plan/:/_}.txt
timeout 200 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  python3 benchmarks/profile_kernels.py --ncu --cudnn --plan $plan --variants $v --out /tmp/o > $f 2>&1; echo "ncu $v $plan rc=$?"
grep -aE "^  [a-zA-Z_].*\(|Duration|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" $f | head -24
done; done
