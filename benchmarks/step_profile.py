"""Where one training step's device time goes: torch profiler kernels grouped by category.

`profile_step(fn)` runs fn() once under the profiler and returns {category: {"ms", "launches"}}, the step's wall time
and the device's idle time (wall minus the kernels' summed time: kernels of one stream never overlap, so the rest is
time the GPU waited for the host). Categories are matched on the kernel name, first match wins (CATEGORIES).
"""
from __future__ import annotations

import re
import time

import torch

CATEGORIES = [  # (category, kernel-name pattern), in matching order
    ("k3ray expert GEMMs (Triton)", r"ffn_up_kernel|grouped_mm_kernel|ffn_dh_kernel|grouped_wgrad_kernel|schedule_k"),
    ("k3ray permute/combine/SiTU/histogram (Triton)", r"_gather_rows_kernel|_combine_kernel|_situ_|_histogram_k"),
    ("attention (SDPA: cuDNN, flash)", r"flash|fmha|cudnn|attention|sdpa|attn"),  # before KDA: "flash" holds "fla"
    ("KDA (fla Triton)", r"kda|chunk_|fused_recurrent|causal_conv|solve_tril|wy_|l2norm|kkt|gate_"),
    ("dense GEMMs (cuBLAS)", r"gemm|nvjet|cutlass|xmma|sm90|sm80|cublas|wgmma|splitK|Kernel2"),
    ("optimizer (fused AdamW, norms)", r"adam|multi_tensor|foreach"),
    ("Inductor fused (compiled blocks)", r"^triton_"),
    ("communication (NCCL)", r"nccl"),
    ("copies and fills", r"[Mm]emcpy|[Mm]emset|copy_|CatArray|fill"),
    ("elementwise and reductions (eager)", r"elementwise|reduce|vectorized|unrolled|index|scatter|gather|softmax|"
                                           r"norm|sort|topk|radix|cumsum|scan|bitonic|where|compare"),
]


# the CUDA runtime's waits: a CUDA tensor's `.item()` is one of these; `aten::_local_scalar_dense` is not counted, as it
# also reads CPU tensors (the step report's host arithmetic) without waiting for the device
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def categorize(name: str) -> str:
    for category, pattern in CATEGORIES:
        if re.search(pattern, name):
            return category
    return "other"


def idle_gaps(kernels: list[tuple[str, float, float]], top: int = 8) -> dict:
    """The device's idle time between a profiled stretch's first and last kernel, from its kernels (name, start us,
    end us; overlapping ones merged): the gaps' sum and count, and the `top` largest with the kernels either side
    (what the device waited after, and for: where the host fell behind)."""
    if not kernels:
        return {"inside_ms": 0.0, "gaps": 0, "largest": []}
    ks = sorted(kernels, key=lambda k: k[1])
    gaps, (prev, _, end) = [], ks[0]
    for name, start, stop in ks[1:]:
        if start > end:
            gaps.append((start - end, prev, name))
        if stop > end:
            prev, end = name, stop
    gaps.sort(key=lambda g: -g[0])
    return {"inside_ms": sum(g[0] for g in gaps) / 1e3, "gaps": len(gaps),
            "largest": [{"ms": g / 1e3, "after": a[:70], "before": b[:70]} for g, a, b in gaps[:top]]}


