"""Per-tile speed of the expert-FFN kernels without grouping losses, against cuBLAS on the same GEMM.

    python benchmarks/tile_ceiling.py [--json out.json]

One group holding every row (4096 and 32768 rows, multiples of every tile height), so no row tile is padded and the
tile counts fill the waves about as well as cuBLAS's own. Each Triton kernel is timed alone (CUDA-graph replay) in
the committed config and in alternatives, and so is the cuBLAS GEMM of the same shape (torch.mm; the gate+up kernel
against the [N, D] x [D, 2I] GEMM without activation). `x@W1 plain` is the same GEMM through the plain grouped GEMM
kernel (no fused activation, no h store). Then the whole forward with one group against the dense path
(`expert_ffn.dense_path`); the same with 14 and 112 groups of 256 rows each (grouped, but no row padded: what
streaming every expert's weights costs); and the padding factor rows / padded rows of the benchmark's grouped
shapes, which bounds them: fwd / dense there is at most about padding factor x (fwd / dense, grouped, no padding).
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

import expert_ffn as ef
from k3ray.kernels import grouped_ffn

ALTERNATIVES = {  # (BM, BN, BK, GROUP_M, num_warps, num_stages)
    "up_tma": [(128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (64, 128, 64, 8, 4, 4)],
    "down_tma": [(128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (128, 128, 64, 8, 4, 4)],
    "dh_tma": [(128, 128, 64, 8, 8, 4), (128, 128, 64, 8, 8, 3)],
    "dx_tma": [(128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4)],
}
KERNEL = {"up_tma": "up", "down_tma": "down", "dh_tma": "dh", "dx_tma": "dx"}


def padding_factor(n_rows: int, n_groups: int, skew: str, bm: int = 64) -> float:
    sizes = ef.group_sizes(n_rows, n_groups, skew)
    return n_rows / float(((sizes + bm - 1) // bm).sum() * bm)


def fwd_and_dense(ends, sets, n_rows: int) -> tuple[float, float]:
    """Whole-forward TFLOP/s (eager, do_bench): ours, and the dense path on the same rows."""
    flops = 3 * 2 * n_rows * ef.D * ef.INNER
    fwd = ef.bench([lambda s=s: ef.ours_fwd(ends)(*s) for s in sets])
    with torch.no_grad():
        dense = ef.bench([lambda s=s: ef.dense_path(*s) for s in sets])
    return flops / fwd / 1e9, flops / dense / 1e9


def one_group(n_rows: int) -> dict:
    ends, sets = ef.make_sets(n_rows, 1, torch.tensor([n_rows]))
    x, w1, w2 = sets[0]
    dy = torch.randn(n_rows, ef.D, device=ef.DEV, dtype=ef.BF)
    unit = 2 * n_rows * ef.D * ef.INNER  # FLOPs of one [N, D] x [D, I] GEMM
    calls = ef.kernel_calls(ends, x, w1, w2, dy)
    sched = grouped_ffn._Schedule(ends, None, n_rows)
    for bm in {c[0] for cs in ALTERNATIVES.values() for c in cs}:
        sched.tiles(bm)
    with torch.no_grad():
        _, act, h = grouped_ffn._ffn_forward(x, w1, w2, sched, None, True, 4.0, 25.0)
    torch.cuda.synchronize()
    calls["x@W1 plain"] = (lambda: grouped_ffn._grouped_mm(x, w1, sched, None, "down", False), 2)
    cublas = {
        "up": (lambda: torch.mm(x, w1[0]), 2),
        "x@W1 plain": (lambda: torch.mm(x, w1[0]), 2),
        "down": (lambda: torch.mm(act, w2[0]), 1),
        "dh": (lambda: torch.mm(dy, w2[0].T), 1),
        "dx": (lambda: torch.mm(h, w1[0].T), 2),
    }
    tf = lambda call, mult: mult * unit / ef.graph_ms(call) / 1e9  # noqa: E731
    rows = []
    with torch.no_grad():
        for cfg_name in ("up_tma", "x@W1 plain", "down_tma", "dh_tma", "dx_tma"):
            kernel = KERNEL.get(cfg_name, cfg_name)
            cfg_key = "down_tma" if cfg_name == "x@W1 plain" else cfg_name
            ref = tf(*cublas[kernel])
            committed = grouped_ffn.CONFIGS[cfg_key]
            for cfg in [committed] + [c for c in ALTERNATIVES[cfg_key] if c != committed]:
                grouped_ffn.CONFIGS[cfg_key] = cfg
                try:
                    ours = tf(*calls[kernel])
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for this config
                    print(f"{kernel} {cfg}: {type(e).__name__}: {e}")
                    continue
                finally:
                    grouped_ffn.CONFIGS[cfg_key] = committed
                rows.append({"rows": n_rows, "kernel": kernel, "config": cfg, "committed": cfg == committed,
                             "ours": ours, "cublas": ref, "ratio": ours / ref})
    fwd, dense = fwd_and_dense(ends, sets, n_rows)
    return {"rows": n_rows, "kernels": rows, "fwd": fwd, "dense": dense}


def unpadded_groups(n_groups: int, rows_per_group: int = 256) -> dict:
    """Forward TFLOP/s with n_groups groups of rows_per_group rows (a multiple of every tile height), and the dense
    path on the same rows."""
    n_rows = n_groups * rows_per_group
    ends, sets = ef.make_sets(n_rows, n_groups, torch.full((n_groups,), rows_per_group))
    fwd, dense = fwd_and_dense(ends, sets, n_rows)
    return {"groups": n_groups, "rows": n_rows, "fwd": fwd, "dense": dense}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    results = [one_group(n) for n in (4096, 32768)]
    grouped = [unpadded_groups(g) for g in (14, 112)]
    print("\none group, each kernel alone (graph replay), TFLOP/s")
    print("| rows | kernel | config (BM, BN, BK, GROUP_M, warps, stages) | ours | cuBLAS same GEMM | ours / cuBLAS |")
    print("|---|---|---|---|---|---|")
    for r in results:
        for k in r["kernels"]:
            mark = " (committed)" if k["committed"] else ""
            print(f"| {k['rows']} | {k['kernel']} | {k['config']}{mark} | {k['ours']:.0f} | {k['cublas']:.0f} | "
                  f"{k['ratio']:.2f} |")
    print("\nwhole forward, one group (eager, do_bench), TFLOP/s")
    print("| rows | ours fwd | dense path | fwd / dense |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']} | {r['fwd']:.0f} | {r['dense']:.0f} | {r['fwd'] / r['dense']:.2f} |")
    print("\nwhole forward, groups of 256 rows (no padding), TFLOP/s")
    print("| groups | rows | ours fwd | dense path | fwd / dense |")
    print("|---|---|---|---|---|")
    for r in grouped:
        print(f"| {r['groups']} | {r['rows']} | {r['fwd']:.0f} | {r['dense']:.0f} | {r['fwd'] / r['dense']:.2f} |")
    print("\npadding factor of the benchmark's grouped shapes (64-row tiles): rows / padded rows")
    torch.manual_seed(0)
    pads = {f"{g} {skew}": padding_factor(n, g, skew) for g, n in [(14, 4096), (112, 32768)]
            for skew in ("balanced", "zipf1.2")}
    print(" | ".join(f"{k}: {v:.3f}" for k, v in pads.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"one_group": results, "unpadded_groups": grouped, "padding": pads}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
