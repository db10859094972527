"""Routed-expert kernels on one GPU: grouped expert FFN TFLOP/s, permute/unpermute GB/s, histogram time.

    python benchmarks/expert_ffn.py [--tune [KERNEL ...]] [--json out.json]

Shapes: K = D = 3584 in/out, I = 2048 inner; 14 local experts (~4k rows) and 112 (~32k rows); balanced and Zipf 1.2
rows per expert. FLOPs = 2*rows*K*2I + 2*rows*I*K forward, twice that backward. Timings: triton.testing.do_bench
medians, inputs rotated among several random sets. Ceilings measured in the same run: an 8192^3 bf16 matmul and a
device-to-device copy (bytes read + written).

Columns: ours = k3ray grouped_expert_ffn_triton (fused SiTU-GLU); grouped_mm = torch._grouped_mm, activation as
separate torch ops (silu(g)*u as in K3_NOTES, and SiTU-GLU); loop = one matmul per expert (silu(g)*u); dense = all
rows through one dense weight pair (silu(g)*u), the ceiling the grouped kernels are held to. ours_fwd reads the
forward operands through TMA descriptors; ours_fwd_ptr is the same forward with plain pointer loads.
--tune sweeps the block configs of each Triton kernel (timed alone) on TUNE_SHAPES first and keeps the fastest.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from k3ray.kernels import grouped_ffn
from k3ray.kernels.grouped_ffn import grouped_expert_ffn_triton
from k3ray.kernels.histogram import score_histogram_reference, score_histogram_triton
from k3ray.kernels.permute import (
    permute_rows_reference,
    permute_rows_triton,
    unpermute_rows_reference,
    unpermute_rows_triton,
)
from k3ray.kernels.situ_glu import situ_glu_reference

D, INNER = 3584, 2048
SETS = 3  # rotated input sets
DEV = "cuda"
BF = torch.bfloat16


def bench(fns) -> float:
    """Median ms of one call, cycling through `fns` (one per input set)."""
    it = itertools.cycle(fns)
    return do_bench(lambda: next(it)(), warmup=50, rep=300, return_mode="median")


def group_sizes(n_rows: int, n_groups: int, skew: str) -> torch.Tensor:
    if skew == "balanced":
        sizes = torch.full((n_groups,), n_rows // n_groups)
        sizes[: n_rows - int(sizes.sum())] += 1
    else:  # Zipf 1.2 over a random expert permutation
        p = 1.0 / torch.arange(1, n_groups + 1, dtype=torch.float64) ** 1.2
        sizes = torch.floor(p / p.sum() * n_rows).long()
        sizes[0] += n_rows - int(sizes.sum())
        sizes = sizes[torch.randperm(n_groups)]
    return sizes


def make_sets(n_rows, n_groups, sizes):
    ends = torch.cumsum(sizes, 0).to(torch.int32).to(DEV)
    sets = []
    for _ in range(SETS):
        x = torch.randn(n_rows, D, device=DEV, dtype=BF)
        w1 = (torch.randn(n_groups, D, 2 * INNER, device=DEV, dtype=BF) / D**0.5)
        w2 = (torch.randn(n_groups, INNER, D, device=DEV, dtype=BF) / INNER**0.5)
        sets.append((x, w1, w2))
    return ends, sets


def ours_fwd(ends):
    def fn(x, w1, w2):
        with torch.no_grad():
            return grouped_expert_ffn_triton(x, w1, w2, ends)
    return fn


def ours_fwd_bwd(ends, dy):
    def fn(x, w1, w2):
        xs, w1s, w2s = (t.detach().requires_grad_() for t in (x, w1, w2))
        y = grouped_expert_ffn_triton(xs, w1s, w2s, ends)
        return torch.autograd.grad(y, (xs, w1s, w2s), dy)
    return fn


def ours_fwd_saving(ends):
    def fn(x, w1, w2):  # the forward as training runs it (saves the pre-activations)
        return grouped_expert_ffn_triton(x.detach().requires_grad_(), w1, w2, ends)
    return fn


def grouped_mm_path(ends, act):
    def fn(x, w1, w2):
        with torch.no_grad():
            h = torch._grouped_mm(x, w1, offs=ends)
            return torch._grouped_mm(act(h[:, :INNER], h[:, INNER:]), w2, offs=ends)
    return fn


def grouped_mm_fwd_bwd(ends, dy):
    def fn(x, w1, w2):
        xs, w1s, w2s = (t.detach().requires_grad_() for t in (x, w1, w2))
        h = torch._grouped_mm(xs, w1s, offs=ends)
        y = torch._grouped_mm(F.silu(h[:, :INNER]) * h[:, INNER:], w2s, offs=ends)
        return torch.autograd.grad(y, (xs, w1s, w2s), dy)
    return fn


def loop_path(bounds):
    def fn(x, w1, w2):
        outs = []
        for g, (lo, hi) in enumerate(bounds):
            h = x[lo:hi] @ w1[g]
            outs.append((F.silu(h[:, :INNER]) * h[:, INNER:]) @ w2[g])
        return torch.cat(outs)
    return fn


def dense_path(x, w1, w2):
    h = x @ w1[0]
    return (F.silu(h[:, :INNER]) * h[:, INNER:]) @ w2[0]


def silu_mul(g, u):
    return F.silu(g) * u


def ceilings() -> dict:
    a = torch.randn(8192, 8192, device=DEV, dtype=BF)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF)
    ms = bench([lambda: a @ b])
    src = torch.randn(2**29, device=DEV, dtype=BF)  # 1 GiB
    dst = torch.empty_like(src)
    ms_copy = bench([lambda: dst.copy_(src)])
    return {"matmul_tflops": 2 * 8192**3 / ms / 1e9, "copy_gbs": 2 * src.numel() * 2 / ms_copy / 1e6}


def ffn_row(n_groups: int, n_rows: int, skew: str) -> dict:
    sizes = group_sizes(n_rows, n_groups, skew)
    ends, sets = make_sets(n_rows, n_groups, sizes)
    flops = 2 * n_rows * D * 2 * INNER + 2 * n_rows * INNER * D
    tf = lambda ms, mult=1: mult * flops / ms / 1e9  # noqa: E731
    dy = torch.randn(n_rows, D, device=DEV, dtype=BF)
    bounds = list(zip([0] + ends.tolist()[:-1], ends.tolist()))
    row = {"experts": n_groups, "rows": n_rows, "skew": skew, "max_rows": int(sizes.max())}
    row["ours_fwd"] = tf(bench([lambda s=s: ours_fwd(ends)(*s) for s in sets]))
    grouped_ffn.USE_TMA = False
    row["ours_fwd_ptr"] = tf(bench([lambda s=s: ours_fwd(ends)(*s) for s in sets]))
    grouped_ffn.USE_TMA = True
    ms_fwd_saving = bench([lambda s=s: ours_fwd_saving(ends)(*s) for s in sets])
    ms_total = bench([lambda s=s: ours_fwd_bwd(ends, dy)(*s) for s in sets])
    row["ours_fwd_bwd"] = tf(ms_total, 3)
    row["ours_bwd"] = tf(ms_total - ms_fwd_saving, 2)
    for key, make, mult in [("gmm_silu", lambda: grouped_mm_path(ends, silu_mul), 1),
                            ("gmm_situ", lambda: grouped_mm_path(ends, situ_glu_reference), 1),
                            ("gmm_fwd_bwd", lambda: grouped_mm_fwd_bwd(ends, dy), 3)]:
        try:
            row[key] = tf(bench([lambda s=s: make()(*s) for s in sets]), mult)
        except RuntimeError as e:  # torch._grouped_mm missing, or without a backward, in this torch
            print(f"{key}: {e}")
            row[key] = float("nan")
    with torch.no_grad():
        row["loop"] = tf(bench([lambda s=s: loop_path(bounds)(*s) for s in sets]))
        row["dense"] = tf(bench([lambda s=s: dense_path(*s) for s in sets]))
    return row


def host_us(fn, calls: int = 50) -> float:
    """Host time of one call while the GPU is kept busy (its launches only queue): what a call costs the CPU."""
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # ~50 ms of GPU spin, longer than the host loop
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def kernel_calls(ends, x, w1, w2, dy) -> dict:
    """Each Triton kernel of the FFN alone on one problem: name -> (call, FLOPs in units of one [N, D] x [D, I]
    GEMM). Operands (act, h, the tile tables) are made first and the device synchronised, since graph benchmarks
    run on a stream of their own."""
    ffn = grouped_ffn
    sched = ffn._Schedule(ends, None, x.shape[0])
    with torch.no_grad():
        _, act, h = ffn._ffn_forward(x, w1, w2, sched, None, True, 4.0, 25.0)
    for bm in {c[0] for c in ffn.CONFIGS.values()} | {c[0] for cs in CANDIDATES.values() for c in cs}:
        sched.tiles(bm)
    torch.cuda.synchronize()
    return {
        "up": (lambda: ffn._ffn_up(x, w1, sched, INNER, False, 4.0, 25.0), 2),
        "down": (lambda: ffn._grouped_mm(act, w2, sched, None, "down", False), 1),
        "dh": (lambda: ffn._ffn_dh(dy, w2, h, None, sched, 4.0, 25.0), 1),
        "dx": (lambda: ffn._grouped_mm(h, w1, sched, None, "dx", True), 2),
        "dw1": (lambda: ffn._wgrad(x, h, sched, w1.dtype), 2),
        "dw2": (lambda: ffn._wgrad(act, dy, sched, w2.dtype), 1),
    }


def graph_ms(fn) -> float:
    return do_bench_cudagraph(fn, rep=200, return_mode="median")


def kernel_row(n_groups: int, n_rows: int, skew: str) -> dict:
    """GPU time of each Triton kernel alone (CUDA-graph replay, so no launch gaps), as TFLOP/s, and host time of a
    forward call and of a forward+backward call: ours and the torch._grouped_mm path."""
    ends, sets = make_sets(n_rows, n_groups, group_sizes(n_rows, n_groups, skew))
    x, w1, w2 = sets[0]
    dy = torch.randn(n_rows, D, device=DEV, dtype=BF)
    unit = 2 * n_rows * D * INNER
    row = {"experts": n_groups, "skew": skew}
    with torch.no_grad():
        for name, (call, mult) in kernel_calls(ends, x, w1, w2, dy).items():
            row[name] = mult * unit / graph_ms(call) / 1e9
        row["schedule_us"] = 1e3 * graph_ms(lambda: grouped_ffn._Schedule(ends, None, n_rows).tiles(64))
    ours, gmm = ours_fwd(ends), grouped_mm_path(ends, silu_mul)
    row["host_us_ours"] = host_us(lambda: ours(x, w1, w2))
    row["host_us_gmm"] = host_us(lambda: gmm(x, w1, w2))
    ours_train, gmm_train = ours_fwd_bwd(ends, dy), grouped_mm_fwd_bwd(ends, dy)
    row["host_us_ours_train"] = host_us(lambda: ours_train(x, w1, w2), calls=10)
    row["host_us_gmm_train"] = host_us(lambda: gmm_train(x, w1, w2), calls=10)
    return row


def permute_rows_bench(n_tokens: int = 8192, k: int = 8) -> list[dict]:
    n_rows = n_tokens * k
    dest = torch.randperm(n_rows, device=DEV).reshape(n_tokens, k)
    xs = [torch.randn(n_tokens, D, device=DEV, dtype=BF) for _ in range(SETS)]
    ys = [torch.randn(n_rows, D, device=DEV, dtype=BF) for _ in range(SETS)]
    w = torch.rand(n_tokens, k, device=DEV)
    nbytes = 2 * n_rows * D * 2  # permute: rows read + written; unpermute: K rows read per token (+ 1/K written)
    nbytes_un = n_rows * D * 2 + n_tokens * D * 2
    out = []
    for name, fn, xin, nb in [
        ("permute (ours)", lambda x: permute_rows_triton(x, dest, n_rows), xs, nbytes),
        ("permute (torch reference)", lambda x: permute_rows_reference(x, dest, n_rows), xs, nbytes),
        ("unpermute (ours)", lambda y: unpermute_rows_triton(y, dest, w), ys, nbytes_un),
        ("unpermute (torch reference)", lambda y: unpermute_rows_reference(y, dest, w), ys, nbytes_un),
    ]:
        with torch.no_grad():
            ms = bench([lambda t=t: fn(t) for t in xin])
        out.append({"what": name, "ms": ms, "gbs": nb / ms / 1e6})
    vals = [torch.rand(32768, 896, device=DEV) for _ in range(SETS)]
    for name, fn in [("histogram 32768x896 (ours)", score_histogram_triton),
                     ("histogram 32768x896 (torch reference)", score_histogram_reference)]:
        ms = bench([lambda v=v: fn(v, 0.0, 1.0, 1000) for v in vals])
        out.append({"what": name, "ms": ms, "gbs": vals[0].numel() * 4 / ms / 1e6})
    return out


CANDIDATES = {  # (BM, BN, BK, GROUP_M, num_warps, num_stages)
    "up_tma": [(64, 256, 64, 8, 8, 3), (64, 256, 64, 4, 8, 3), (64, 256, 64, 16, 8, 3), (128, 128, 64, 8, 8, 3),
               (64, 128, 64, 8, 4, 4), (64, 128, 64, 8, 4, 5)],
    "down_tma": [(64, 256, 64, 8, 4, 5), (64, 256, 64, 4, 4, 5), (64, 256, 64, 16, 4, 5), (64, 256, 64, 8, 4, 4),
                 (128, 256, 64, 8, 8, 3)],
    "dh_tma": [(64, 256, 64, 8, 8, 4), (64, 256, 64, 8, 8, 5), (64, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4),
               (64, 128, 64, 8, 8, 4), (64, 128, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4), (128, 128, 64, 8, 8, 3),
               (64, 64, 64, 8, 4, 5)],
    "dx_tma": [(64, 256, 64, 8, 4, 5), (64, 256, 64, 16, 4, 5), (64, 256, 64, 8, 4, 4), (128, 256, 64, 8, 8, 3)],
    "wgrad": [(128, 256, 32, 8, 8, 4), (256, 128, 32, 8, 8, 4), (128, 256, 64, 8, 8, 3), (128, 128, 64, 8, 4, 4),
              (128, 256, 32, 8, 8, 5)],
}
TUNE_SHAPES = [(112, 32768, "balanced"), (14, 4096, "zipf1.2")]
KERNEL_OF = {"up_tma": ["up"], "down_tma": ["down"], "dh_tma": ["dh"], "dx_tma": ["dx"], "wgrad": ["dw1", "dw2"]}


def set_config(name: str, cfg: tuple) -> None:
    """The config kernel `name` runs with at these widths: CONFIGS', and the table tuned at (D, INNER) where there is
    one (grouped_ffn.CONFIGS_AT_WIDTHS, which many-row problems take first)."""
    grouped_ffn.CONFIGS[name] = cfg
    if (D, INNER) in grouped_ffn.CONFIGS_AT_WIDTHS:
        grouped_ffn.CONFIGS_AT_WIDTHS[(D, INNER)][name] = cfg


def tune(names) -> None:
    """Per kernel (those in `names`, all when empty), keep the candidate with the least summed (time / best time)
    over TUNE_SHAPES, each kernel timed alone (graph replay)."""
    problems = []
    for n_groups, n_rows, skew in TUNE_SHAPES:
        ends, sets = make_sets(n_rows, n_groups, group_sizes(n_rows, n_groups, skew))
        dy = torch.randn(n_rows, D, device=DEV, dtype=BF)
        problems.append(kernel_calls(ends, *sets[0], dy))
    for name, cands in CANDIDATES.items():
        if names and name not in names:
            continue
        times = {}
        for cfg in cands:
            set_config(name, cfg)
            try:
                with torch.no_grad():
                    times[cfg] = [sum(graph_ms(calls[k][0]) for k in KERNEL_OF[name]) for calls in problems]
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for this config
                print(f"tune {name} {cfg}: {type(e).__name__}")
                continue
            print(f"tune {name:8s} {cfg}: " + " / ".join(f"{t:.3f}" for t in times[cfg]) + f" ms ({TUNE_SHAPES})")
        best = [min(t[i] for t in times.values()) for i in range(len(problems))]
        set_config(name, min(times, key=lambda c: sum(t / b for t, b in zip(times[c], best))))
    print("tuned CONFIGS =", json.dumps(grouped_ffn.CONFIGS))


def print_kernel_rows(rows: list[dict]) -> None:
    print("\nper kernel, GPU time alone (graph replay), TFLOP/s; host time of one call (forward; forward+backward)")
    keys = ("experts", "skew", "up", "down", "dh", "dx", "dw1", "dw2", "schedule_us", "host_us_ours", "host_us_gmm",
            "host_us_ours_train", "host_us_gmm_train")
    print("| " + " | ".join(keys) + " |")
    for r in rows:
        print("| " + " | ".join(str(r[k]) if isinstance(r[k], (int, str)) else f"{r[k]:.0f}" for k in keys) + " |")


def main() -> None:
    global D, INNER, TUNE_SHAPES
    parser = argparse.ArgumentParser()
    parser.add_argument("--tune", nargs="*", default=None, metavar="KERNEL", choices=list(CANDIDATES),
                        help=f"tune block configs first: all, or those named ({', '.join(CANDIDATES)})")
    parser.add_argument("--json", default=None)
    parser.add_argument("--dims", nargs=2, type=int, default=None, metavar=("D", "INNER"),
                        help=f"the experts' widths (default {D} {INNER}: K3's); e.g. 2048 1024 for gpu2")
    parser.add_argument("--shapes", nargs="+", default=None, metavar="EXPERTS:ROWS:SKEW",
                        help="the problems to tune on and time (default: 14:4096 and 112:32768, balanced and "
                             "zipf1.2); e.g. 64:65536:balanced for gpu2 at ep=1 (8,192 tokens x top-8)")
    parser.add_argument("--kernels-only", action="store_true", help="only the per-kernel table (after any tuning)")
    args = parser.parse_args()
    if args.dims:
        D, INNER = args.dims
    shapes = [(g, n, skew) for (g, n) in [(14, 4096), (112, 32768)] for skew in ("balanced", "zipf1.2")]
    if args.shapes:
        shapes = [(int(g), int(n), skew) for g, n, skew in (x.split(":") for x in args.shapes)]
        TUNE_SHAPES = shapes
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  D={D} I={INNER}")
    if args.tune is not None:
        tune(args.tune)
    if args.kernels_only:
        print_kernel_rows([kernel_row(*shape) for shape in shapes])
        return
    result = {"ceilings": ceilings()}
    ceil = result["ceilings"]
    print(f"dense 8192^3 bf16 matmul: {ceil['matmul_tflops']:.0f} TFLOP/s; device copy: {ceil['copy_gbs']:.0f} GB/s")

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**result, "configs": grouped_ffn.CONFIGS}, f, indent=1)

    result["ffn"] = [ffn_row(*shape) for shape in shapes]
    save()
    head = ("experts", "rows", "skew", "max_rows", "ours_fwd", "ours_fwd_ptr", "ours_bwd", "ours_fwd_bwd", "gmm_silu",
            "gmm_situ", "gmm_fwd_bwd", "loop", "dense")
    print("\nTFLOP/s (medians)")
    print("| " + " | ".join(head) + " | fwd/gmm_silu | fwd/dense | bwd/fwd |")
    for r in result["ffn"]:
        cells = [str(r[h]) if isinstance(r[h], (int, str)) else f"{r[h]:.0f}" for h in head]
        ratios = [r["ours_fwd"] / r["gmm_silu"], r["ours_fwd"] / r["dense"], r["ours_bwd"] / r["ours_fwd"]]
        print("| " + " | ".join(cells) + " | " + " | ".join(f"{x:.2f}" for x in ratios) + " |")

    result["per_kernel"] = [kernel_row(*shape) for shape in shapes]
    save()
    print_kernel_rows(result["per_kernel"])

    result["movement"] = permute_rows_bench()
    save()
    print(f"\ndata movement, 8192 tokens x top-8 x {D} bf16 (copy ceiling {ceil['copy_gbs']:.0f} GB/s)")
    for m in result["movement"]:
        print(f"| {m['what']} | {m['ms'] * 1e3:.1f} us | {m['gbs']:.0f} GB/s | {m['gbs'] / ceil['copy_gbs']:.2f} |")


if __name__ == "__main__":
    main()
