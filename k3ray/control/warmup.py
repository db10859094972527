"""`k3ray warmup --config C`: compile and autotune a job's kernels into the kept cache (k3ray.grid.kernel_cache)
ahead of the job, so that its first step, a relaunched worker's and a spare's find them there.

It runs the job's own step (a one-process grid, pp = ep = 1, the engine the workers run) on this machine's device, at
the job's micro-batch shape, on a model cut to one layer of each kind the job's stack holds (its dense first layers
and one period of its attention pattern): the kernels and their autotuned shapes are the job's, at a fraction of its
memory. The step runs twice: the first compiles and tunes, the second shows what a warm start costs."""
from __future__ import annotations

import os
import time

from k3ray.config import ConfigError, JobConfig, load_config, parse_assignments
from k3ray.control.local_nodes import free_ports
from k3ray.grid.kernel_cache import kernel_cache_env


def warmup_config(cfg: JobConfig) -> JobConfig:
    """The job's config on one process with one layer of each kind: its dense first layers and one period of its
    attention pattern (aligned to the end of the stack, as the model lays it out)."""
    m = cfg.model
    period = len(m.attention_pattern) if m.mla_layers is None else 1 + (len(m.mla_layers) < m.n_layers)
    n_layers = min(m.n_layers, m.first_dense_layers + period)
    overrides = {"model": {"n_layers": n_layers, "mla_layers": None if m.mla_layers is None else [n_layers - 1]},
                 "parallel": {"pp": 1, "ep": 1}}
    dump = cfg.model_dump()
    for section, fields in overrides.items():
        dump[section] = {**dump[section], **fields}
    if m.attn_res_block_size:
        dump["model"]["attn_res_block_size"] = min(m.attn_res_block_size, n_layers)
    return JobConfig.model_validate(dump)


def run_warmup(cfg: JobConfig, steps: int = 2) -> list[float]:
    """Seconds of each of `steps` training steps of the cut model on this machine's device."""
    os.environ.update(kernel_cache_env())  # before the kernels' modules import triton
    import torch
    import torch.distributed as dist

    from k3ray.parallel.engine import StageEngine

    small = warmup_config(cfg)
    device = small.parallel.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{cfg.name}: parallel.device=cuda and this machine has no GPU: run `k3ray warmup` where "
                          f"the job's workers run")
    engine = StageEngine(small, 0, 0, [0] * small.model.n_experts, 1, device)
    engine.init_process_groups(f"tcp://127.0.0.1:{free_ports(1)[0]}", "nccl" if device == "cuda" else "gloo")
    seconds = []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            engine.train_step(step, step)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
    finally:
        engine.leave_process_groups()
        if dist.is_initialized():
            dist.destroy_process_group()
    return seconds


def cmd_warmup(args) -> int:
    cfg = load_config(args.config, parse_assignments(args.set))
    seconds = run_warmup(cfg)
    cache = kernel_cache_env()["TRITON_CACHE_DIR"]
    where = f"kept in {cache}" if cfg.parallel.device == "cuda" else "none on CPU (the kernels' torch references run)"
    print(f"warmup of {cfg.name} ({warmup_config(cfg).model.n_layers} layers, micro-batch "
          f"{cfg.data.micro_batch_size} x {cfg.data.seq_len}): first step {seconds[0]:.2f} s, then "
          f"{seconds[-1]:.2f} s; compiled kernels and autotune results: {where}")
    return 0


def add_parser(sub) -> None:
    w = sub.add_parser("warmup", help="compile and autotune a config's kernels into the kept cache ahead of a job")
    w.add_argument("--config", required=True)
    w.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config field")
    w.set_defaults(func=cmd_warmup)
