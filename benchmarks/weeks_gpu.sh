#!/usr/bin/env bash
# Snapshot stalls and warm starts on one GPU machine (device tool), logs in $OUT: `k3ray warmup` (the training kernels
# into the kept cache, TWARM=0 skips it), then benchmarks/weeks_gpu.py on gpu2
# with the released features at 4 layers (40 steps, a snapshot every 10; then the same job again, warm) and at 8
# layers (its state against the object store). Carry .carry/ray (benchmarks/carry_ray.sh); the kept kernel cache
# comes back as $OUT/kcache.tar.xz (carry it as .carry/kcache/kcache.tar.xz to start warm).
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/site /root/kcache
tar -xJf .carry/ray/site.tar.xz -C /tmp/site
[[ -f .carry/kcache/kcache.tar.xz ]] && tar -xJf .carry/kcache/kcache.tar.xz -C /root/kcache
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 K3RAY_OBJECT_STORE_GB="${STORE_GB:-64}" RAY_AUTH_MODE=token \
       RAY_USAGE_STATS_ENABLED=0 K3RAY_KERNEL_CACHE=/root/kcache
mount -o remount,size=100G /dev/shm 2>/dev/null || true
rm -rf /root/k3 && cp -r . /root/k3 && cd /root/k3   # a later device call replaces the repository folder
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, ray, triton; print(torch.__version__, ray.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
. "$(dirname "${BASH_SOURCE[0]}")/released.sh"   # RELEASED: the released K3's features as --set arguments
stage() { local name=$1 limit=$2; shift 2; echo "== $name ($(date -u +%T), limit ${limit}s)"; \
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$? ($(date -u +%T))"; tail -n 16 "$OUT/$name.log"; }
# the training kernels compiled and autotuned first (a kernel cache carried from serving holds none of them: the job
# would spend minutes autotuning its first step); a no-op check where the cache has them
# shellcheck disable=SC2086 # RELEASED is a list of arguments
[[ "${TWARM:-240}" != 0 ]] && stage warmup "${TWARM:-240}" python3 -m k3ray.control.cli warmup --config configs/gpu2.yaml \
  --set parallel.ep=1 $RELEASED
# shellcheck disable=SC2086
[[ "${T4:-330}" != 0 ]] && stage weeks4 "${T4:-330}" python3 benchmarks/weeks_gpu.py --config configs/gpu2.yaml \
  --set parallel.ep=1 $RELEASED --set model.n_layers=4 --steps "${STEPS4:-40}" --snapshot-every "${EVERY4:-10}" --warm-steps "${WARM4:-3}" \
  --out "$OUT/w4"
# shellcheck disable=SC2086
[[ "${T8:-150}" != 0 ]] && stage weeks8 "${T8:-150}" python3 benchmarks/weeks_gpu.py --config configs/gpu2.yaml \
  --set parallel.ep=1 $RELEASED --steps "${STEPS8:-8}" --snapshot-every "${EVERY8:-auto}" --warm-steps 0 --out "$OUT/w8"
tar -C /root/kcache -cJf "$OUT/kcache.tar.xz" . && du -h "$OUT/kcache.tar.xz"
exit 0
