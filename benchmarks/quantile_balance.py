"""Quantile Balancing replayed on real router inputs and updates; prints markdown tables.

    python benchmarks/balance_dump.py ... --out DUMP.pt     # a real training run's router logits (CPU or GPU)
    python benchmarks/quantile_balance.py DUMP.pt [--from-step 10]
    python benchmarks/quantile_balance.py DUMP.pt --heldout     # which step's bias routes unseen batches best

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

With --heldout heldout (a dump with held-out logits: the validation batches under the model after each step) or
--heldout next (the next step's training batch: a random sample like the step's own) the table is about evaluation and
serving, which route batches no bias was computed from with the bias the step leaves. The
candidates for that bias, each from what step t had, scored on the held-out batches under the model after step t:

- step's bias: b_{t+1} = b_t + quantile_step (b_hat - b_t), one quantile pass of step t's global histogram under the
  weights it ran with (as released; with micro-batch biases this chain still sets the step's bias)
- converged: three passes over the same scores (a pass moves alpha, so one pass from a stale bias is only close)
- after the update: three passes over step t's inputs scored by the router after the optimizer step
- last micro-batch: the last micro-batch's own bias (three passes over its scores from the step's bias)
- last n steps, new router: three passes over the inputs of steps t-n+1..t scored by the router after step t
- EMA a: b <- a b + (1 - a) b_after over steps (an average of recent steps' biases; evaluation only)
- micro mean: the mean of the micro-batches' own biases (three passes each from the step's bias)
- step s: the step's bias chain with quantile_step s (one pass; "after the update": three passes over the updated
  router's scores; "micro mean": towards the micro mean), an EMA whose every update starts from the average itself
- own bias: the held-out batches' own bias (in-sample; what no bias from other tokens can beat)
- half B: the held-out set split in two; "fresh" routes half B with the converged bias of half A (same router, a
  different sample: the sampling noise alone), "step's" routes half B with the step's bias
"""
from __future__ import annotations

import argparse
import statistics

import torch

from k3ray.config import OptimizerConfig
from k3ray.model.balancing import quantile_bias, quantile_histogram, select_experts
from k3ray.optim import lr_at


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


HELDOUT = ("step's bias", "converged", "after the update", "last micro-batch", "last 4 steps, new router",
           "EMA 0.5", "EMA 0.8", "step 0.5", "step 0.2", "step 0.2, after the update", "micro mean",
           "step 0.2, micro mean", "own bias", "half B: fresh",
           "half B: step's", "train: micro from step's bias", "train: micro from step 0.2")
CHAINS = {"step 0.5": (0.5, False), "step 0.2": (0.2, False), "step 0.2, after the update": (0.2, True),
          "step 0.2, micro mean": (0.2, None)}


def unseen_scores(records: list[dict], t: int, unseen: str) -> torch.Tensor | None:
    """The scores [H, E] of the batch that step t's bias is judged on: the held-out batches under the model after
    step t, or the next step's training batch (a random sample like step t's, routed under the same weights)."""
    if unseen == "heldout":
        return torch.sigmoid(records[t]["heldout_logits"].float())
    if t + 1 < len(records):
        logits = records[t + 1]["logits"].float()
        return torch.sigmoid(logits.reshape(-1, logits.shape[-1]))
    return None


