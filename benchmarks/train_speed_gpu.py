"""Training-step speed variants on one GPU (ep=1), one process, one model: eager against regional compilation,
micro-batch shapes at the same tokens per step, selective recompute; MFU as benchmarks/e2e_gpu.py counts it.

The engine (StageEngine, as a k3ray worker runs it) is built once; each variant then runs --warmup + --steps steps
and reports the median step (host-timed to a device sync), tokens/s, MFU, peak reserved memory. Variants run in the
order given; once a variant compiles the blocks, the later ones stay compiled (set compile variants last). A variant
that runs out of memory is reported as such and the next one runs. --profile NAME,...: one more step of those
variants under the profiler, kernels by category (benchmarks/step_profile.py).

    python benchmarks/train_speed_gpu.py --config configs/gpu2.yaml --set parallel.ep=1 \
        --variants eager:1x4,eager:4x1,compile:1x4,compile:4x1 --profile eager:1x4,compile:4x1
Variant names: MODE:BxM with MODE eager | recompute | compile | compile+recompute (+graphs: micro-batches replayed
as CUDA graphs, execution.graph_micro_batches; +kdakeep: fla's KDA keeps its forward's intermediates for the
backward instead of recomputing them), B sequences per micro-batch,
M micro-batches (B x M x seq_len tokens per step: keep it fixed to compare); MODE:fill is the shape the job picks on
this GPU from the configured one (k3ray.policies.memory, execution.fill_memory).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e_gpu import flops_per_token, matmul_peak_tflops, print_table  # noqa: E402
from k3ray.config import JobConfig, load_config, parse_assignments  # noqa: E402


DENSE_PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16: the MFU denominator


def variant_config(cfg: JobConfig, name: str) -> JobConfig:
    mode, shape = name.split(":")
    if shape == "fill":  # the shape the job's pre-flight check picks on this device (execution.fill_memory)
        from k3ray.policies import memory

        filled = memory.with_settings(cfg, memory.decide(cfg, torch.cuda.mem_get_info()[1]).changes)
        b, m = filled.data.micro_batch_size, filled.parallel.micro_batches
    else:
        b, m = (int(x) for x in shape.split("x"))
    execution = {"compile_blocks": "compile" in mode, "graph_micro_batches": "graphs" in mode,
                 "recompute": "attention_elementwise" if "recompute" in mode else "none"}
    return JobConfig.model_validate({**cfg.model_dump(), "execution": execution,
                                     "data": {**cfg.data.model_dump(), "micro_batch_size": b},
                                     "parallel": {**cfg.parallel.model_dump(), "micro_batches": m}})


_FLA_OPS = []  # k3ray's own kernels.kda.fla_ops, kept here once replaced


def keep_kda_intermediates(on: bool) -> None:
    """fla's chunk KDA with its forward's intermediates kept for the backward (`disable_recompute`) or recomputed
    there (fla's default, k3ray's): a variant to measure, where the installed fla takes the argument. k3ray's fla
    wrapper (kernels/kda.py) finds chunk_kda through `fla_ops`, which this replaces."""
    import inspect

    from k3ray.kernels import kda

    if not _FLA_OPS:
        _FLA_OPS.append(kda.fla_ops)
    kda.fla_ops = _FLA_OPS[0]
    ops = kda.fla_ops()
    if on and ops is not None and "disable_recompute" in inspect.signature(ops[0]).parameters:
        keeping = (functools.partial(ops[0], disable_recompute=True), ops[1])
        kda.fla_ops = lambda: keeping


def run_variant(engine, cfg: JobConfig, name: str, first_step: int, steps: int, warmup: int, peak: float,
                profile: bool, sources: Path | None = None) -> dict:
    from k3ray.model.decoder import set_execution
    from k3ray.parallel.batches import StageBatches

    keep_kda_intermediates("kdakeep" in name.split(":")[0])
    vcfg = variant_config(cfg, name)
    engine.cfg, engine.batches = vcfg, StageBatches(vcfg, engine.ep_rank, engine.ep, engine.device)
    set_execution(engine.stage, vcfg.execution, engine.device.type)
    engine.set_graphs()
    cuda = engine.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        report = engine.train_step(first_step + i, first_step + i)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(report["loss"])
        print(f"{name} step {i}: {times[-1]:.3f} s, loss {report['loss']:.4f}", flush=True)
    med = statistics.median(times[warmup:])
    b, m = vcfg.data.micro_batch_size, vcfg.parallel.micro_batches
    tokens = vcfg.data.seq_len * b * m
    out = {"variant": name, "step_seconds": times, "losses": losses, "median_step_s": med,
           "tokens_per_step": tokens, "tokens_per_s": tokens / med,
           "mfu": flops_per_token(vcfg) * tokens / med / (peak * 1e12),
           "mfu_989": flops_per_token(vcfg) * tokens / med / (DENSE_PEAK_TFLOPS * 1e12), "shape": f"{b}x{m}",
           "first_step_s": times[0], "reserved_gb": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0}
    if profile:
        from step_profile import print_profile, profile_sources, profile_step

        def one_step():
            engine.train_step(first_step + warmup + steps, first_step + warmup + steps)

        out["profile"] = profile_step(one_step)
        print_profile(out["profile"])
        if sources is not None:
            profile_sources(one_step, sources / f"sources_{name.replace(':', '_').replace('+', '-')}.txt")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/gpu2.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--variants", default="eager:1x4,eager:4x1,compile:1x4,compile:4x1")
    ap.add_argument("--profile", default="", help="comma-separated variants to profile one step of")
    ap.add_argument("--sources", action="store_true",
                    help="with --profile: one more step with Python stacks, its ops by device time to OUT/sources_*")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (no profile, no peak: MFU nan)")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/train_speed"))
    args = ap.parse_args(argv)
    # built eager: each variant sets its own execution (a compiled block stays compiled)
    cfg = load_config(args.config, parse_assignments(args.set + ["parallel.ep=1", "parallel.pp=1",
                                                                 f"parallel.device={args.device}",
                                                                 "execution.compile_blocks=false"]))
    cuda = args.device == "cuda"
    from k3ray.parallel.engine import StageEngine
    from k3ray.control.local_nodes import free_port

    if cuda:
        torch.cuda.set_device(0)
    peak = matmul_peak_tflops(torch.device("cuda", 0)) if cuda else float("nan")
    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "config": args.config, "set": args.set,
           "peak_tflops": peak, "gflop_per_token": flops_per_token(cfg) / 1e9}
    print(json.dumps(env), flush=True)
    t0 = time.perf_counter()
    engine = StageEngine(cfg, 0, 0, [0] * cfg.model.n_experts, 1, args.device)
    engine.init_process_groups(f"tcp://127.0.0.1:{free_port()}", "nccl" if cuda else "gloo")
    env["build_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, step = [], 0
    profiled = set(filter(None, args.profile.split(",")))
    for name in args.variants.split(","):
        try:
            r = run_variant(engine, cfg, name, step, args.steps, args.warmup, peak, name in profiled,
                            out if args.sources else None)
        except Exception as e:  # noqa: BLE001  (out of memory, a compile failure: reported, the next one runs)
            import traceback

            traceback.print_exc()
            r = {"variant": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]}
            print(f"{name}: {r['error']}", flush=True)
            for p in engine.params.values():
                p.grad = None
            torch.cuda.empty_cache()
        step += args.steps + args.warmup + 1 + args.sources
        results.append(r)
        (out / "train_speed.json").write_text(json.dumps({"env": env, "variants": results}, indent=1))
    rows = [("variant", "B x M", "median step s", "tokens/s", "MFU of 989", "of the measured peak", "first step s",
             "reserved GiB")]
    for r in results:
        if "error" in r:
            rows.append((r["variant"], r["error"], "", "", "", "", "", ""))
        else:
            rows.append((r["variant"], r["shape"], r["median_step_s"], r["tokens_per_s"], f"{r['mfu_989']:.1%}",
                         f"{r['mfu']:.1%}", r["first_step_s"], r["reserved_gb"]))
    print_table(f"{cfg.name} at ep=1, {env['gflop_per_token']:.2f} GFLOP/token, peak {peak:.0f} TFLOP/s, medians of "
                f"{args.steps} steps after {args.warmup}", rows)


if __name__ == "__main__":
    main()
