#!/usr/bin/env bash
# Serving's start and a lost worker on one GPU machine (device tool), logs in $OUT: the seeded gpu2 weights at 4
# layers (`k3ray init`), then `serve_faults.py` on them with the device's default serving sizes (pp1 x ep1: the one
# worker SIGKILLed mid-stream, every stream checked against its undisturbed tokens; the engine's start and the
# recovery in phases), then `serve_load.py` short prompts at concurrency 64 (the short-prompt figure). Carry
# .carry/ray and .carry/kcache.
#   bash benchmarks/serve_recovery_gpu.sh        (T_FAULTS, T_LOAD: each stage's limit in s; DRILLS, LOAD_ARGS)
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/site /root/kcache
tar -xJf .carry/ray/site.tar.xz -C /tmp/site
[[ -f .carry/kcache/kcache.tar.xz ]] && tar -xJf .carry/kcache/kcache.tar.xz -C /root/kcache
export NCCL_NVLS_ENABLE=0 K3RAY_KERNEL_CACHE=/root/kcache PYTHONUNBUFFERED=1 K3RAY_OBJECT_STORE_GB=24 \
       RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0
mount -o remount,size=80G /dev/shm 2>/dev/null || true
rm -rf /root/k3 && cp -r . /root/k3 && cd /root/k3   # a later device call replaces the repository folder
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
stage() { local name=$1 limit=$2; shift 2; local t0=$SECONDS; timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1; \
  echo "$name rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/gpu.txt"; }
stage init 120 python3 -m k3ray.control.cli init --config configs/gpu2.yaml --set model.n_layers=4 --out /root/w4
stage faults "${T_FAULTS:-240}" python3 benchmarks/serve_faults.py --checkpoint /root/w4 --pp 1 --ep 1 --kill 0 \
  --drills "${DRILLS:-2}" --concurrency 12 --max-tokens 256 --server-defaults
# shellcheck disable=SC2086 # LOAD_ARGS is a list of arguments
[[ "${T_LOAD:-150}" != 0 ]] && stage load "${T_LOAD:-150}" python3 benchmarks/serve_load.py --checkpoint /root/w4 \
  --concurrency 64 --max-tokens 64 --front-doors 4 --client-procs 8 ${LOAD_ARGS:-}
tar -C /root/kcache -cJf "$OUT/kcache.tar.xz" . && du -h "$OUT/kcache.tar.xz"
exit 0
