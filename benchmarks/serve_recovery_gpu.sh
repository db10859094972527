#!/usr/bin/env bash
# Serving on one GPU machine with the defaults a user gets (device tool), logs in $OUT, stages in order of importance,
# each under its own timeout: the seeded gpu2 weights at 4 layers (`k3ray init`); `serve_start.py` (`k3ray serve`
# started twice as a user starts it: seconds to /health and to the first answer, the start in phases);
# `serve_faults.py` (pp1 x ep1, the one worker SIGKILLed mid-stream, every stream checked against its undisturbed
# tokens; the engine's start and the recovery in phases); `serve_load.py` with real prompt lengths (200-1,200 tokens,
# max_tokens 32-256) at concurrency 1 / 16 / 64; `prefill_gpu.py` (no Ray) at concurrency 64 with
# serve.iteration_target_ms=20 and the profiled mixed iteration; `serve_load.py` short prompts at concurrency 64.
# Not by default: `kills` (serve_faults.py --kills: pp1 x ep1 at the defaults, the worker SIGKILLed KILLS times at
# random moments, during a prefill, mid-iteration, just after a token; the gap per kill, median and worst).
# Carry .carry/ray and .carry/kcache.
#   bash benchmarks/serve_recovery_gpu.sh      (STAGES, and T_<STAGE> limits in s)
#   STAGES="init kills" bash benchmarks/serve_recovery_gpu.sh
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/site /root/kcache
tar -xJf .carry/ray/site.tar.xz -C /tmp/site
[[ -f .carry/grammar/site.tar.xz ]] && tar -xJf .carry/grammar/site.tar.xz -C /tmp/site  # xgrammar (carry_ray.sh)
[[ -f .carry/kcache/kcache.tar.xz ]] && tar -xJf .carry/kcache/kcache.tar.xz -C /root/kcache
export NCCL_NVLS_ENABLE=0 K3RAY_KERNEL_CACHE=/root/kcache TRITON_CACHE_DIR=/root/kcache/triton \
       TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1 K3RAY_OBJECT_STORE_GB=24 RAY_AUTH_MODE=token \
       RAY_USAGE_STATS_ENABLED=0
mount -o remount,size=80G /dev/shm 2>/dev/null || true
rm -rf /root/k3 && cp -r . /root/k3 && cd /root/k3   # a later device call replaces the repository folder
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
stage() { local name=$1 limit=$2; shift 2; local t0=$SECONDS; timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; \
  echo "$name rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/gpu.txt"; }
LOAD=(python3 benchmarks/serve_load.py --checkpoint /root/w4 --front-doors 4 --client-procs 8)
for s in ${STAGES:-init start faults real prefill short}; do
  case $s in
    init) stage init "${T_INIT:-100}" python3 -m k3ray.control.cli init --config configs/gpu2.yaml \
            --set model.n_layers=4 --out /root/w4 ;;
    start) stage start "${T_START:-300}" python3 benchmarks/serve_start.py --checkpoint /root/w4 --runs 2 ;;
    faults) stage faults "${T_FAULTS:-170}" python3 benchmarks/serve_faults.py --checkpoint /root/w4 --pp 1 --ep 1 \
              --kill 0 --drills "${DRILLS:-1}" --concurrency 12 --max-tokens 256 --server-defaults ;;
    kills) stage kills "${T_KILLS:-360}" python3 benchmarks/serve_faults.py --checkpoint /root/w4 --pp 1 --ep 1 \
             --kill 0 --kills "${KILLS:-10}" --concurrency 12 --max-tokens 128 --server-defaults ;;
    real) stage real "${T_REAL:-170}" "${LOAD[@]}" --concurrency 1 16 64 --prompt-tokens 200:1200 --max-tokens 32:256 ;;
    prefill) stage prefill "${T_PREFILL:-90}" python3 benchmarks/prefill_gpu.py --config configs/gpu2.yaml \
               --set model.n_layers=4 --stages levels,mixed --concurrency 64 --set serve.iteration_target_ms=20 ;;
    short) stage short "${T_SHORT:-120}" "${LOAD[@]}" --concurrency 64 --max-tokens 64 ;;
  esac
done
tar -C /root/kcache -cJf "$OUT/kcache.tar.xz" . && du -h "$OUT/kcache.tar.xz"
exit 0
