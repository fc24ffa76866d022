#!/usr/bin/env bash
# ncu counters of the forward kernel (document vs causal, 4k, D 128): throughput, issue and the
# stall reasons per issued instruction. Device call, repo root, $OUT set.
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CUBRIDGE_CACHE_DIR=/tmp/cc
nvidia-smi -L; git log --oneline -1 | cut -c1-60
for v in document causal; do
timeout 150 ncu --clock-control none --profile-from-start off --kernel-name cubridge_fwd --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio python3 benchmarks/profile_kernels.py --ncu --plan 4096:128 --variants $v --out /tmp/o > $OUT/ncu_$v.txt 2>&1; echo "ncu $v rc=$?"
grep -aE "Duration|Compute \(SM\) Throughput|Memory Throughput|No Eligible|Warp Cycles Per Issued|Executed Instructions  " $OUT/ncu_$v.txt | head -8
grep -a "issue_stalled" $OUT/ncu_$v.txt | awk '$NF+0 > 0.1' | sort -k3 -nr | head -12
done
