"""Issue 8: the end-to-end benchmark, every part on the same GPUs in one invocation (one process per GPU).

Parts (--parts, in this order; each prints a table and writes <out>/<part>.json):
  plain  the model's training step in one plain torch.distributed program (StageEngine driven directly, no Ray),
         and the dense bf16 matmul peak measured in that run (for MFU); `plain_1gpu`: the same with each process
         seeing only its own GPU (CUDA_VISIBLE_DEVICES), as Ray starts GPU workers;
  k3ray  the same job through `k3ray`'s Controller and Worker actors on Ray: tokens/s, MFU, Ray overhead vs plain;
  overhead  Ray's overhead with both programs alive on the same GPUs (plain_1gpu and k3ray), taking turns step by
         step, who goes first alternating; the overhead is the median over steps of k3ray's / plain's step - 1,
         both timed by the driver (order to the program -> its report back);
  moe    the MoE layer alone (fwd+bwd, no shared experts) under router skew Zipf 0..1.5 (a bias -s*ln(e+1) on the
         router logits), MoonEP on (as the config's policies.moonep: priced by its cost model unless
         cost_model=false) and off, and DeepSpeed-MoE (deepspeed.moe.layer.MoE, dropless) on the same
         shapes and skew when deepspeed imports (benchmarks/carry_deepspeed.sh);
  drill  kill one worker mid-run: the job continues on the survivors and grows back; MTTR and its split.

    python benchmarks/e2e_gpu.py --config configs/gpu2.yaml --out /tmp/e2e          # on 2 GPUs
    python benchmarks/e2e_gpu.py --config configs/tiny.yaml --set parallel.ep=2 --set parallel.device=cpu  # on CPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3ray.config import JobConfig, load_config, parse_assignments  # noqa: E402
from k3ray.control.local_nodes import free_port  # noqa: E402
from k3ray.model.params import model_totals  # noqa: E402
from moe_deepspeed import zipf_bias  # noqa: E402  (the same skew for both systems)

ZIPFS = (0.0, 0.5, 1.0, 1.2, 1.5)


def set_threads() -> None:
    """The intra-op threads a k3ray Worker uses (K3RAY_THREADS_PER_WORKER), so the plain program is the same."""
    torch.set_num_threads(max(1, int(os.environ.get("K3RAY_THREADS_PER_WORKER", "1"))))


def flops_per_token(cfg: JobConfig) -> float:
    """Training FLOPs per token of the model's matmuls: 6 x active parameters but the embedding table (a lookup,
    no matmul; the output head is one) + attention: per MLA layer causal softmax attention, QK^T over the key's
    h + p dims (p the decoupled slice, rotated or not) and AV over h, half the square, forward and backward:
    3 x seq x heads x (2h + p); per KDA layer the recurrent form's state products (k^T S, the k v^T update, q^T S:
    3 x 2 x heads x d_k x d_v forward, x3 with the backward), independent of the sequence length."""
    m = cfg.model
    kinds = [m.layer_kind(layer) for layer in range(m.n_layers)]
    mla = 3.0 * kinds.count("mla") * cfg.data.seq_len * m.n_heads * (2 * m.head_dim + m.mla_rope_dim)
    kda = 18.0 * kinds.count("kda") * m.n_heads * m.kda_head_dim ** 2
    return 6.0 * (model_totals(m)["active_params"] - m.vocab_size * m.d_model) + mla + kda


def tokens_per_step(cfg: JobConfig, ep: int) -> int:
    return cfg.data.seq_len * cfg.data.micro_batch_size * cfg.parallel.micro_batches * ep


def matmul_peak_tflops(device: torch.device, n: int = 8192, iters: int = 10) -> float:
    """Dense bf16 n^3 matmul TFLOP/s on this device, mean of `iters` after warm-up (the MFU denominator)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize(device)
    return 2 * n ** 3 * iters / (time.perf_counter() - t0) / 1e12


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- plain torch.distributed --------------------------------------------------------------------------------------
def _plain_server(rank: int, cfg_dict: dict, port: int, one_gpu_visible: bool, commands: list, queue) -> None:
    """One rank of the plain program: build the engine, report ready, then run engine.train_step(step, step) for
    each step number on its command queue until None."""
    from k3ray.policies.moonep import default_home, maxvio
    from k3ray.parallel.engine import StageEngine

    cfg = JobConfig.model_validate(cfg_dict)
    ep, cuda = cfg.parallel.ep, cfg.parallel.device == "cuda"
    set_threads()
    gpu = rank
    if cuda and one_gpu_visible:  # as Ray starts its GPU workers: each process sees only its own device
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
        gpu = 0
    if cuda:
        torch.cuda.set_device(gpu)
    peak = matmul_peak_tflops(torch.device("cuda", gpu)) if cuda else float("nan")
    home = default_home(cfg.model.n_experts, ep).tolist()
    engine = StageEngine(cfg, 0, rank, home, ep, "cuda" if cuda else "cpu")
    engine.init_process_groups(f"tcp://127.0.0.1:{port}", "nccl" if cuda else "gloo")
    queue.put({"rank": rank, "peak_tflops": peak})
    while (command := commands[rank].get()) is not None:
        step, profile = command if isinstance(command, tuple) else (command, False)
        t0 = time.perf_counter()
        if profile:  # the step once more under the profiler (rank 0's kernels by category)
            from step_profile import profile_step

            reports = []
            profiled = profile_step(lambda: reports.append(engine.train_step(step, step)))
            report = reports[0]
        else:
            report = engine.train_step(step, step)
        if cuda:
            torch.cuda.synchronize()
        vios = [maxvio(rows) for rows in report.get("tokens_per_expert", {}).values()]
        queue.put({"rank": rank, "seconds": time.perf_counter() - t0, "loss": report["loss"],
                   "timings": report["timings"], "maxvio": max(vios) if vios else float("nan"),
                   "mean_maxvio": statistics.fmean(vios) if vios else float("nan"),
                   "profile": profiled if profile else None,
                   "reserved_gb": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0})
    dist.destroy_process_group()


