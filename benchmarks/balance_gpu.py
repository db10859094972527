"""Router balance in real training: one engine (as a worker runs it; ep=1), N steps, a markdown table per step.

    python benchmarks/balance_gpu.py --config configs/gpu2.yaml --set parallel.ep=1 [--set ...] --steps 100 \
        --label bpe [--json OUT.json]

Per step: loss, MaxVio (mean and max over the MoE layers, what training routed), and the step report's balance
diagnostics (mean over layers): the MaxVio the step's bias gives the batch (the previous step's quantile: the
released rule's lag) and each micro-batch's own bias (the same-batch best case), and the share of scores saturated at
exactly 1.0. Held-out: `--heldout-batches` validation batches together (no gradient), before training and every
`--heldout-every` steps, under the step's bias (serving's) and under each batch's own bias (evaluation's with
model.quantile_eval_bias_from: batch). Summary: median and max of MaxVio
over steps 10 on. Runs on CPU too (tiny configs).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3ray.config import load_config, parse_assignments  # noqa: E402
from k3ray.control.local_nodes import free_port  # noqa: E402
from k3ray.parallel.engine import StageEngine  # noqa: E402
from k3ray.policies.moonep import default_home, maxvio  # noqa: E402


@torch.no_grad()
def heldout_maxvio(engine: StageEngine, batches: int) -> dict[str, dict[int, float]]:
    """Per MoE layer: MaxVio of the validation batches 0..batches-1 routed together (no gradient), once with the
    step's bias in every layer (what serving routes with) and once with each batch's own bias in every layer (what
    evaluation routes with under model.quantile_eval_bias_from: batch); each forward routes so from the first layer
    on, since a layer's inputs depend on how the layers before it routed."""
    stage = engine.stage
    moes = stage.moe_layers()
    configured = {layer: moe.cfg for layer, moe in moes.items()}
    stage.reset_stats()  # the step's routes are still counted there: the held-out load starts from zero
    out = {}
    for name, mode in (("step", "step"), ("own", "batch")):
        load: dict[int, torch.Tensor] = {}
        for layer, moe in moes.items():
            moe.cfg = configured[layer].model_copy(update={"quantile_eval_bias_from": mode})
        for i in range(batches):
            tokens = engine.batches.validation(i)
            stage(tokens[:, :-1], documents=engine.batches.documents(tokens))
            for layer, moe in moes.items():
                load[layer] = load.get(layer, 0) + moe.stats.tokens_per_expert.cpu()
            stage.reset_stats()
            for moe in moes.values():
                moe.experts.reset()
        out[name] = {layer: maxvio([v.tolist()]) for layer, v in load.items()}
    for layer, moe in moes.items():
        moe.cfg = configured[layer]
    return out


