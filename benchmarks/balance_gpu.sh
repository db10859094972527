#!/usr/bin/env bash
# Router balance of gpu2 (8 layers, the released K3's features, ep=1) in real training on one H200: stages each under
# its own timeout, logs and JSON in $OUT. STAGES picks them (default: bpe_data bpe byte; about 8 minutes with a cold
# Triton cache: ~1 for the data, ~5.5 for BPE with fla's autotuning, ~1.5 for bytes):
#   bpe_data  a byte-level BPE tokenizer.json (benchmarks/train_bpe.py, BPE_VOCAB tokens) trained on the device's
#             Python standard library sources, then `k3ray data prepare` of the same files into $WORK/bpe_data
#   bpe       STEPS steps on the BPE shards with the released defaults (configs/gpu2.yaml: micro-batch biases);
#             the first stage to train pays fla's autotuning (~200 s cold, TRITON_CACHE_DIR keeps it)
#   byte      BYTE_STEPS steps on byte data (the embedded corpus of .py sources)
#   before    BEFORE_STEPS steps on the BPE shards with the former rule (the previous step's quantile, step 0.3)
#   off       STEPS steps on the BPE shards with balancing off (model.balancing=none: no bias, plain top-k), the loss
#             curve the balanced runs are held to (same seed, data and steps as bpe)
# Each training stage prints the per-step table (loss, MaxVio mean and max over layers, what the step's bias and each
# micro-batch's own bias give, saturated scores), held-out MaxVio at steps 0, 50 and the end, and a summary line.
# Run from a copy of the repository (outside the checkout) with Ray's site and the Triton cache already on
# PYTHONPATH / TRITON_CACHE_DIR, as benchmarks/train_speed_gpu.sh.
set -u
OUT=${OUT:-runs/balance}
WORK=${WORK:-$OUT/work}
STAGES=${STAGES:-bpe_data bpe byte}
STEPS=${STEPS:-100}
BYTE_STEPS=${BYTE_STEPS:-60}
BEFORE_STEPS=${BEFORE_STEPS:-60}
BPE_VOCAB=${BPE_VOCAB:-16384}
TEXT_MB=${TEXT_MB:-24}
mkdir -p "$OUT" "$WORK"
export WORK TEXT_MB BPE_VOCAB
GPU2="--config configs/gpu2.yaml --set parallel.ep=1"
. "$(dirname "${BASH_SOURCE[0]}")/released.sh"   # RELEASED: the released K3's features as --set arguments
BPE="--set data.source=$WORK/bpe_data --set data.tokenizer=$WORK/bpe/tokenizer.json --set model.vocab_size=$BPE_VOCAB"
stage() { local name=$1 limit=$2; shift 2; echo "== $name ($(date -u +%T), limit ${limit}s)"; \
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "== $name rc=$? ($(date -u +%T))"; \
  grep -v "^| [0-9]" "$OUT/$name.log" | tail -n 12; }
bpe_data() {
  local lib; lib=$(python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
  rm -rf "$WORK/text" && mkdir -p "$WORK/text"
  # one document per source file, flat names (prepare skips hidden names), up to TEXT_MB of text
  find "$lib" -name "*.py" -not -path "*/test*" -not -path "*/site-packages/*" | sort | python -c "
import shutil, sys
total, cap = 0, int(float('$TEXT_MB') * 2**20)
for path in sys.stdin.read().split():
    name = path.removeprefix('$lib/').replace('/', '_')
    shutil.copyfile(path, '$WORK/text/' + name)
    total += len(open(path, 'rb').read())
    if total >= cap:
        break
print(f'{total / 2**20:.1f} MiB of text')"
  python benchmarks/train_bpe.py --input "$WORK/text" --vocab "$BPE_VOCAB" --out "$WORK/bpe" && \
  python -m k3ray data prepare --input "$WORK/text" --tokenizer "$WORK/bpe/tokenizer.json" \
    --output "$WORK/bpe_data" --workers 8 --shard-mb 4 --json
}
for s in $STAGES; do
  case $s in
    bpe_data) export -f bpe_data; stage bpe_data "${BPE_DATA_S:-150}" bash -c bpe_data ;;
    bpe) stage bpe "${BPE_S:-420}" python benchmarks/balance_gpu.py $GPU2 $RELEASED $BPE --steps "$STEPS" \
      --label "gpu2 8 layers, BPE $BPE_VOCAB" --json "$OUT/bpe.json" ;;
    byte) stage byte "${BYTE_S:-200}" python benchmarks/balance_gpu.py $GPU2 $RELEASED --steps "$BYTE_STEPS" \
      --label "gpu2 8 layers, bytes" --json "$OUT/byte.json" ;;
    before) stage before "${BEFORE_S:-200}" python benchmarks/balance_gpu.py $GPU2 $RELEASED $BPE \
      --set model.quantile_bias_from=previous_step --set model.quantile_step=0.3 --steps "$BEFORE_STEPS" \
      --label "gpu2 8 layers, BPE $BPE_VOCAB, the former rule" --json "$OUT/before.json" ;;
    off) stage off "${OFF_S:-420}" python benchmarks/balance_gpu.py $GPU2 $RELEASED $BPE --set model.balancing=none \
      --steps "$STEPS" --label "gpu2 8 layers, BPE $BPE_VOCAB, balancing off" --json "$OUT/off.json" ;;
  esac
done