def _get(queue, procs: list, name: str):
    """The next object on the queue; raises at once if one of the processes died instead."""
    import queue as queue_mod

    while True:
        try:
            return queue.get(timeout=5)
        except queue_mod.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{name}: a process exited with {dead}")


def spawn(target, n: int, args: tuple, results: int) -> list:
    """Run target(rank, *args, queue) in n fresh processes; the `results` objects they put on the queue."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, q)) for r in range(n)]
    for p in procs:
        p.start()
    out = [_get(q, procs, target.__name__) for _ in range(results)]
    for p in procs:
        p.join()
    return out


class PlainProgram:
    """The plain torch.distributed program (StageEngine in one spawned process per EP rank, no Ray), kept alive
    between steps so that it can take turns with k3ray on the same GPUs."""

    def __init__(self, cfg: JobConfig, one_gpu_visible: bool):
        ctx = mp.get_context("spawn")
        self.n = cfg.parallel.ep
        self.results = ctx.Queue()
        self.commands = commands = [ctx.Queue() for _ in range(self.n)]
        port = free_port()
        self.procs = [ctx.Process(target=_plain_server, args=(r, cfg.model_dump(), port, one_gpu_visible, commands,
                                                                  self.results)) for r in range(self.n)]
        for p in self.procs:
            p.start()
        ready = [_get(self.results, self.procs, "plain") for _ in range(self.n)]
        self.peak_tflops = _median([r["peak_tflops"] for r in ready])

    def step(self, step: int, profile: bool = False) -> dict:
        """Run one step on every rank: the slowest rank's own seconds, rank 0's loss, MaxVio (the most imbalanced
        layer's and the mean over layers, global batch), phase timings and, with `profile`, its kernel profile."""
        for q in self.commands:
            q.put((step, profile))
        reports = sorted((_get(self.results, self.procs, "plain") for _ in range(self.n)), key=lambda r: r["rank"])
        return {"worker_seconds": max(r["seconds"] for r in reports), "loss": reports[0]["loss"],
                "maxvio": reports[0]["maxvio"], "mean_maxvio": reports[0]["mean_maxvio"],
                "profile": reports[0]["profile"],
                "timings": reports[0]["timings"], "reserved_gb": max(r["reserved_gb"] for r in reports)}

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=60)


