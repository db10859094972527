#!/usr/bin/env bash
# A weeks-long job's faults on one GPU machine at the defaults a user gets (device tool), logs in $OUT: the released
# layout (LAYERS, default 6: what fits an 80 GB H100; 8 on an H200) with a BPE-sized vocabulary trains STEPS steps
# with snapshots on the auto cadence in Ray's default object store (no K3RAY_OBJECT_STORE_GB, /dev/shm as the
# machine has it), world rank 0's process SIGKILLed during step KILL_AT (benchmarks/weeks_gpu.py); then gpu2's 8
# layers asked of `k3ray train` as a user would (the pre-flight memory check: trains, adjusted, or refused in one
# line). Carry .carry/ray (and .carry/kcache); the kept kernel cache comes back as $OUT/kcache.tar.xz.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/site /root/kcache
tar -xJf .carry/ray/site.tar.xz -C /tmp/site
[[ -f .carry/kcache/kcache.tar.xz ]] && tar -xJf .carry/kcache/kcache.tar.xz -C /root/kcache
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0 K3RAY_KERNEL_CACHE=/root/kcache
rm -rf /root/k3 && cp -r . /root/k3 && cd /root/k3
export PYTHONPATH=/tmp/site:$PWD
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2; df -h /dev/shm | tail -1
  python3 -c "import torch, ray, triton; print(torch.__version__, ray.__version__, triton.__version__)"; } | tee "$OUT/gpu.txt"
. benchmarks/released.sh
SHAPE="--config configs/gpu2.yaml --set parallel.ep=1 $RELEASED --set model.vocab_size=${VOCAB:-16384}"
stage() { local name=$1 limit=$2; shift 2; echo "== $name ($(date -u +%T), limit ${limit}s)"; \
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$? ($(date -u +%T))"; grep -v "^step [0-9]*:" "$OUT/$name.log" | tail -n "${TAIL:-40}"; }
# shellcheck disable=SC2086
[[ "${TWARM:-0}" != 0 ]] && stage warmup "$TWARM" python3 -m k3ray.control.cli warmup $SHAPE --set model.n_layers="${LAYERS:-6}"
# shellcheck disable=SC2086
[[ "${TWEEKS:-330}" != 0 ]] && stage weeks "${TWEEKS:-330}" python3 benchmarks/weeks_gpu.py $SHAPE \
  --set model.n_layers="${LAYERS:-6}" --steps "${STEPS:-100}" --snapshot-every auto --kill-at "${KILL_AT:-50}" \
  --warm-steps 0 --out "$OUT/weeks"
grep "^step" "$OUT/weeks.log" | awk 'NR % 10 == 1 || /SIGKILL|recovered/' | head -20
# shellcheck disable=SC2086
[[ "${TPRE:-150}" != 0 ]] && stage preflight8 "${TPRE:-150}" python3 -m k3ray.control.cli train $SHAPE --steps 3 \
  --no-progress
tar -C /root/kcache -cJf "$OUT/kcache.tar.xz" . && du -h "$OUT/kcache.tar.xz"
exit 0