def profile_step(fn, top: int = 25) -> dict:
    """fn() once under the profiler (device synchronised before and after): categories, top kernels, idle."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_category: dict[str, dict] = {}
    for e in kernels:
        c = by_category.setdefault(categorize(e.key), {"ms": 0.0, "launches": 0})
        c["ms"] += e.self_device_time_total / 1e3
        c["launches"] += e.count
    busy = sum(c["ms"] for c in by_category.values())
    # host syncs: the runtime calls that block the host until the device catches up (a .item(), a device-to-host copy)
    syncs = {e.key: e.count for e in prof.key_averages() if e.key in SYNC_CALLS}
    kernels.sort(key=lambda e: -e.self_device_time_total)
    timeline = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"wall_ms": wall * 1e3, "kernel_ms": busy, "idle_ms": wall * 1e3 - busy, "idle": idle_gaps(timeline),
            "launches": sum(c["launches"] for c in by_category.values()), "host_syncs": syncs,
            "by_category": dict(sorted(by_category.items(), key=lambda kv: -kv[1]["ms"])),
            "top_kernels": [{"name": e.key[:90], "category": categorize(e.key), "ms": e.self_device_time_total / 1e3,
                             "launches": e.count} for e in kernels[:top]]}


def profile_sources(fn, path, rows: int = 60) -> None:
    """fn() once more under the profiler with Python stacks: the aten ops by the device time of the kernels they
    launch, grouped by their 6 innermost Python frames, written to `path` (where the eager elementwise and copy
    kernels come from). A separate run because recording stacks slows the host (its idle figure would mislead)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, with_stack=True, record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    ops = prof.key_averages(group_by_stack_n=6)
    with open(path, "w") as f:
        f.write(ops.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))
        f.write("\n\nelementwise and copy ops by what ran them (autograd's backward nodes have no Python stack: "
                "the node\nwhose grads an op computes or sums) and their input shapes\n")
        f.write(_ops_by_parent(prof.events(), rows))
        f.write("\n\nby op (no stacks)\n")
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows,
                                          max_name_column_width=60))


GLUE_OPS = ("aten::add", "aten::add_", "aten::copy_", "aten::mul", "aten::fill_", "aten::zero_", "aten::cat",
            "aten::stack", "aten::sum", "aten::mul_", "aten::index_add_", "aten::index", "aten::clone")


def _ops_by_parent(events, rows: int) -> str:
    """The glue ops' device time grouped by (op, the nearest enclosing autograd node or Python-level op, shapes)."""
    import collections

    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.name not in GLUE_OPS:
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith(("autograd::engine", "aten::", "torch::autograd")):
            parent = parent.cpu_parent
        where = "-" if parent is None else parent.name.removeprefix("autograd::engine::evaluate_function: ")
        key = (e.name, where, str(e.input_shapes)[:90])
        total[key] += e.self_device_time_total
        count[key] += 1
    lines = ["| op | inside | input shapes | device ms | calls |", "|---|---|---|---|---|"]
    for (op, where, shapes), us in total.most_common(rows):
        lines.append(f"| {op} | {where} | {shapes} | {us / 1e3:.2f} | {count[(op, where, shapes)]} |")
    return "\n".join(lines) + "\n"


def print_profile(p: dict) -> None:
    print(f"\n### step profile: wall {p['wall_ms']:.1f} ms, kernels {p['kernel_ms']:.1f} ms in {p['launches']} "
          f"launches, device idle {p['idle_ms']:.1f} ms; host syncs {p.get('host_syncs', {})}\n")
    print("| category | ms | share of wall | launches |\n|---|---|---|---|")
    for name, c in p["by_category"].items():
        print(f"| {name} | {c['ms']:.1f} | {c['ms'] / p['wall_ms']:.1%} | {c['launches']} |")
    print(f"| device idle | {p['idle_ms']:.1f} | {p['idle_ms'] / p['wall_ms']:.1%} | |")
    idle = p.get("idle")
    if idle:
        print(f"\nidle between the step's first and last kernel: {idle['inside_ms']:.1f} ms in {idle['gaps']} gaps "
              f"(the rest of the idle: before the first kernel and after the last)\n")
        print("| idle gap ms | after | before |\n|---|---|---|")
        for g in idle["largest"]:
            print(f"| {g['ms']:.2f} | {g['after']} | {g['before']} |")
    print("\n| top kernel | category | ms | launches |\n|---|---|---|---|")
    for k in p["top_kernels"]:
        print(f"| {k['name']} | {k['category']} | {k['ms']:.1f} | {k['launches']} |")
