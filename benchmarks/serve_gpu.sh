#!/usr/bin/env bash
# The served path on one GPU machine (device tool): `serve_load.py` on the gpu2 model (4 layers, then 8), logging to
# $OUT. Carry .carry/ray (benchmarks/carry_ray.sh) and .carry/tcache (fla's Triton cache). Each stage has a timeout
# so one call stays inside its limit.
#   bash benchmarks/serve_gpu.sh [extra serve_load.py arguments for both stages]
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/site /root
tar -xJf .carry/ray/site.tar.xz -C /tmp/site
[[ -f .carry/tcache/tcache.tar.xz ]] && tar -xJf .carry/tcache/tcache.tar.xz -C /root
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TRITON_CACHE_DIR=/root/tcache PYTHONUNBUFFERED=1 \
       K3RAY_OBJECT_STORE_GB=24 RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0
mount -o remount,size=80G /dev/shm 2>/dev/null || true
rm -rf /root/k3 && cp -r . /root/k3 && cd /root/k3   # a later device call replaces the repository folder
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, ray, uvicorn; print(torch.__version__, ray.__version__, uvicorn.__version__)" | tee -a "$OUT/gpu.txt"
COMMON=(--max-tokens 64 --token-budget 2048 --front-doors "${FRONT_DOORS:-4}" --client-procs "${CLIENT_PROCS:-8}")
timeout "${T4:-300}" python3 benchmarks/serve_load.py --config configs/gpu2.yaml --set model.n_layers=4 \
    --concurrency ${LEVELS4:-1 16 64 256} "${COMMON[@]}" "$@" > "$OUT/serve_4layers.txt" 2>&1
echo "4 layers: rc $?" | tee -a "$OUT/gpu.txt"
[[ "${T8:-300}" == 0 ]] && exit 0
timeout "${T8:-300}" python3 benchmarks/serve_load.py --config configs/gpu2.yaml \
    --concurrency ${LEVELS8:-1 64} "${COMMON[@]}" "$@" > "$OUT/serve_8layers.txt" 2>&1
echo "8 layers: rc $?" | tee -a "$OUT/gpu.txt"