def phase_medians(timings: list[dict]) -> dict:
    return {k: _median([t[k] for t in timings]) for k in timings[0]} if timings else {}


def _run(program, steps: int, verbose: bool = False) -> tuple[list[float], list[dict]]:
    """Driver-measured seconds and reports of steps 0..steps-1."""
    times, reports = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        reports.append(program.step(step))
        times.append(time.perf_counter() - t0)
        if verbose:
            vio = f", MaxVio max {reports[-1]['maxvio']:.3f} mean {reports[-1]['mean_maxvio']:.3f}" \
                if "maxvio" in reports[-1] else ""
            print(f"step {step}: {times[-1]:.3f} s, loss {reports[-1]['loss']:.4f}{vio}", flush=True)
    return times, reports


def part_plain(cfg: JobConfig, steps: int, warmup: int, one_gpu_visible: bool = False, profile: bool = False,
               verbose: bool = False) -> dict:
    """`profile`: one more step after the timed ones, under the profiler."""
    program = PlainProgram(cfg, one_gpu_visible)
    try:
        times, reports = _run(program, steps, verbose)
        profiled = program.step(steps, profile=True)["profile"] if profile else None
    finally:
        program.close()
    med = _median(times[warmup:])
    tokens = tokens_per_step(cfg, cfg.parallel.ep)
    return {"step_seconds": times, "median_step_s": med, "tokens_per_s": tokens / med,
            "peak_tflops": program.peak_tflops,
            "mfu": flops_per_token(cfg) * tokens / med / (program.peak_tflops * 1e12 * cfg.parallel.ep),
            "worker_step_s": _median([r["worker_seconds"] for r in reports[warmup:]]),
            "losses": [r["loss"] for r in reports], "reserved_gb": reports[-1]["reserved_gb"],
            "maxvio": [r["maxvio"] for r in reports], "mean_maxvio": [r["mean_maxvio"] for r in reports],
            "profile": profiled, "phases": phase_medians([r["timings"] for r in reports[warmup:]])}


# -- k3ray on Ray -------------------------------------------------------------------------------------------------
class RayProgram:
    """The same job through k3ray's Controller and Worker actors on a local Ray cluster."""

    def __init__(self, cfg: JobConfig, preflight: bool = False):
        """`preflight`: the config as `k3ray train` runs it (its device-memory check may fill the GPU with fewer,
        larger micro-batches, or turn on recompute); off, as given (the same shape as PlainProgram's)."""
        from k3ray.control import preflight as checks
        from k3ray.control.driver import start_controller
        from k3ray.control.ray_cluster import init_ray

        init_ray(None, cfg.parallel.world_size)
        self.cfg = checks.checked(cfg, checks.device_bytes(cfg)) if preflight else cfg
        self.controller = start_controller(self.cfg)

    def step(self, step: int, ahead: bool = False) -> dict:
        """`ahead`: the next call is step + 1, as `k3ray train`'s loop says (the workers may run it ahead)."""
        import ray

        report = ray.get(self.controller.train_step.remote(step, ahead=ahead))
        return {**report, "worker_seconds": report["timings"]["total"]}  # the slowest worker's own train_step

    def call(self, fn):
        import ray

        return ray.get(self.controller.__ray_call__.remote(fn))

    def close(self) -> None:
        import ray

        from k3ray.control.driver import stop_controller

        try:
            stop_controller(self.controller)
        finally:
            ray.shutdown()