def replay_heldout(bal: Balancer, records: list[dict], step_size: float, unseen: str = "heldout"
                   ) -> dict[str, list[float]]:
    """Held-out MaxVio per step of every candidate in HELDOUT (module docstring), for one layer's records; the two
    "train:" columns are the training batch's MaxVio with micro-batch biases started from that step's bias."""
    out = {name: [] for name in HELDOUT}
    b_step = records[0]["bias"].clone().float()
    chains = {name: b_step.clone() for name in CHAINS}
    ema: dict[float, torch.Tensor] = {}
    for t, rec in enumerate(records):
        micro = torch.sigmoid(rec["logits"].float())  # [M, T, E]
        scores = micro.reshape(-1, bal.e)
        held = unseen_scores(records, t, unseen)  # [H, E]
        if held is None:
            break
        micro_biases = [bal.b_hat(m, b_step, passes=3) for m in micro]
        out["train: micro from step's bias"].append(maxvio(sum(bal.load(m, b) for m, b in zip(micro, micro_biases))))
        micro_mean = torch.stack(micro_biases).mean(0)
        out["train: micro from step 0.2"].append(
            maxvio(sum(bal.load(m, bal.b_hat(m, chains["step 0.2"], passes=3)) for m in micro)))
        start = b_step
        b_step = b_step + step_size * (bal.b_hat(scores, start) - b_step)
        w_after = rec["weight_after"]
        after = torch.sigmoid(rec["inputs"].float().reshape(-1, w_after.shape[1]) @ w_after.t())
        b_after = bal.b_hat(after, start, passes=3)
        cands = {"step's bias": b_step, "converged": bal.b_hat(scores, start, passes=3), "after the update": b_after,
                 "last micro-batch": bal.b_hat(micro[-1], start, passes=3)}
        xs = torch.cat([r["inputs"].float().reshape(-1, w_after.shape[1]) for r in records[max(0, t - 3):t + 1]])
        cands["last 4 steps, new router"] = bal.b_hat(torch.sigmoid(xs @ w_after.t()), start, passes=3)
        for a in (0.5, 0.8):
            ema[a] = b_after if t == 0 else a * ema[a] + (1 - a) * b_after
            cands[f"EMA {a}"] = ema[a]
        for name, (size, use_after) in CHAINS.items():
            b = chains[name]
            if use_after is None:  # the mean of the micro-batches' own biases (each from the step's bias)
                target = micro_mean
            else:
                target = bal.b_hat(after if use_after else scores, b, passes=3 if use_after else 1)
            chains[name] = b + size * (target - b)
            cands[name] = chains[name]
        cands["micro mean"] = micro_mean
        cands["own bias"] = bal.b_hat(held, start, passes=3)
        for name, bias in cands.items():
            out[name].append(maxvio(bal.load(held, bias)))
        half_a, half_b = held[:held.shape[0] // 2], held[held.shape[0] // 2:]
        out["half B: fresh"].append(maxvio(bal.load(half_b, bal.b_hat(half_a, start, passes=3))))
        out["half B: step's"].append(maxvio(bal.load(half_b, b_step)))
    return out


def print_heldout(dump: dict, bal: Balancer, from_step: int, unseen: str) -> None:
    """Per layer median (max) over steps from_step on, then the mean over layers at some steps with the lr."""

    steps = dump["steps"]
    held = unseen_scores([s["layers"][dump["layers"][0]] for s in steps[:2]], 0, unseen)
    print(f"Unseen batch: {unseen} ({held.shape[0]} tokens), routed after each step; median (max) over steps "
          f"{from_step}-{len(steps) - 1}\n")
    print("| layer | " + " | ".join(HELDOUT) + " |")
    print("|---" * (len(HELDOUT) + 1) + "|")
    means = {name: [0.0] * len(steps) for name in HELDOUT}
    for layer in dump["layers"]:
        out = replay_heldout(bal, [s["layers"][layer] for s in steps], dump["config"]["model"]["quantile_step"],
                             unseen)
        print(f"| {layer} | " + " | ".join(_stat(out[name][from_step:]) for name in HELDOUT) + " |", flush=True)
        for name in HELDOUT:
            means[name] = [a + b / len(dump["layers"]) for a, b in zip(means[name], out[name])]
    print("| mean | " + " | ".join(_stat(means[name][from_step:]) for name in HELDOUT) + " |")
    cfg = dump["config"]
    print("\nMean over layers, held-out after step t (lr: step t's):\n")
    print("| step | lr | " + " | ".join(HELDOUT) + " |")
    print("|---" * (len(HELDOUT) + 2) + "|")
    for t in range(len(means[HELDOUT[0]])):
        if t < 3 or t % 10 == 9 or t == len(means[HELDOUT[0]]) - 1:
            lr = lr_at(OptimizerConfig(**cfg["optimizer"]), t, cfg["train"]["steps"])
            print(f"| {t} | {lr:.2e} | " + " | ".join(f"{means[name][t]:.3f}" for name in HELDOUT) + " |")


def _stat(values: list[float]) -> str:
    vals = [v for v in values if v == v]
    return f"{statistics.median(vals):.3f} ({max(vals):.3f})" if vals else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump")
    ap.add_argument("--layers", default="", help="comma-separated layers (default: all in the dump)")
    ap.add_argument("--from-step", type=int, default=10, help="figures over steps from here on")
    ap.add_argument("--heldout", choices=["heldout", "next"], default=None,
                    help="the table of unseen batches instead (module docstring): the held-out batches, or the next "
                         "step's training batch")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dump = torch.load(args.dump, weights_only=False)
    model = dump["config"]["model"]
    bal = Balancer(model)
    steps = dump["steps"]
    if args.layers:
        dump["layers"] = [int(i) for i in args.layers.split(",")]
    first = steps[0]["layers"][dump["layers"][0]]["logits"]
    if args.heldout:
        print_heldout(dump, bal, args.from_step, args.heldout)
        return
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
