#!/bin/bash
# Build the dev cubin (all test kernels + tuning candidates) for sm_90.
# usage: build.sh [out.cubin] [extra nvcc flags...]
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT=${1:-$HERE/dev_kernels.cubin}; shift || true
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
# Tuning candidates: CB_TUNE(tag, D, BM, BN, Warps, Stages[, QInRegs]); tag starts with t<D>.
TUNING=${CB_TUNING-"CB_TUNE(t128w8, 128, 128, 64, 8, 2) CB_TUNE(t128lazy0, 128, 128, 64, 4, 2, false, false) CB_TUNE(t64w8, 64, 128, 64, 8, 2) CB_TUNE(t64lazy1, 64, 128, 64, 4, 2, true, true)"}
echo "$TUNING" > "$HERE/tuning.inc"
$NVCC -cubin -arch=${ARCH:-sm_90} -O3 -std=c++17 -Xptxas -v -I "$ROOT/csrc" -I "$HERE" \
  "$@" "$HERE/dev_kernels.cu" -o "$OUT" 2>&1 |
  grep -E "Compiling entry|registers|spill" | paste - - - |
  sed -E "s/ptxas info *: //g; s/Compiling entry function//; s/Function properties for [a-z0-9_]+//; s/for .sm_[0-9]+.//; s/ +/ /g"