def _ray_job(cfg: JobConfig, steps: int, verbose: bool = False) -> tuple[list[float], list[dict], dict, list[dict],
                                                                         dict]:
    program = RayProgram(cfg)
    try:
        times, reports = _run(program, steps, verbose)
        status = program.call(lambda self: self.status())
        incidents = program.call(lambda self: self.get_incidents())
        snaps = program.call(
            lambda self: {"stall_s": list(self.snapshots.stall_seconds), "total_s": list(self.snapshots.total_seconds),
                          "bytes": self.snapshots.committed.nbytes if self.snapshots.committed is not None else 0})
        return times, reports, status, incidents, snaps
    finally:
        program.close()


def part_k3ray(cfg: JobConfig, steps: int, warmup: int, plain: dict | None) -> dict:
    times, reports, status, _, snaps = _ray_job(cfg, steps)
    med = _median(times[warmup:])
    tokens = tokens_per_step(cfg, cfg.parallel.ep)
    out = {"step_seconds": times, "median_step_s": med, "tokens_per_s": tokens / med, "snapshots": snaps,
           "losses": [r["loss"] for r in reports], "ep": status["ep"],
           "worker_step_s": _median([r["worker_seconds"] for r in reports[warmup:]]),
           "phases": phase_medians([r["timings"] for r in reports[warmup:]])}
    if plain is not None:
        out["mfu"] = flops_per_token(cfg) * tokens / med / (plain["peak_tflops"] * 1e12 * cfg.parallel.ep)
        out["ray_overhead"] = med / plain["median_step_s"] - 1
    return out


def part_overhead(cfg: JobConfig, steps: int, warmup: int) -> dict:
    """Ray's overhead with both programs alive on the same GPUs, taking turns step by step (who goes first
    alternates), so that both see the machine in the same state: run-to-run drift cancels within each pair."""
    plain = PlainProgram(cfg, one_gpu_visible=True)
    try:
        for step in range(warmup):  # compiles the kernels (Triton's disk cache) before Ray's workers start
            reserved_gb = plain.step(step)["reserved_gb"]
        if cfg.parallel.device == "cuda":  # both programs must fit on each GPU at once
            total_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
            print(f"overhead: the plain program holds {reserved_gb:.1f} of {total_gb:.1f} GiB per GPU", flush=True)
            if reserved_gb > 0.48 * total_gb:
                raise RuntimeError(f"overhead: the plain program holds {reserved_gb:.1f} GiB of {total_gb:.1f}; "
                                   "k3ray would not fit beside it")
        k3ray = RayProgram(cfg)
        try:
            for step in range(warmup):
                k3ray.step(step)
            pairs, reserved_gb = [], 0.0
            for i, step in enumerate(range(warmup, warmup + steps)):
                pair = {"step": step, "first": "plain" if i % 2 == 0 else "k3ray"}
                for name in (("plain", "k3ray") if i % 2 == 0 else ("k3ray", "plain")):
                    program = plain if name == "plain" else k3ray
                    t0 = time.perf_counter()
                    report = program.step(step)
                    pair[name] = {"seconds": time.perf_counter() - t0, "worker_seconds": report["worker_seconds"],
                                  "loss": report["loss"], "timings": report["timings"]}
                    reserved_gb = report.get("reserved_gb", reserved_gb)
                pair["ratio"] = pair["k3ray"]["seconds"] / pair["plain"]["seconds"]
                pairs.append(pair)
        finally:
            k3ray.close()
    finally:
        plain.close()

    def med(name: str, key: str) -> float:
        return _median([p[name][key] for p in pairs])

    ratios = [p["ratio"] for p in pairs]
    return {"steps": steps, "warmup": warmup, "pairs": pairs, "median_overhead": _median(ratios) - 1,
            "ratio_quartiles": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios,
            "plain_step_s": med("plain", "seconds"), "k3ray_step_s": med("k3ray", "seconds"),
            "plain_worker_s": med("plain", "worker_seconds"), "k3ray_worker_s": med("k3ray", "worker_seconds"),
            "ray_own_s": _median([p["k3ray"]["seconds"] - p["k3ray"]["worker_seconds"] for p in pairs]),
            "worker_ratio": _median([p["k3ray"]["worker_seconds"] / p["plain"]["worker_seconds"] for p in pairs]),
            "plain_phases": phase_medians([p["plain"]["timings"] for p in pairs]),
            "k3ray_phases": phase_medians([p["k3ray"]["timings"] for p in pairs]),
            "plain_reserved_gb": reserved_gb,  # both programs train the same model on the same batches:
            "loss_max_rel_diff": max(abs(p["k3ray"]["loss"] / p["plain"]["loss"] - 1) for p in pairs)}


