"""Loss curves of runs of the same job side by side (benchmarks/e2e_gpu.py's plain.json each): per run its loss at a
few steps and over windows of steps, and against the first run (the reference) the largest and the mean difference
per window, so a change to the step (a kernel, a dtype) is judged against the curve, not one step.

    python benchmarks/loss_curves.py runs/curve_B/plain.json runs/curve_C/plain.json [--labels B,C] [--window 10]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def windows(losses: list[float], width: int) -> list[float]:
    """Mean loss of each window of `width` steps (the last one may be shorter)."""
    return [statistics.fmean(losses[i:i + width]) for i in range(0, len(losses), width)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="plain.json of each run; the first is the reference")
    ap.add_argument("--labels", help="comma-separated names of the runs (default: their folders)")
    ap.add_argument("--window", type=int, default=10)
    args = ap.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [Path(r).parent.name for r in args.runs]
    curves = [json.loads(Path(r).read_text())["losses"] for r in args.runs]
    ref = curves[0]
    n = min(len(c) for c in curves)
    w = args.window
    print(f"| run | steps | loss at 1 / 10 / {n} | mean of steps {max(0, n - w) + 1}-{n} | window means "
          f"({w} steps) | vs {labels[0]}: max abs diff of a step | mean diff of the window means |")
    print("|---|---|---|---|---|---|---|")
    for label, curve in zip(labels, curves):
        means = windows(curve[:n], w)
        diffs = [a - b for a, b in zip(means, windows(ref[:n], w))]
        print(f"| {label} | {len(curve)} | {curve[0]:.4f} / {curve[min(9, n - 1)]:.4f} / {curve[n - 1]:.4f} "
              f"| {statistics.fmean(curve[max(0, n - w):n]):.4f} | {' '.join(f'{m:.3f}' for m in means)} "
              f"| {max(abs(a - b) for a, b in zip(curve[:n], ref[:n])):.4f} "
              f"| {statistics.fmean(diffs):+.4f} |")


if __name__ == "__main__":
    main()
