"""Quantile Balancing replayed on real router inputs and updates; prints markdown tables.

    python benchmarks/balance_dump.py ... --out DUMP.pt     # a real training run's router logits (CPU or GPU)
    python benchmarks/quantile_balance.py DUMP.pt [--from-step 10]

The dump holds, per step and MoE layer, the logits z = x W_r^T of every micro-batch under the weights the step ran
with, the same inputs' logits under the weights after the optimizer step, and the bias the run routed with. Each
policy below keeps its own bias and routes every step's real scores s = sigmoid(z) with it (the training trajectory is
the run's; a policy changes only who would have been picked):

- run's policy: b <- b + quantile_step (b_hat(step t) - b), the step size the run had (reproduces its MaxVio exactly)
- lagged, step 1: b_{t+1} = b_hat from step t's scores (Quantile Balancing as released: one step stale)
- after the update: b_{t+1} = b_hat from step t's inputs under the updated router weights
- per micro-batch: each micro-batch routed with the bias from its own scores, three quantile passes from the lagged
  step-1 bias (model.quantile_bias_from: micro_batch, as LatentMoE does it)
- same batch: the global batch routed with the bias from its own scores (the best any bias can do)

Diagnostics per layer (from the same-batch bias b*): drift/spread = the median over experts of |b*_t - b*_{t-1}| over
the width of the margin band that holds the middle half of an expert's target load (above 1 the previous step's bias
misroutes about half of it); saturated = the share of scores exactly 1.0 (fp32 sigmoid above logit ~17); ties = the
share of tokens whose k-th and (k+1)-th biased scores are equal (no bias separates them).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from k3ray.model.balancing import quantile_bias, quantile_histogram, select_experts


class Balancer:
    """The histogram quantile of k3ray.model.balancing with one model config's parameters."""

    def __init__(self, model: dict):
        self.k, self.e = model["top_k"], model["n_experts"]
        self.bins, self.window = model["quantile_bins"], model["quantile_window"]
        self.res = model["quantile_resolution"]

    def b_hat(self, scores_TE: torch.Tensor, bias_E: torch.Tensor, passes: int = 1) -> torch.Tensor:
        for _ in range(passes):
            hist = quantile_histogram(scores_TE, bias_E, self.k, self.bins, self.window, self.res)
            bias_E = quantile_bias(hist, bias_E, self.k, self.window, self.res)
        return bias_E

    def load(self, scores_TE: torch.Tensor, bias_E: torch.Tensor) -> torch.Tensor:
        return torch.bincount(select_experts(scores_TE, bias_E, self.k)[0].reshape(-1), minlength=self.e)


def maxvio(load_E: torch.Tensor) -> float:
    load = load_E.double()
    return float(load.max() / load.mean() - 1)


def margin_spread(scores_TE: torch.Tensor, bias_E: torch.Tensor, k: int) -> torch.Tensor:
    """Per expert [E]: width of the margin band holding the middle half of the target load k/E around the boundary."""
    biased = scores_TE.double() + bias_E.double()
    margins = biased - torch.topk(biased, k + 1, dim=-1).values[:, k:k + 1]
    share = k / scores_TE.shape[1]
    q = torch.quantile(margins, torch.tensor([1 - 1.5 * share, 1 - 0.5 * share], dtype=torch.float64), dim=0)
    return q[1] - q[0]


def tie_share(scores_TE: torch.Tensor, bias_E: torch.Tensor, k: int) -> float:
    top = torch.topk(scores_TE + bias_E, k + 1, dim=-1).values
    return float((top[:, k - 1] == top[:, k]).double().mean())


POLICIES = ("run's policy", "lagged, step 1", "after the update", "per micro-batch", "same batch")


