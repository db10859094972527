"""Host overhead check for the 14-expert (~4k rows) expert-FFN shapes: the same forward timed three times with
do_bench (host launches included) and once with CUDA-graph replay (launch gaps removed), ours vs torch._grouped_mm.

    python benchmarks/kernels_small_shapes.py
"""
from __future__ import annotations

import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

import expert_ffn as ef

torch.manual_seed(0)
for skew in ("balanced", "zipf1.2"):
    n_groups, n_rows = 14, 4096
    ends, sets = ef.make_sets(n_rows, n_groups, ef.group_sizes(n_rows, n_groups, skew))
    x, w1, w2 = sets[0]
    flops = 2 * n_rows * ef.D * 2 * ef.INNER + 2 * n_rows * ef.INNER * ef.D
    for name, fn in [("ours", ef.ours_fwd(ends)), ("gmm_silu", ef.grouped_mm_path(ends, ef.silu_mul))]:
        eager = [do_bench(lambda: fn(x, w1, w2), warmup=50, rep=300, return_mode="median") for _ in range(3)]
        try:
            graph = do_bench_cudagraph(lambda: fn(x, w1, w2), rep=300, return_mode="median")
        except RuntimeError as e:
            print(f"{name}: no graph capture ({e})")
            graph = float("nan")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            fn(x, w1, w2)
        host_us = (time.perf_counter() - t0) * 1e5  # per call, launches queued (GPU may lag)
        torch.cuda.synchronize()
        print(f"14 experts {skew:8s} {name:8s} eager TFLOP/s " + " ".join(f"{flops / m / 1e9:.0f}" for m in eager)
              + f" | graph {flops / graph / 1e9:.0f} | host {host_us:.0f} us/call")
