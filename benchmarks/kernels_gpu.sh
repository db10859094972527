#!/usr/bin/env bash
# One device call: GPU tests of k3ray/kernels, then the expert-FFN benchmark (optionally tuning first).
#   OUT=/some/dir bash benchmarks/kernels_gpu.sh [--tune]
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/k3ray_kernels}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest tests/test_kernels.py -q -x -p no:cacheprovider 2>&1 | tee "$OUT/tests.log"
echo "tests rc=$?"
timeout ${BENCH_TIMEOUT:-420} python3 benchmarks/expert_ffn.py --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
echo "bench rc=$?"
