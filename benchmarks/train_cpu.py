"""Tiny config, single process, reference trainer on CPU: tokens/s and router balance (MaxVio) after N steps with
Quantile Balancing, the DeepSeek sign update, and no balancing.

    python benchmarks/train_cpu.py [--steps 200] [--warmup 10] [--tail 20] [--json OUT]

tokens/s: median over the steps after the first `warmup` (report.tokens / wall time of train_step).
MaxVio: per step the mean over layers of the layer's global MaxVio (StepReport.mean_maxvio); the figure is the
median over the last `tail` steps.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from k3ray.config import load_config
from k3ray.parallel.reference import ReferenceTrainer

REPO = Path(__file__).resolve().parents[1]


def run(mode: str, steps: int, warmup: int, tail: int, config: Path) -> dict:
    cfg = load_config(config, {"model.balancing": mode, "train.steps": steps})
    trainer = ReferenceTrainer(cfg)
    tok_s, maxvio, losses = [], [], []
    t_start = time.perf_counter()
    for step in range(steps):
        t0 = time.perf_counter()
        report = trainer.train_step(step, step)
        dt = time.perf_counter() - t0
        tok_s.append(report.tokens / dt)
        maxvio.append(report.mean_maxvio)
        losses.append(report.loss)
    return {
        "balancing": mode,
        "steps": steps,
        "tokens_per_step": report.tokens,
        "tokens_per_s_median": statistics.median(tok_s[warmup:]),
        "maxvio_first_step": maxvio[0],
        "maxvio_median_last": statistics.median(maxvio[-tail:]),
        "loss_first": losses[0],
        "loss_last_mean10": sum(losses[-10:]) / len(losses[-10:]),
        "seconds": time.perf_counter() - t_start,
        "maxvio_per_step": [round(v, 5) for v in maxvio],
        "loss_per_step": [round(v, 5) for v in losses],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "tiny.yaml")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--tail", type=int, default=20)
    ap.add_argument("--modes", default="quantile,sign,none")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}")
    rows = []
    for mode in args.modes.split(","):
        row = run(mode, args.steps, args.warmup, args.tail, args.config)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_per_step")}), flush=True)
    print()
    print(f"| balancing | tokens/s (median, steps {args.warmup}+) | MaxVio (median of last {args.tail} steps) "
          f"| MaxVio step 0 | train loss (last 10) | wall s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['balancing']} | {r['tokens_per_s_median']:,.0f} | {r['maxvio_median_last']:.3f} "
              f"| {r['maxvio_first_step']:.3f} | {r['loss_last_mean10']:.3f} | {r['seconds']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
