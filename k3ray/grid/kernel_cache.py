"""Compiled kernels and autotune results kept across runs, so that a job's first step (and a relaunched worker's, and
a spare's) does not compile and autotune again: Triton's cache, with autotune timings on disk
(`TRITON_CACHE_AUTOTUNING`), and Inductor's, in one folder per user and machine.

Triton keys every entry by its version and backend, the GPU's architecture, the kernel's source and (for autotune
results) the shapes it was tuned for, so one folder serves every GPU kind, version and model shape without mixing
them. The folder: `K3RAY_KERNEL_CACHE`, else `~/.cache/k3ray/kernels`; a `TRITON_CACHE_DIR` or
`TORCHINDUCTOR_CACHE_DIR` the user set wins. `k3ray warmup --config C` fills it ahead of a job.
"""
from __future__ import annotations

import os
from pathlib import Path


def kernel_cache_root() -> Path:
    return Path(os.environ.get("K3RAY_KERNEL_CACHE") or Path.home() / ".cache" / "k3ray" / "kernels").expanduser()


def kernel_cache_env() -> dict[str, str]:
    """The environment variables that point a process's Triton and Inductor at the kept caches."""
    root = kernel_cache_root()
    return {"TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR") or str(root / "triton"),
            "TRITON_CACHE_AUTOTUNING": os.environ.get("TRITON_CACHE_AUTOTUNING") or "1",
            "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(root / "inductor")}
