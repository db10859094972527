#!/usr/bin/env bash
# Where the released layout's training step goes on one GPU (device tool), logs in $OUT: `k3ray warmup` (the kept
# kernel cache, returned stripped as $OUT/kcache.tar.xz), then benchmarks/train_speed_gpu.py with the profiler on the 3:1
# KDA:MLA layout (eager and compiled blocks) and on the MLA-only layout. LAYERS (default 6: what fits an 80 GB H100)
# and VOCAB (16384: a BPE vocabulary) as the user's job would have them. Carry .carry/ray (and .carry/kcache;
# .carry/tests with TTESTS=SECONDS runs the CUDA-only tests of the step's kernels first; THOST=SECONDS counts the
# ops a step dispatches eagerly, by k3ray caller: benchmarks/host_syncs.py). VARIANTS/PROFILE name train_speed_gpu.py's
# variants (compile+graphs:fill = the job's defaults on a GPU: compiled blocks, micro-batches replayed as CUDA graphs);
# TCURVE=SECONDS runs loss curves of CURVES; TJOB=SECONDS runs `k3ray train` itself last.
set -uo pipefail
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT" /tmp/site /root/kcache
tar -xJf .carry/ray/site.tar.xz -C /tmp/site
[[ -f .carry/kcache/kcache.tar.xz ]] && tar -xJf .carry/kcache/kcache.tar.xz -C /root/kcache
[[ -f .carry/tests/site.tar.xz ]] && tar -xJf .carry/tests/site.tar.xz -C /tmp/site  # pytest: the CUDA tests
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0 K3RAY_KERNEL_CACHE=/root/kcache \
       TRITON_CACHE_DIR=/root/kcache/triton TRITON_CACHE_AUTOTUNING=1 TORCHINDUCTOR_CACHE_DIR=/root/kcache/inductor
rm -rf /root/k3 && cp -r . /root/k3 && cd /root/k3
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, ray, triton; print(torch.__version__, ray.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
. benchmarks/released.sh
SHAPE="--config configs/gpu2.yaml --set parallel.ep=1 $RELEASED --set model.n_layers=${LAYERS:-6} --set model.vocab_size=${VOCAB:-16384}"
stage() { local name=$1 limit=$2; shift 2; echo "== $name ($(date -u +%T), limit ${limit}s)"; \
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$? ($(date -u +%T))"; tail -n "${TAIL:-45}" "$OUT/$name.log"; }
# the CUDA-only tests of the step's kernels (needs .carry/tests; TTESTK: another -k expression)
[[ "${TTESTS:-0}" != 0 ]] && stage cuda_tests "$TTESTS" python3 -m pytest -q -p no:cacheprovider tests/test_adamw_kernel.py \
  tests/test_kernels.py tests/test_balancing.py tests/test_execution.py tests/test_logit_masks.py tests/test_prompt_graphs.py \
  tests/test_micro_batch_graphs.py -k "${TTESTK:-cuda or adamw or attn_res or fused or graph}"
# shellcheck disable=SC2086
# the kernel cache as a cache hit reads it (benchmarks/strip_kcache.py), kept after the warm-up and again at the end,
# so a later stage running past the call's limit does not lose it
keep_kcache() { tar -C /root/kcache -cJf /tmp/kcache_full.tar.xz . && python3 benchmarks/strip_kcache.py \
  /tmp/kcache_full.tar.xz "$OUT/kcache.tar.xz" | tail -n 1; }
[[ "${TWARM:-150}" != 0 ]] && stage warmup "${TWARM:-150}" python3 -m k3ray.control.cli warmup $SHAPE && keep_kcache
# every aten op one training step dispatches eagerly (outside the compiled blocks), by op and by k3ray caller
# shellcheck disable=SC2086
[[ "${THOST:-0}" != 0 ]] && TAIL=100 stage host_ops "$THOST" python3 benchmarks/host_syncs.py --device cuda $SHAPE --top 40
# shellcheck disable=SC2086
[[ "${T31:-220}" != 0 ]] && stage profile31 "${T31:-220}" python3 benchmarks/train_speed_gpu.py $SHAPE --variants "${VARIANTS:-eager:1x4,compile:1x4}" \
  --profile "${PROFILE:-eager:1x4,compile:1x4}" ${SOURCES:+--sources} --steps 5 --warmup 3 --out "$OUT/p31"
# shellcheck disable=SC2086
[[ "${TMLA:-130}" != 0 ]] && stage profile_mla "${TMLA:-130}" python3 benchmarks/train_speed_gpu.py $SHAPE \
  --set 'model.attention_pattern=[mla]' --variants "${VARIANTS_MLA:-eager:1x4}" --profile "${PROFILE_MLA:-eager:1x4}" --steps 5 --warmup 3 --out "$OUT/pmla"
# loss curves (TCURVE=SECONDS each): benchmarks/e2e_gpu.py's one-process program, CURVE_STEPS steps (default 100)
# from the same seed for each "label:arguments" of CURVES (';'-separated; e.g. "B:;C:--set
# optimizer.moments_dtype=bfloat16"), then benchmarks/loss_curves.py over them, the first the reference
if [[ "${TCURVE:-0}" != 0 ]]; then
  IFS=';' read -ra curves <<< "${CURVES:-B:}"
  jsons=() labels=()
  for c in "${curves[@]}"; do
    # shellcheck disable=SC2086
    stage "curve_${c%%:*}" "$TCURVE" python3 benchmarks/e2e_gpu.py $SHAPE ${c#*:} --parts plain \
      --steps "${CURVE_STEPS:-100}" --warmup 3 --verbose --out "$OUT/curve_${c%%:*}"
    jsons+=("$OUT/curve_${c%%:*}/plain.json") labels+=("${c%%:*}")
  done
  (IFS=,; python3 benchmarks/loss_curves.py "${jsons[@]}" --labels "${labels[*]}" | tee "$OUT/curves.md")
fi
# the user's command itself (TJOB=SECONDS): `k3ray train` at its defaults (the pre-flight check's shape, compiled
# blocks, graphs; Ray, snapshots), JOBSTEPS steps logged one a line; no final checkpoint (tens of GB to disk after
# the steps, outside what is measured). The median of steps 5 on: driver wall time, as the job's tokens/s has it.
# shellcheck disable=SC2086
if [[ "${TJOB:-0}" != 0 ]]; then
  stage job "$TJOB" python3 -m k3ray.control.cli train $SHAPE --steps "${JOBSTEPS:-30}" --no-progress \
    --set train.log_every=1 --set checkpoint.at_end=false
  grep -o "step=[0-9]* .*tokens_per_s=[0-9.]*" "$OUT/job.log" | awk -F'tokens_per_s=' '{split($1, a, "[= ]"); if (a[2] >= 5) print $2}' \
    | sort -n | awk '{v[NR] = $1} END {if (NR) printf "job: median of %d steps from step 5: %.0f tokens/s\n", NR, v[int((NR + 1) / 2)]}' | tee -a "$OUT/job.log"
fi
keep_kcache
exit 0