def _mean(d: dict) -> float:
    return statistics.fmean(d.values()) if d else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/gpu2.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--from-step", type=int, default=10, help="the summary's steps start here")
    ap.add_argument("--heldout-every", type=int, default=50)
    ap.add_argument("--heldout-batches", type=int, default=8)
    ap.add_argument("--label", default="run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = load_config(args.config, {"train.steps": args.steps, **parse_assignments(args.set)})
    if cfg.parallel.ep != 1 or cfg.parallel.pp != 1:
        raise SystemExit(f"--set parallel.ep=1 parallel.pp=1: one engine in one process (got pp={cfg.parallel.pp}, "
                         f"ep={cfg.parallel.ep})")
    cuda = cfg.parallel.device == "cuda"
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    engine = StageEngine(cfg, 0, 0, default_home(cfg.model.n_experts, 1).tolist(), 1, "cuda" if cuda else "cpu")
    engine.init_process_groups(f"tcp://127.0.0.1:{free_port()}", "nccl" if cuda else "gloo")
    m = cfg.model
    print(f"# {args.label}: {cfg.name}, {m.n_layers} layers, {m.n_experts} experts top-{m.top_k}, "
          f"{cfg.step_tokens():,} tokens per step, data {cfg.data.source} ({cfg.data.tokenizer}), balancing "
          f"{m.balancing} from {m.quantile_bias_from}, quantile_step {m.quantile_step}, lr {cfg.optimizer.lr}; "
          f"built in {time.perf_counter() - t0:.0f} s\n", flush=True)
    heldout = {0: heldout_maxvio(engine, args.heldout_batches)}
    print(f"held-out MaxVio before training: mean {_mean(heldout[0]['step']):.3f}\n")
    print("| step | loss | MaxVio mean | MaxVio max | step's bias (lag) | micro-batch bias (same batch) | saturated "
          "| s |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    for step in range(args.steps):
        t = time.perf_counter()
        report = engine.train_step(step, step)
        if cuda:
            torch.cuda.synchronize()
        vio = {layer: maxvio(r) for layer, r in report["tokens_per_expert"].items()}
        bal = report.get("balance", {})
        row = {"step": step, "loss": report["loss"], "maxvio_mean": _mean(vio), "maxvio_max": max(vio.values()),
               "maxvio": vio, "step_bias": _mean({k: v["maxvio_step_bias"] for k, v in bal.items()}),
               "micro_batch_bias": _mean({k: v["maxvio_micro_batch_bias"] for k, v in bal.items()}),
               "saturated": _mean({k: v["saturated"] for k, v in bal.items()}), "seconds": time.perf_counter() - t}
        rows.append(row)
        diag = (f"{row['step_bias']:.3f} | {row['micro_batch_bias']:.3f} | {row['saturated']:.2%}" if bal
                else "- | - | -")  # balancing off: no bias, no diagnostics
        print(f"| {step} | {row['loss']:.3f} | {row['maxvio_mean']:.3f} | {row['maxvio_max']:.3f} | {diag} | "
              f"{row['seconds']:.2f} |", flush=True)
        if (step + 1) % args.heldout_every == 0 or step + 1 == args.steps:
            heldout[step + 1] = heldout_maxvio(engine, args.heldout_batches)
            print(f"held-out after step {step}: the step's bias {_mean(heldout[step + 1]['step']):.3f}, each batch's "
                  f"own {_mean(heldout[step + 1]['own']):.3f}", flush=True)
    start = args.from_step if args.steps > args.from_step else 0
    tail = rows[start:]
    per_layer = {layer: statistics.median(r["maxvio"][layer] for r in tail) for layer in tail[0]["maxvio"]}
    summary = {
        "label": args.label, "steps": args.steps,
        "maxvio_median": statistics.median(r["maxvio_mean"] for r in tail),
        "maxvio_max": max(r["maxvio_mean"] for r in tail),
        "maxvio_max_layer": max(r["maxvio_max"] for r in tail),
        "step_bias_median": statistics.median(r["step_bias"] for r in tail),
        "micro_batch_bias_median": statistics.median(r["micro_batch_bias"] for r in tail),
        "maxvio_median_per_layer": per_layer,
        "heldout_mean": {s: _mean(v["step"]) for s, v in heldout.items()},
        "heldout_own_bias_mean": {s: _mean(v["own"]) for s, v in heldout.items()},
        "loss_last10": statistics.fmean(r["loss"] for r in rows[-10:]),
        "loss_median_last10": statistics.median(r["loss"] for r in rows[-10:]),
        "step_seconds_median": statistics.median(r["seconds"] for r in rows),
    }
    print(f"\n{args.label}: MaxVio (mean over layers) over steps {start}-{args.steps - 1}: median "
          f"{summary['maxvio_median']:.3f}, max {summary['maxvio_max']:.3f} "
          f"(worst layer {summary['maxvio_max_layer']:.3f}); "
          f"the step's bias would give {summary['step_bias_median']:.3f}, each micro-batch's own "
          f"{summary['micro_batch_bias_median']:.3f}; per layer "
          + ", ".join(f"{k}: {v:.3f}" for k, v in per_layer.items()))
    print(f"{args.label}: held-out MaxVio (mean over layers) by step, the step's bias / each batch's own: "
          + ", ".join(f"{s}: {v:.3f} / {summary['heldout_own_bias_mean'][s]:.3f}"
                      for s, v in summary["heldout_mean"].items())
          + f"; loss (last 10 steps) mean {summary['loss_last10']:.3f}, median {summary['loss_median_last10']:.3f}",
          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