# -- the MoE layer under skew ---------------------------------------------------------------------------------------
def _moe_rank(rank: int, cfg_dict: dict, tokens: int, iters: int, port: int, with_deepspeed: bool, queue) -> None:
    from k3ray.dtypes import up32
    from k3ray.model.decoder import init_dense_, init_shard_
    from k3ray.model.moe import ExpertShard, LatentMoE
    from k3ray.policies.moonep import default_home
    from k3ray.parallel.ep import EPContext, ExpertParallelExperts
    from k3ray.policies.planner import HomePlanner, MoonEPPlanner

    cfg = JobConfig.model_validate(cfg_dict)
    m = cfg.model.model_copy(update={"n_shared": 0})
    ep, cuda = cfg.parallel.ep, cfg.parallel.device == "cuda"
    set_threads()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ep)
    dtype = getattr(torch, m.dtype)
    home = default_home(m.n_experts, ep)
    ctx = EPContext(dist.group.WORLD, rank, ep, home, m)
    mine = (home == rank).nonzero().flatten().tolist()
    shard = ExpertShard(mine, m.d_latent, m.expert_inner)
    init_shard_(shard, 0, 0, m)
    layer = LatentMoE(m, ExpertParallelExperts(shard, ctx))
    init_dense_(layer, 0, m, prefix="blocks.0.moe.")
    layer.to(device=device, dtype=dtype)
    layer.router.bias.zero_()
    skew = torch.zeros(m.n_experts, device=device)
    router = layer.router
    router.forward = lambda x: torch.sigmoid(up32(x) @ up32(router.weight).t() + skew)  # bias on the logits
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(tokens, m.d_model, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)
    with torch.no_grad():
        logit_std = float((up32(x) @ up32(router.weight).t()).std())

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        ts = []
        for _ in range(iters):
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(ts)], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t) * 1e3

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer.experts.reset()
        layer(x.view(1, tokens, -1)).float().square().mean().backward()

    rows = []
    for zipf in ZIPFS:
        skew.copy_(zipf_bias(m.n_experts, zipf))
        for moonep_on in (False, True):
            ctx.planner = MoonEPPlanner.from_config(cfg.policies.moonep, m) if moonep_on else HomePlanner()
            ms = timed(step)
            load = layer.experts.rank_load.double()
            tpe = layer.experts.tokens_per_rank_expert.sum(0).double()
            rows.append({"system": "k3ray", "moonep": moonep_on, "zipf": zipf, "ms": ms,
                         "tokens_per_s": tokens * ep / ms * 1e3,
                         "max_rank_rows_over_mean": float(load.max() / load.mean()),
                         "max_expert_tokens_over_mean": float(tpe.max() / tpe.mean())})
    profile = None
    skew.zero_()
    ctx.planner = MoonEPPlanner.from_config(cfg.policies.moonep, m)
    if rank == 0:  # where one balanced fwd+bwd spends its time (top ops by device and by host time)
        from torch.profiler import ProfilerActivity, profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            step()
            if cuda:
                torch.cuda.synchronize()
        avg = prof.key_averages()
        profile = {"by_device": avg.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                          row_limit=12, max_name_column_width=48),
                   "by_host": avg.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=48)}
    else:  # the other ranks join the profiled step's collectives
        step()
    if with_deepspeed:
        from moe_deepspeed import deepspeed_moe_layer_ms

        for zipf in ZIPFS:
            r = deepspeed_moe_layer_ms(tokens, m.d_model, m.d_latent, m.expert_inner, m.n_experts, m.top_k, ep, zipf,
                                       iters, 3, str(device), dtype, gate_std=logit_std)
            rows.append({"system": "deepspeed", "moonep": None, "zipf": zipf, "ms": r["ms_median"],
                         "tokens_per_s": r["tokens_per_s"], "max_rank_rows_over_mean": r["max_rank_tokens_over_mean"],
                         "max_expert_tokens_over_mean": r["max_expert_tokens_over_mean"],
                         "padded_rows_over_routed": r["padded_rows_over_routed"],
                         "version": r["deepspeed_version"]})
    if rank == 0:
        queue.put({"rows": rows, "logit_std": logit_std, "tokens_per_rank": tokens, "profile": profile})
    dist.barrier()
    dist.destroy_process_group()


