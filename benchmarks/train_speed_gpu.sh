#!/usr/bin/env bash
# The training-speed measurements of one device call, as stages each under its own timeout, logs in $OUT.
# STAGES picks them (default: all, in this order):
#   tests     tests/test_kda.py's fla short-convolution and gate test and tests/test_execution.py on the GPU
#   variants  benchmarks/train_speed_gpu.py: eager / compiled / recompute, micro-batch shapes (VARIANTS, PROFILE)
#   released  gpu2 with the released K3's features, RELEASED_STEPS steps, loss and MaxVio per step (plain program)
#   peer      torchtitan 0.3.0's Qwen3-MoE sized as gpu2 (benchmarks/torchtitan_peer.py; TT_SITE holds it)
#   e2e       benchmarks/e2e_gpu.py --parts plain,k3ray at ep=1 with E2E_SET (plain against k3ray on Ray)
# Run from the repository root with Ray's site and the Triton cache already on PYTHONPATH / TRITON_CACHE_DIR.
set -u
OUT=${OUT:-runs/train_speed}
STAGES=${STAGES:-tests variants released peer e2e}
VARIANTS=${VARIANTS:-eager:1x4,eager:2x2,eager:4x1,recompute:4x1,compile:4x1}
PROFILE=${PROFILE:-eager:1x4,compile:4x1}
RELEASED_STEPS=${RELEASED_STEPS:-100}
RELEASED_SET=${RELEASED_SET:-}
E2E_SET=${E2E_SET:-}
VARIANTS_SET=${VARIANTS_SET:-}
TESTS=${TESTS:-tests/test_kda.py::test_fla_short_conv_and_gate_equal_reference tests/test_execution.py}
GPU2="--config configs/gpu2.yaml --set parallel.ep=1"
. "$(dirname "${BASH_SOURCE[0]}")/released.sh"   # RELEASED: the released K3's features as --set arguments
stage() { local name=$1 limit=$2; shift 2; echo "== $name ($(date -u +%T), limit ${limit}s)"; \
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$? ($(date -u +%T))"; tail -n 40 "$OUT/$name.log"; }
for s in $STAGES; do
  case $s in
    tests) stage tests "${TESTS_S:-120}" python -m pytest -q -p no:cacheprovider -rs --tb=short $TESTS ;;
    variants) stage variants "${VARIANTS_S:-240}" python benchmarks/train_speed_gpu.py $GPU2 $VARIANTS_SET --variants "$VARIANTS" \
      --profile "$PROFILE" --out "$OUT" ;;
    released) stage released "${RELEASED_S:-180}" python benchmarks/e2e_gpu.py $GPU2 $RELEASED $RELEASED_SET \
      --parts plain --steps "$RELEASED_STEPS" --warmup 3 --verbose --out "$OUT/released" ;;
    peer) stage peer "${PEER_S:-200}" env PYTHONPATH="${TT_SITE:-/tmp/tt}:$PYTHONPATH" \
      python benchmarks/torchtitan_peer.py --steps 8 --warmup 3 --out "$OUT" ;;
    e2e) stage e2e "${E2E_S:-240}" python benchmarks/e2e_gpu.py $GPU2 $E2E_SET --parts plain,k3ray --steps 8 \
      --warmup 3 --out "$OUT/e2e" ;;
  esac
done
