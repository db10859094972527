#!/usr/bin/env bash
# Real prompt lengths on one GPU machine (device tool), logs in $OUT: benchmarks/prefill_gpu.py (the scheduler and one
# StageServer without Ray: TTFT of one prompt, levels of concurrency, a profiled mixed iteration), then, if it ran
# without an exception, the served path (serve_gpu.sh) on the same workload. Carry .carry/ray and .carry/kcache; the
# kernel cache comes back (stripped) as $OUT/kcache.tar.xz with the serving shapes' autotune results added.
#   bash benchmarks/prefill_gpu.sh [prefill_gpu.py arguments]     (T_PREFILL, T_SERVE: each stage's limit in s; 0 skips)
# PREFILL_VARIANTS: more prefill_gpu.py runs after the first, argument sets separated by ';' (each under T_VARIANT s),
# e.g. PREFILL_VARIANTS="--stages levels --concurrency 64 --prompt-graphs off". T_TESTS=SECONDS (with .carry/tests)
# first runs the CUDA tests of the serving graphs (decode and prompt), of KDA's prefill (no host sync), of the
# packed convolution, of the prompt rows' packed attention and of a mixed iteration in bf16.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /root/kcache /tmp/site
tar -xJf .carry/ray/site.tar.xz -C /tmp/site   # pydantic (the config) comes with the carried Ray
[[ -f .carry/kcache/kcache.tar.xz ]] && tar -xJf .carry/kcache/kcache.tar.xz -C /root/kcache
export K3RAY_KERNEL_CACHE=/root/kcache TRITON_CACHE_DIR=/root/kcache/triton TRITON_CACHE_AUTOTUNING=1 \
       PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
repo=$PWD
rm -rf /root/k3p && cp -r . /root/k3p && cd /root/k3p && export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ "${T_TESTS:-0}" != 0 && -f .carry/tests/site.tar.xz ]]; then
  tar -xJf .carry/tests/site.tar.xz -C /tmp/site
  timeout -s INT "$T_TESTS" python3 -m pytest -v -p no:cacheprovider tests/test_prompt_graphs.py \
    tests/test_logit_masks.py tests/test_kda.py tests/test_kernels.py tests/test_serving_attention.py \
    -k "graph or waits_for_the_gpu_once or fla_prefill_is or short_conv_packed or flash_call or mixed_iteration" \
    > "$OUT/tests.txt" 2>&1
  echo "serving graph and prefill tests rc $?: $(tail -n 1 "$OUT/tests.txt")" | tee -a "$OUT/gpu.txt"
fi
t0=$SECONDS
if [[ "${T_PREFILL:-240}" != 0 ]]; then
  timeout "${T_PREFILL:-240}" python3 benchmarks/prefill_gpu.py --config configs/gpu2.yaml --set model.n_layers=4 "$@" \
    > "$OUT/prefill.txt" 2>&1
  echo "prefill rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/gpu.txt"
fi
IFS=';' read -ra variants <<< "${PREFILL_VARIANTS:-}"
for i in "${!variants[@]}"; do
  t0=$SECONDS
  # shellcheck disable=SC2086 # a variant is a list of arguments
  timeout "${T_VARIANT:-90}" python3 benchmarks/prefill_gpu.py --config configs/gpu2.yaml --set model.n_layers=4 \
    ${variants[$i]} > "$OUT/prefill_v$((i + 1)).txt" 2>&1
  echo "prefill variant $((i + 1)) (${variants[$i]}) rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/gpu.txt"
done
if [[ "${T_SERVE:-300}" != 0 ]] && ! grep -qs Traceback "$OUT/prefill.txt"; then
  cd "$repo" && T4="${T_SERVE:-300}" T8=0 LEVELS4="${LEVELS:-1 16 64}" \
    VARIANTS4="${VARIANTS:---prompt-tokens 200:1200 --max-tokens 32:256}" bash benchmarks/serve_gpu.sh
fi
cd /root/k3p && tar -C /root/kcache -cJf /tmp/kcache_full.tar.xz . && \
  python3 benchmarks/strip_kcache.py /tmp/kcache_full.tar.xz "$OUT/kcache.tar.xz" | tail -n 1
exit 0