def part_moe(cfg: JobConfig, tokens: int, iters: int) -> dict:
    import importlib.util

    with_ds = importlib.util.find_spec("deepspeed") is not None
    (out,) = spawn(_moe_rank, cfg.parallel.ep, (cfg.model_dump(), tokens, iters, free_port(), with_ds), 1)
    rows = out["rows"]

    def ms(system, moonep, zipf):
        return next(r["ms"] for r in rows if r["system"] == system and r["moonep"] == moonep and r["zipf"] == zipf)

    out["moonep_z15_over_z0"] = ms("k3ray", True, 1.5) / ms("k3ray", True, 0.0)
    out["no_moonep_z15_over_z0"] = ms("k3ray", False, 1.5) / ms("k3ray", False, 0.0)
    if with_ds:
        out["vs_deepspeed_z12"] = ms("deepspeed", None, 1.2) / ms("k3ray", True, 1.2)
    return out


# -- fault drill --------------------------------------------------------------------------------------------------
def part_drill(cfg: JobConfig, steps: int, kill_step: int) -> dict:
    drill_cfg = JobConfig.model_validate({**cfg.model_dump(), "fault_tolerance": {
        **cfg.fault_tolerance.model_dump(), "grow_back": True,
        "faults": [{"kind": "kill_worker", "step": kill_step, "worker": cfg.parallel.ep - 1}]}})
    print(f"drill: kill world rank {cfg.parallel.ep - 1} at step {kill_step}", flush=True)
    times, reports, status, incidents, snaps = _ray_job(drill_cfg, steps, verbose=True)
    lost = next(i for i in incidents if i["kind"] == "worker_lost")
    grow = next((i for i in incidents if i["kind"] == "grow_back"), None)
    return {"step_seconds": times, "incidents": incidents, "status_ep": status["ep"], "snapshots": snaps,
            "ep_per_step": [len(r["rank_load"][next(iter(r["rank_load"]))]) if r.get("rank_load") else None
                            for r in reports],
            "mttr_s": times[kill_step], "lost": lost, "grow_back": grow}


