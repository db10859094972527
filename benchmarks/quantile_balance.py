"""Quantile Balancing at gpu2's scale (64 experts, top-8, 16,384 tokens per step), CPU only; prints a markdown table.

    python benchmarks/quantile_balance.py [--steps 100] [--tokens 16384]

Just the balancing loop, no model: a sigmoid router on random token vectors (d = 256) with fixed random weights plus
a drift each step (the router training), per-expert offsets of std 1 (popularity skew). Two regimes: logits of std 1
(a router at initialisation) and of std 10 (a trained router whose scores saturate: many near 1, the margins at the
top-k boundary within 1e-3 of each other, what the gpu2 run's router reached). Each step routes a fresh batch with
the current bias, then sets the bias from that batch's histogram (k3ray's order: the bias is one step stale).

Histogram ranges compared (1000 bins each): the former 1000 even bins over [-0.5, 0.5] with the edges clamped; even
bins over the batch's [min, max] margin; even bins over [min b - 1, max b + 1] (torchtitan's port); k3ray's
log-spaced bins (model/balancing.py: width 2, resolution 1e-5); and the exact quantile (a sort; the floor a histogram
can reach); and the log-spaced bins with model.quantile_step 0.3 (b moves 0.3 of the way to b_hat each step, which
averages one batch's quantile noise over ~6 steps). Columns: MaxVio per step (median and max over the last quarter of the steps; a fresh batch of 16,384
tokens has sampling noise of its own: even the exact quantile of the previous batch leaves ~0.06), and MaxVio_global:
the final bias on 8 held-out batches together (131,072 tokens), as DeepSeek measures it on a validation set.
"""
from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import torch

from k3ray.kernels import score_histogram
from k3ray.model.balancing import quantile_bias, quantile_histogram, select_experts

E, K, D = 64, 8, 256


def maxvio(load: torch.Tensor) -> float:
    load = load.double()
    return float(load.max() / load.mean() - 1)


def even_bias(margins: torch.Tensor, b: torch.Tensor, lo: float, hi: float, bins: int = 1000) -> torch.Tensor:
    """The quantile from even bins over [lo, hi] (edges clamped), linearly interpolated, as the former code did."""
    counts = score_histogram(margins, lo, hi, bins).double()
    target = counts[0].sum() * K / E
    above = torch.cat([counts.flip(1).cumsum(1).flip(1), counts.new_zeros(E, 1)], dim=1)
    i = ((above[:, :bins] >= target).sum(1) - 1).clamp(0, bins - 1)
    in_bin = counts.gather(1, i[:, None]).squeeze(1)
    frac = ((target - above.gather(1, (i + 1)[:, None]).squeeze(1)) / in_bin.clamp(min=1)).clamp(0, 1)
    b_hat = b.double() - (lo + (i.double() + 1 - frac) * (hi - lo) / bins)
    return (b_hat - b_hat.mean()).float()


def update(mode: str, scores: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if mode.startswith("log-spaced (k3ray)"):
        b_hat = quantile_bias(quantile_histogram(scores, b, K, 1000, 2.0, 1e-5), b, K, 2.0, 1e-5)
        step = 0.3 if mode.endswith("quantile_step 0.3") else 1.0
        return b + step * (b_hat - b)
    biased = scores + b
    margins = biased - torch.topk(biased, K + 1, dim=-1).values[:, K:K + 1]
    if mode == "exact quantile":
        q = torch.quantile(margins.double(), 1 - K / E, dim=0, interpolation="linear")
        b_hat = b.double() - q
        return (b_hat - b_hat.mean()).float()
    if mode == "even [-0.5, 0.5] (former)":
        return even_bias(margins, b, -0.5, 0.5)
    if mode == "even [min, max] of margins":
        return even_bias(margins, b, float(margins.min()), float(margins.max()) + 1e-6)
    if mode == "even [min b - 1, max b + 1]":
        return even_bias(margins, b, float(b.min()) - 1, float(b.max()) + 1)
    raise ValueError(mode)


def run(mode: str, logit_std: float, steps: int, tokens: int) -> tuple[list[float], float]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(E, D, generator=g) * logit_std / math.sqrt(D)
    offset = torch.randn(E, generator=g)
    b = torch.zeros(E)
    per_step = []
    for _ in range(steps):
        scores = torch.sigmoid(torch.randn(tokens, D, generator=g) @ w.T + offset)
        per_step.append(maxvio(torch.bincount(select_experts(scores, b, K)[0].reshape(-1), minlength=E)))
        b = update(mode, scores, b)
        w = w + 0.002 * logit_std / math.sqrt(D) * torch.randn(E, D, generator=g)  # the router drifts
    held_out = torch.zeros(E, dtype=torch.int64)
    for _ in range(8):
        scores = torch.sigmoid(torch.randn(tokens, D, generator=g) @ w.T + offset)
        held_out += torch.bincount(select_experts(scores, b, K)[0].reshape(-1), minlength=E)
    return per_step, maxvio(held_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"# Quantile Balancing: {E} experts, top-{K}, {args.tokens} tokens per step, {args.steps} steps "
          f"(torch {torch.__version__}, {platform.python_version()}, one thread)\n")
    print("| router logits | histogram | MaxVio per step, median (max) over the last quarter | MaxVio_global, "
          "8 held-out batches | ms per update |")
    print("|---|---|---|---|---|")
    modes = ["even [-0.5, 0.5] (former)", "even [min, max] of margins", "even [min b - 1, max b + 1]",
             "log-spaced (k3ray)", "log-spaced (k3ray), quantile_step 0.3", "exact quantile"]
    for logit_std in (1.0, 10.0):
        for mode in modes:
            t0 = time.perf_counter()
            per_step, glob = run(mode, logit_std, args.steps, args.tokens)
            ms = (time.perf_counter() - t0) / args.steps * 1e3
            tail = per_step[-(args.steps // 4):]
            print(f"| std {logit_std:g} | {mode} | {statistics.median(tail):.3f} ({max(tail):.3f}) | {glob:.3f} | "
                  f"{ms:.0f} |", flush=True)


if __name__ == "__main__":
    main()
