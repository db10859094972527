"""MLA's causal attention on one GPU, by SDPA backend: q, k 192 wide (the 128-wide head + the 64-wide decoupled
slice), v 128. cuDNN with v zero-padded to 192 (what the flash kernels need), cuDNN with v as it is (k3ray's on
Hopper: model.layers.causal_attention), flash with v padded, memory-efficient with v as it is. Forward + backward
ms per call (CUDA events, median of 20 after 5) and each one's largest relative error against the first.

    python3 benchmarks/mla_sdpa_gpu.py [--batch 2 --heads 32 --seq 4096]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    B, H, S, E, h = args.batch, args.heads, args.seq, 192, 128
    torch.manual_seed(0)
    q, k = (torch.randn(B, H, S, E, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(B, H, S, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, H, S, h, device="cuda", dtype=torch.bfloat16)

    def run(backend, pad):
        for t in (q, k, v):
            t.grad = None
        with sdpa_kernel([backend]):
            vv = F.pad(v, (0, E - h)) if pad else v
            o = F.scaled_dot_product_attention(q, k, vv, is_causal=True, scale=E ** -0.5)[..., :h]
            o.backward(do)
        return [o.detach().float()] + [t.grad.float() for t in (q, k, v)]

    print(f"B={B} H={H} S={S}, q/k {E}, v {h}, bf16, causal\n")
    print("| backend | v | fwd+bwd ms | rel. error |\n|---|---|---|---|")
    ref = None
    for name, backend, pad in [("cuDNN", SDPBackend.CUDNN_ATTENTION, True),
                               ("cuDNN", SDPBackend.CUDNN_ATTENTION, False),
                               ("flash", SDPBackend.FLASH_ATTENTION, True),
                               ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION, False)]:
        how = "padded to 192" if pad else "128"
        try:
            got = run(backend, pad)
        except RuntimeError as err:
            print(f"| {name} | {how} | fails: {str(err).splitlines()[0][:100]} | |")
            continue
        ref = ref or got
        err = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, ref))
        times = []
        for _ in range(25):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(backend, pad)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        times = sorted(times[5:])
        print(f"| {name} | {how} | {times[len(times) // 2]:.3f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
