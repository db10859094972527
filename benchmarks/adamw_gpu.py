"""The training step's AdamW against its HBM bound on one GPU: the fused Triton kernel (k3ray/kernels/adamw.py) at
several tiles, and torch's fused AdamW as k3ray ran it before (gradients widened to fp32 first, then the bf16
parameters rounded from their masters), over the parameters of a config's stage (their real shapes: a stage built
on the meta device, then given memory), bf16 with fp32 masters.

    python benchmarks/adamw_gpu.py --config configs/gpu2.yaml $RELEASED --set model.n_layers=6 --set parallel.ep=1

Prints per variant the median of `--reps` steps (after one), the bytes the step must move (28 per parameter: bf16
gradient read, fp32 master, m, v read and written, bf16 parameter written) over the time, and the ratio to the
bound at --hbm-tbs (H100 SXM 3.35 TB/s, H200 4.8).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3ray.config import load_config, parse_assignments  # noqa: E402
from k3ray.kernels import adamw as fused  # noqa: E402
from k3ray.model.decoder import build_stage  # noqa: E402
from attention_gpu import time_fwd_bwd  # noqa: E402 (CUDA-event medians)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/gpu2.yaml")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--tiles", default="1024x4,2048x4,2048x8,4096x8,8192x8", help="BLOCKxWARPS,...")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hbm-tbs", type=float, default=3.35)
    args = ap.parse_args(argv)
    cfg = load_config(args.config, parse_assignments(args.set))
    stage = build_stage(cfg.model, range(cfg.model.n_layers), init=False)
    shapes = [p.shape for p in stage.parameters()]
    n = sum(s.numel() for s in shapes)
    dev = torch.device("cuda")
    params = [torch.randn(s, device=dev).to(torch.bfloat16) for s in shapes]
    masters = [p.float() for p in params]
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    ms, vs = [torch.zeros_like(m) for m in masters], [torch.zeros_like(m) for m in masters]
    divisor = torch.ones((), device=dev)
    bound = 28 * n / (args.hbm_tbs * 1e12)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}: {len(shapes)} tensors, {n / 1e9:.2f} B "
          f"parameters, 28 bytes each = {28 * n / 1e9:.1f} GB; bound {bound * 1e3:.1f} ms at {args.hbm_tbs} TB/s\n")
    print("| variant | median ms | TB/s (28 B per parameter) | x bound |\n|---|---|---|---|")

    def kernel_step():
        for p, master, g, m, v in zip(params, masters, grads, ms, vs):
            fused.adamw_step_(p, master, g, m, v, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                              step=1, grad_divisor=divisor)

    for tile in args.tiles.split(","):
        fused._BLOCK, fused._WARPS = (int(x) for x in tile.split("x"))
        t = time_fwd_bwd(kernel_step, 1, args.reps)
        print(f"| Triton, BLOCK {fused._BLOCK}, {fused._WARPS} warps | {t * 1e3:.1f} | {28 * n / t / 1e12:.2f} | "
              f"{t / bound:.2f} |")

    from torch.optim.adam import adam

    steps = [torch.zeros((), device=dev) for _ in params]

    def torch_step():  # k3ray's step before the kernel: widened gradients, torch's fused AdamW, the rounding
        wide = [g.float() for g in grads]
        adam(masters, wide, ms, vs, [], steps, fused=True, grad_scale=divisor, decoupled_weight_decay=True,
             amsgrad=False, beta1=0.9, beta2=0.95, lr=1e-4, weight_decay=0.1, eps=1e-8, maximize=False)
        torch._foreach_copy_(params, masters)

    t = time_fwd_bwd(torch_step, 1, args.reps)
    print(f"| torch fused AdamW, widened gradients, then the rounding | {t * 1e3:.1f} | {28 * n / t / 1e12:.2f} | "
          f"{t / bound:.2f} |")


if __name__ == "__main__":
    main()
