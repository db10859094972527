"""Checkpoint I/O on this machine: how long the caller is blocked writing a part synchronously (write_part) vs
asynchronously (clone + AsyncWriter.submit), how long the background write takes end to end, and how long
verify (sha256 of the file) takes. Medians of --reps runs; prints the table as Markdown for benchmarks/RESULTS.md.

    python benchmarks/checkpoint_io.py [--sizes-mb 50 500] [--reps 3] [--dir /tmp]
"""
from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from k3ray.io import checkpoint as ck

DATE = "2026-11-29"


def make_state(mb: int) -> dict:
    """~mb MB of fp32 in shard-like tensors: one dense block and 8 experts' w1/w2 with AdamW moments."""
    n = mb * (1 << 20) // 4
    per = n // 40
    g = torch.Generator().manual_seed(0)
    experts = {f"e{i}": {w: torch.randn(per, generator=g) for w in ("w1", "w2", "m1", "v1")} for i in range(8)}
    return {"dense": torch.randn(n - 32 * per, generator=g), "experts": experts, "step": 1, "cursor": [1, 2]}


def clone(state):
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    return state


def copy_into(dst, src) -> None:
    if isinstance(src, torch.Tensor):
        dst.copy_(src)
    elif isinstance(src, dict):
        for k, v in src.items():
            copy_into(dst[k], v)


def one_run(root: Path, mb: int, state: dict, staging: dict, rep: int) -> dict:
    t0 = time.perf_counter()
    info = ck.write_part(root, rep, "sync.pt", state)
    sync = time.perf_counter() - t0

    with ck.AsyncWriter() as w:
        t0 = time.perf_counter()
        fut = w.submit(root, rep, "async_clone.pt", clone(state))  # the caller owns `state` again after clone
        blocked_clone = time.perf_counter() - t0
        fut.result()
        total = time.perf_counter() - t0

        t0 = time.perf_counter()
        copy_into(staging, state)  # a staging copy the worker reuses once the previous write is done
        fut2 = w.submit(root, rep, "async_staged.pt", staging)
        blocked_staged = time.perf_counter() - t0
        fut2.result()

    ck.commit(root, rep, [info, fut.result(), fut2.result()], {"bench": mb}, keep=1)
    t0 = time.perf_counter()
    ck.verify(root, rep)
    verify = (time.perf_counter() - t0) / 3  # three parts of the same size
    return {"bytes": info.bytes, "sync": sync, "async_clone": blocked_clone, "async_staged": blocked_staged,
            "async_total": total, "verify": verify}


def lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    model = fields.get("Model name", "?").strip()
    return f"{model}, {fields.get('CPU(s)', '?').strip()} CPUs ({fields.get('Hypervisor vendor', 'bare').strip()})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[50, 500])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()

    rows = []
    for mb in args.sizes_mb:
        state = make_state(mb)
        staging = clone(state)
        root = Path(tempfile.mkdtemp(prefix="k3ray-ckpt-bench-", dir=args.dir))
        try:
            runs = [one_run(root, mb, state, staging, rep) for rep in range(args.reps)]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append((mb, med))
        del state, staging

    head = ("| state | file MB | sync: blocked s | async, fresh clone: blocked s | async, reused staging copy: "
            "blocked s | async: write done s | verify s/part | sync write MB/s | verify MB/s |")
    lines = [head, "|" + "---|" * 9]
    for mb, m in rows:
        fmb = m["bytes"] / (1 << 20)
        lines.append(f"| ~{mb} MB | {fmb:.1f} | {m['sync']:.3f} | {m['async_clone']:.3f} "
                     f"| {m['async_staged']:.3f} | {m['async_total']:.3f} "
                     f"| {m['verify']:.3f} | {fmb / m['sync']:.0f} | {fmb / m['verify']:.0f} |")
    table = "\n".join(lines)

    print(f"""# Checkpoint I/O (k3ray.io.checkpoint)

Date: {DATE}. Hardware: {lscpu_model()}; disk: the filesystem of `{args.dir}`. torch {torch.__version__},
Python {platform.python_version()}. Medians of {args.reps} runs. Command: `python benchmarks/checkpoint_io.py`.

Each run writes the same state three times: synchronously (`write_part`: torch.save + sha256 while writing +
fsync + rename); asynchronously from a fresh `clone` of every tensor (the copy is the caller's cost: it must not
mutate what it hands over); asynchronously from a staging copy the worker allocated once and refills with
`copy_` (no page faults on fresh memory). "write done" is submit to future resolved for the fresh-clone write.
Then it commits and times `verify` per part (stat + sha256 re-read; page cache warm, the file was just written).
Fresh allocations are slow on this VM (first-touch page faults), so a worker that checkpoints often should keep
a staging buffer; on a GPU the device-to-host copy into pinned staging memory plays that role.
Caveat: this is a shared 2-vCPU VM and other jobs ran during the measurement; a bare 50 MB `copy_` into
already-touched memory measured anywhere from 3 ms to 0.7 s across repeats, so the small-state "blocked" columns
are dominated by that noise. The 500 MB row shows the shape that matters: async blocks the caller for the copy
only (a fraction of the synchronous write), the write itself continues on the background thread.

{table}
""")


if __name__ == "__main__":
    main()
