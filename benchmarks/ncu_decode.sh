#!/usr/bin/env bash
# ncu counters of the decode kernel next to SDPA-flash's and cuDNN's split-KV kernels (B 8, 32:8 heads,
# D 128, 32k by default). Device call, repo root, $OUT set; unlocked clocks, as the benchmarks.
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUBRIDGE_CACHE_DIR=${CUBRIDGE_CACHE_DIR:-/tmp/cc}
f=$OUT/ncu_decode_B${B:-8}_${SKV:-32768}_p${PAGED:-0}.txt
timeout 240 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section Occupancy --section LaunchStats --section WarpStateStats \
  python3 benchmarks/diag_decode_ncu.py --B ${B:-8} --skv ${SKV:-32768} --paged ${PAGED:-0} > $f 2>&1; echo "ncu rc=$?"
grep -aE "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Memory Throughput|Grid Size|Registers Per|Achieved Occupancy|Waves Per SM|Block Limit|Warp Cycles Per Issued|L2 Hit|Mem Busy|Max Bandwidth" $f | head -80
