#!/usr/bin/env bash
# Pack torchtitan 0.3.0 and the pure-Python packages it imports beyond the GPU image for the offline GPU machine:
# one xz tarball of an unpacked site folder in the git-ignored .carry/ (benchmarks/torchtitan_peer.py uses it).
#
# Run HERE (network + pip):  bash benchmarks/carry_torchtitan.sh     -> .carry/torchtitan/tt.tar.xz (~2.4 MB)
# On the GPU machine:         mkdir -p /tmp/tt && tar -xJf .carry/torchtitan/tt.tar.xz -C /tmp/tt
#                             STAGES=peer TT_SITE=/tmp/tt bash benchmarks/train_speed_gpu.sh
#
# Only what importing torchtitan's Qwen3-MoE model, config and parallelize function needs (its Trainer's datasets,
# wandb and tensorboard imports are not on that path). Env overrides: CARRY_DIR (default .carry/torchtitan).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARRY_DIR="${CARRY_DIR:-$REPO/.carry/torchtitan}"
SITE="$(mktemp -d)"
python3 -m pip install -q --no-deps --target "$SITE" torchtitan==0.3.0 tyro docstring-parser typeguard shtab \
    spmd_types==0.2.3 torchdata torch_checkpointing
mkdir -p "$CARRY_DIR"
(cd "$SITE" && find . -name __pycache__ -prune -o -type f -print | tar -cJf "$CARRY_DIR/tt.tar.xz" -T -)
rm -rf "$SITE"
ls -la "$CARRY_DIR/tt.tar.xz"
