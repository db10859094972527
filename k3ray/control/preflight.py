"""The pre-flight device-memory check of `k3ray train`: before any worker starts (so before any model is built), the
job's per-worker memory estimate (k3ray.policies.memory) against one worker's device. It fits: one log line. It
fits with activation recompute or smaller micro-batches: the job runs so, and a console warning says so. It fits
with room for fewer, larger micro-batches: the job runs so, and the log line says so. Nothing
fits: a ConfigError (one line, exit 2) naming what the worker needs, what the device has and the grid that fits."""
from __future__ import annotations

import logging

import ray

from k3ray.config import ConfigError, JobConfig
from k3ray.grid.held_resources import actor_runtime_env
from k3ray.policies import memory

log = logging.getLogger("k3ray")
PROBE_TIMEOUT_S = 120.0  # a cluster whose GPUs are all taken: the check is skipped, the placement waits as before


def _device_total_bytes() -> int:
    """The memory of the device this task was given (its process exits after it: no CUDA context stays behind)."""
    import torch

    return torch.cuda.mem_get_info()[1]


def device_bytes(cfg: JobConfig) -> int | None:
    """One worker's device memory: execution.device_memory_gib, else (CUDA) a GPU of the cluster's, read by a task
    holding one; None: no check (CPU without a configured limit, or no GPU free within PROBE_TIMEOUT_S)."""
    if cfg.execution.device_memory_gib is not None:
        return int(cfg.execution.device_memory_gib * memory.GiB)
    if cfg.parallel.device != "cuda":
        return None
    probe = ray.remote(num_gpus=1, num_cpus=0, max_calls=1)(_device_total_bytes)
    ref = probe.options(runtime_env=actor_runtime_env(cfg)).remote()
    try:
        return ray.get(ref, timeout=PROBE_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        log.warning("device memory: no GPU free within %.0f s to read its size: not checked", PROBE_TIMEOUT_S)
        return None


def checked(cfg: JobConfig, device: int | None) -> JobConfig:
    """`cfg` as it will run on devices of `device` bytes (None: unchecked): unchanged, or with recompute and
    micro-batch settings that fit (a warning says so); ConfigError when nothing fits."""
    if device is None:
        return cfg
    decision = memory.decide(cfg, device)
    line = memory.describe(decision)
    if decision.outcome == "refused":
        raise ConfigError(f"{cfg.name}: {line}")
    if decision.outcome == "adjusted":
        log.warning("%s", line)
    else:  # fits as configured, or filled with fewer, larger micro-batches
        log.info("%s", line)
    return memory.with_settings(cfg, decision.changes) if decision.changes else cfg