def replay_layer(bal: Balancer, records: list[dict], step_size: float) -> dict[str, list[float]]:
    """MaxVio per step of every policy, and the diagnostics per step, for one layer's records."""
    out = {name: [] for name in POLICIES + ("drift/spread", "saturated", "ties")}
    b_run = records[0]["bias"].clone()
    b_lag = b_after = b_prev_star = None
    for rec in records:
        micro = torch.sigmoid(rec["logits"].float())  # [M, T, E]
        scores = micro.reshape(-1, micro.shape[-1])
        zero = torch.zeros(bal.e)
        b_star = bal.b_hat(scores, b_prev_star if b_prev_star is not None else zero, passes=2)
        out["run's policy"].append(maxvio(bal.load(scores, b_run)))
        out["lagged, step 1"].append(maxvio(bal.load(scores, b_lag if b_lag is not None else zero)))
        out["after the update"].append(maxvio(bal.load(scores, b_after if b_after is not None else zero)))
        start = b_lag if b_lag is not None else zero
        out["per micro-batch"].append(maxvio(sum(bal.load(m, bal.b_hat(m, start, passes=3)) for m in micro)))
        out["same batch"].append(maxvio(bal.load(scores, b_star)))
        spread = margin_spread(scores, b_star, bal.k)
        drift = (b_star - b_prev_star).abs() if b_prev_star is not None else torch.full_like(b_star, float("nan"))
        out["drift/spread"].append(float((drift.double() / spread.clamp(min=1e-12)).median()))
        out["saturated"].append(float((scores == 1.0).double().mean()))
        out["ties"].append(tie_share(scores, b_star, bal.k))
        b_hat = bal.b_hat(scores, b_run)
        b_run = b_run + step_size * (b_hat - b_run)
        b_lag = bal.b_hat(scores, b_lag if b_lag is not None else zero)
        after = torch.sigmoid(rec["logits_after"].float()).reshape(-1, bal.e)
        b_after = bal.b_hat(after, b_after if b_after is not None else zero)
        b_prev_star = b_star
    return out


def _stat(values: list[float]) -> str:
    vals = [v for v in values if v == v]
    return f"{statistics.median(vals):.3f} ({max(vals):.3f})" if vals else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump")
    ap.add_argument("--layers", default="", help="comma-separated layers (default: all in the dump)")
    ap.add_argument("--from-step", type=int, default=10, help="figures over steps from here on")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dump = torch.load(args.dump, weights_only=False)
    model = dump["config"]["model"]
    bal = Balancer(model)
    steps = dump["steps"]
    if args.layers:
        dump["layers"] = [int(i) for i in args.layers.split(",")]
    first = steps[0]["layers"][dump["layers"][0]]["logits"]
    print(f"# {args.dump}: {model['n_experts']} experts top-{model['top_k']}, {len(steps)} steps of "
          f"{first.shape[0]} x {first.shape[1]} tokens, quantile_step {model['quantile_step']}, most frequent token "
          f"{dump['top_token_share']:.1%} of the data; median (max) over steps {args.from_step}-{len(steps) - 1}\n")
    print("| layer | run's MaxVio (logged) | " + " | ".join(POLICIES) + " | drift/spread | saturated | ties |")
    print("|---" * (len(POLICIES) + 5) + "|")
    means = {name: [0.0] * len(steps) for name in POLICIES}
    for layer in dump["layers"]:
        records = [s["layers"][layer] for s in steps]
        out = replay_layer(bal, records, model["quantile_step"])
        logged = [s["maxvio"][layer] for s in steps]
        tail = slice(args.from_step, None)
        cells = [_stat(logged[tail])] + [_stat(out[name][tail]) for name in POLICIES]
        cells += [_stat(out["drift/spread"][tail]), f"{statistics.median(out['saturated'][tail]):.2%}",
                  f"{statistics.median(out['ties'][tail]):.2%}"]
        print(f"| {layer} | " + " | ".join(cells) + " |", flush=True)
        for name in POLICIES:
            means[name] = [a + b / len(dump["layers"]) for a, b in zip(means[name], out[name])]
    print("\nMean over layers per step:\n")
    print("| step | " + " | ".join(POLICIES) + " |")
    print("|---" * (len(POLICIES) + 1) + "|")
    for t in range(len(steps)):
        if t < 10 or t % 10 == 0 or t == len(steps) - 1:
            print(f"| {t} | " + " | ".join(f"{means[name][t]:.3f}" for name in POLICIES) + " |")


if __name__ == "__main__":
    main()