def print_table(title: str, rows: list[tuple]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(str(c) for c in rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for r in rows[1:]:
        print("| " + " | ".join(f"{c:.4g}" if isinstance(c, float) else str(c) for c in r) + " |")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/gpu2.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--parts", default="plain,k3ray,overhead,moe,drill")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--moe-tokens", type=int, default=16384, help="tokens per rank for the MoE layer part")
    ap.add_argument("--moe-iters", type=int, default=10)
    ap.add_argument("--drill-steps", type=int, default=16)
    ap.add_argument("--drill-kill-step", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="plain: one more step under the torch profiler, its "
                                                            "kernels by category (benchmarks/step_profile.py)")
    ap.add_argument("--verbose", action="store_true", help="plain: print every step (loss, MaxVio)")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/e2e"))
    args = ap.parse_args(argv)
    cfg = load_config(args.config, parse_assignments(args.set))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "config": args.config, "set": args.set}
    print(json.dumps(env))
    results: dict = {}

    def save(name: str, value: dict) -> None:
        results[name] = value
        (out / f"{name}.json").write_text(json.dumps(value, indent=1, default=str))

    tokens = tokens_per_step(cfg, cfg.parallel.ep)
    programs = ("plain", "plain_1gpu", "k3ray")  # plain_1gpu: each process sees only its GPU, as under Ray
    for name in programs:
        if name in parts and name == "k3ray":
            save(name, part_k3ray(cfg, args.steps, args.warmup, results.get("plain")))
        elif name in parts:
            save(name, part_plain(cfg, args.steps, args.warmup, one_gpu_visible=name == "plain_1gpu",
                                  profile=args.profile and name == "plain", verbose=args.verbose))
            if results[name].get("profile"):
                from step_profile import print_profile

                print_profile(results[name]["profile"])
    if any(name in results for name in programs):
        rows = [("program", "median step s", "tokens/s", "MFU", "vs plain", "median phases s")]
        for name in programs:
            if name in results:
                r = results[name]
                rows.append((name, r["median_step_s"], r["tokens_per_s"], r.get("mfu", float("nan")),
                             r["median_step_s"] / results["plain"]["median_step_s"] if "plain" in results else "-",
                             " ".join(f"{k} {v:.3f}" for k, v in r["phases"].items())))
        print_table(f"training step, {tokens} tokens/step, {flops_per_token(cfg) / 1e9:.2f} GFLOP/token, "
                    f"peak {results.get('plain', {}).get('peak_tflops', float('nan')):.0f} TFLOP/s per GPU", rows)
    if "overhead" in parts:
        r = save("overhead", part_overhead(cfg, args.steps, args.warmup)) or results["overhead"]
        rows = [("program", "median step s (driver)", "median own step s (slowest rank)", "median phases s")]
        for name in ("plain", "k3ray"):
            rows.append((name, r[f"{name}_step_s"], r[f"{name}_worker_s"],
                         " ".join(f"{k} {v:.3f}" for k, v in r[f"{name}_phases"].items())))
        print_table(f"Ray overhead, programs taking turns for {args.steps} steps after {args.warmup} warm-up: "
                    f"median k3ray/plain - 1 = {r['median_overhead']:+.2%} (quartiles of the ratio "
                    f"{', '.join(f'{q:.4f}' for q in r['ratio_quartiles'])}); Ray's own {r['ray_own_s'] * 1e3:.1f} ms",
                    rows)
        print({k: v for k, v in r.items() if k != "pairs"})
    if "moe" in parts:
        r = save("moe", part_moe(cfg, args.moe_tokens, args.moe_iters)) or results["moe"]
        rows = [("system", "MoonEP", "Zipf", "ms fwd+bwd", "tokens/s", "max rank rows / mean", "max expert / mean")]
        rows += [(x["system"], x["moonep"], x["zipf"], x["ms"], x["tokens_per_s"], x["max_rank_rows_over_mean"],
                  x["max_expert_tokens_over_mean"]) for x in r["rows"]]
        print_table(f"MoE layer, {r['tokens_per_rank']} tokens per rank (router logit std {r['logit_std']:.3f})", rows)
        print({k: v for k, v in r.items() if k not in ("rows", "profile")})
        print(r["profile"]["by_device"])
        print(r["profile"]["by_host"])
    if "drill" in parts:
        r = save("drill", part_drill(cfg, args.drill_steps, args.drill_kill_step)) or results["drill"]
        rows = [("event", "step", "ep", "seconds")]
        rows.append(("worker lost -> resharded", r["lost"]["step"], str(r["lost"]["ep"]), r["mttr_s"]))
        if r["grow_back"]:
            rows.append(("grown back", r["grow_back"]["step"], str(r["grow_back"]["ep"]), r["grow_back"]["seconds"]))
        print_table("fault drill", rows)
        print(json.dumps(r["lost"]["seconds"]))
        print("ep per step:", r["ep_per_step"])


if __name__ == "__main__":
    main()
