#!/usr/bin/env bash
# The served path on one GPU machine (device tool): `serve_load.py` on the gpu2 model (4 layers, then 8), logging to
# $OUT. Carry .carry/ray (benchmarks/carry_ray.sh) and .carry/kcache (the kept kernel cache that
# benchmarks/weeks_gpu.sh brings back), or .carry/grammar instead of the kernel cache for serve_load's --kind
# json_schema | tool_call (xgrammar). Each stage has a timeout so one call stays inside its limit. The seeded
# weights are written once per model (`k3ray init`) and served by every variant: VARIANTS4 holds serve_load.py
# argument sets separated by ';' (default: the config's settings).
# TOKENIZER=k3 serves a K3-style tokenizer instead of the config's (bytes): benchmarks/k3_style_tokenizer.py trains it
# on the repository's sources into /root/k3tok (16384 tokens; the chat and tool-call markers one special token each,
# Kimi K2's chat template), and `k3ray init` records it (data.tokenizer, model.vocab_size its size), which serving
# reads from the checkpoint. It needs .carry/grammar (tokenizers, transformers).
#   bash benchmarks/serve_gpu.sh [extra serve_load.py arguments for every run]
#   bash benchmarks/serve_gpu.sh --prompt-tokens 200:1200 --max-tokens 32:256   # real prompt lengths, defaults
#   TOKENIZER=k3 VARIANTS4="--kind chat_tools+tool_call" bash benchmarks/serve_gpu.sh --prompt-tokens 200:1200
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/site /root
tar -xJf .carry/ray/site.tar.xz -C /tmp/site
[[ -f .carry/grammar/site.tar.xz ]] && tar -xJf .carry/grammar/site.tar.xz -C /tmp/site  # xgrammar (carry_ray.sh)
mkdir -p /root/kcache; [[ -f .carry/kcache/kcache.tar.xz ]] && tar -xJf .carry/kcache/kcache.tar.xz -C /root/kcache
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 K3RAY_KERNEL_CACHE=/root/kcache PYTHONUNBUFFERED=1 \
       K3RAY_OBJECT_STORE_GB=24 RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0
mount -o remount,size=80G /dev/shm 2>/dev/null || true
rm -rf /root/k3 && cp -r . /root/k3 && cd /root/k3   # a later device call replaces the repository folder
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, ray, uvicorn; print(torch.__version__, ray.__version__, uvicorn.__version__)" | tee -a "$OUT/gpu.txt"
COMMON=(--max-tokens 64 --front-doors "${FRONT_DOORS:-4}" --client-procs "${CLIENT_PROCS:-8}")
TOKSET=()  # `k3ray init` overrides of the tokenizer (TOKENIZER)
case "${TOKENIZER:-}" in
    "") ;;
    k3) vocab=$(python3 benchmarks/k3_style_tokenizer.py /root/k3tok 2>>"$OUT/gpu.txt") || exit 1
        TOKSET=(--set data.tokenizer=/root/k3tok --set "model.vocab_size=$vocab") ;;
    *) echo "TOKENIZER=$TOKENIZER: empty (the config's) or k3" >&2; exit 2 ;;
esac

serve_model() {  # name, layers, timeout, levels, variants
    local name=$1 layers=$2 limit=$3 levels=$4 variants=$5 t0=$SECONDS i=0
    rm -rf "/root/w$layers"
    timeout "$limit" python3 -m k3ray.control.cli init --config "${CONFIG:-configs/gpu2.yaml}" --set "model.n_layers=$layers" \
        "${TOKSET[@]}" --out "/root/w$layers" > "$OUT/init_$name.txt" 2>&1
    echo "$name: weights rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/gpu.txt"
    IFS=';' read -ra sets <<< "$variants"
    for v in "${sets[@]}"; do
        i=$((i + 1)); t0=$SECONDS
        # shellcheck disable=SC2086 # a variant is a list of arguments
        timeout "$limit" python3 benchmarks/serve_load.py --checkpoint "/root/w$layers" --concurrency $levels \
            "${COMMON[@]}" $v "${@:6}" > "$OUT/serve_${name}_$i.txt" 2>&1
        echo "$name variant $i ($v): rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/gpu.txt"
    done
    rm -rf "/root/w$layers"
}
[[ "${T4:-300}" != 0 ]] && serve_model 4layers 4 "${T4:-300}" "${LEVELS4:-1 16 64 256}" "${VARIANTS4:- }" "$@"
[[ "${T8:-400}" != 0 ]] && serve_model 8layers 8 "${T8:-400}" "${LEVELS8:-1 64}" "${VARIANTS8:- }" "$@"
exit 0
