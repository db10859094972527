"""The host's time per matmul when the token count repeats against a new one every call: what cuBLAS's per-shape
heuristic search costs an eager iteration whose token count changes (serving's prompt iterations, which the worker
pads to a multiple of `k3ray.parallel.serving.PREFILL_TOKEN_BUCKET` tokens for this).

    python benchmarks/matmul_shapes_gpu.py [--shapes 1024x1024,1024x3584,...] [--calls 40]

Each call runs the (M, K) x (K, N) bf16 matmuls of the listed shapes once, without a sync, timed on the host
(median over the calls, per matmul): M fixed; M new each call (drawn from 300-8,000, seeded); M drawn and rounded up to
a multiple of the bucket (after one warm call per rounded M).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def host_us_per_matmul(a: torch.Tensor, weights: list[torch.Tensor], ms: list[int]) -> float:
    """Median host microseconds per matmul over calls with the token counts `ms` (one call each)."""
    out = []
    for m in ms:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for w in weights:
            torch.mm(a[:m, :w.shape[0]], w)
        out.append((time.perf_counter() - t) / len(weights) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1024x1024,1024x3584,3584x1024,1024x576,512x1024,1024x4096",
                    help="K x N of each weight, comma-separated")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--bucket", type=int, default=64)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    weights = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for k, n in shapes]
    a = torch.randn(8192, max(k for k, _ in shapes), device="cuda", dtype=torch.bfloat16)
    rng = random.Random(0)
    drawn = [rng.randrange(300, 8000) for _ in range(args.calls)]
    rounded = [-(-m // args.bucket) * args.bucket for m in drawn]
    host_us_per_matmul(a, weights, [333] + sorted(set(rounded)))  # warm: the fixed shape and the rounded ones
    rows = [("M = 333 every call", host_us_per_matmul(a, weights, [333] * args.calls)),
            ("M new every call (300-8,000)", host_us_per_matmul(a, weights, drawn)),
            (f"M rounded up to a multiple of {args.bucket}", host_us_per_matmul(a, weights, rounded))]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {len(shapes)} shapes, {args.calls} calls")
    print("| token count | host us per matmul |\n|---|---|")
    for name, us in rows:
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
