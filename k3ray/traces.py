"""Routing traces for the placement simulator (k3ray.sim): tokens_per_expert per step, synthetic or recorded.

A trace gives tokens_per_expert [L, R, E] per step (notation in k3ray/policies/__init__.py):
  uniform        every expert equally popular
  zipf:A         popularity of the i-th most popular expert ~ 1/i^A; which experts are hot is a fixed random
                 permutation per layer
  dirichlet:A    popularity ~ Dirichlet(A, ..., A), one draw per layer, fixed over steps
  hot-shift[:N]  a hot set of E/32 experts takes 40% of the routing mass; the set moves every N steps (default 4)
  PATH.pt|.json  a recorded trace: a dict {"tokens_per_expert": [steps, L, R, E] or [steps, L, E]} (ints; torch
                 tensor in .pt, nested lists in .json). [steps, L, E] global counts are split evenly over the R ranks.
                 `save_trace` writes one.
Sampling (popularity p over E, s tokens per rank, K distinct experts per token): expert e is in a token's top-K with
probability pi_e = min(1, c*p_e), c chosen so sum(pi) = K (the usual approximation of sampling without replacement);
rank r's count of expert e is Binomial(s, pi_e) (so never above s), then each rank's total is corrected to exactly s*K
by adding/removing single slots at random (weights pi, resp. counts). Per-token expert sets are not materialised.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch


def inclusion_probs(pop_le: torch.Tensor, top_k: int) -> torch.Tensor:
    """[L, E] pi = min(1, c*p) with sum(pi) = K per row (water-filling over the capped experts)."""
    pop = pop_le.double() / pop_le.double().sum(1, keepdim=True)
    capped = torch.zeros_like(pop, dtype=torch.bool)
    for _ in range(top_k + 1):
        free_mass = torch.where(capped, 0.0, pop).sum(1, keepdim=True)
        scale = (top_k - capped.sum(1, keepdim=True)) / free_mass.clamp(min=1e-300)
        pi = torch.where(capped, 1.0, pop * scale)
        new_capped = pi >= 1.0
        if torch.equal(new_capped, capped):
            break
        capped = new_capped
    return pi.clamp(max=1.0)


def sample_counts(pi_e: torch.Tensor, num_ranks: int, tokens_per_rank: int, top_k: int,
                  gen: torch.Generator) -> torch.Tensor:
    """tokens_per_expert [R, E] for one layer (see module doc); every row sums to s*K, entries in [0, s]."""
    s = tokens_per_rank
    probs = pi_e.float().expand(num_ranks, -1).contiguous()
    counts = torch.binomial(torch.full_like(probs, float(s)), probs, generator=gen).to(torch.int64)
    for _ in range(64):
        short = s * top_k - counts.sum(1)
        if not short.any():
            return counts
        adding = short > 0
        weight = torch.where(adding[:, None], probs * (counts < s), counts.float()).clamp(min=0)
        weight[weight.sum(1) == 0] = 1.0
        draws = int(short.abs().max())
        pick = torch.multinomial(weight, draws, replacement=True, generator=gen)
        live = (torch.arange(draws)[None, :] < short.abs()[:, None]).to(torch.int64)
        counts.scatter_add_(1, pick, live * torch.where(adding, 1, -1)[:, None])
        counts.clamp_(0, s)
    raise RuntimeError("sample_counts: could not reach s*K slots per rank (is K*s > E*s?)")


class Trace:
    """counts(step) -> tokens_per_expert [L, R, E] int64 for L layers."""

    def __init__(self, spec: str, num_layers: int, num_ranks: int, num_experts: int, top_k: int,
                 tokens_per_rank: int, seed: int = 0):
        self.spec, self.num_layers, self.num_ranks, self.num_experts = spec, num_layers, num_ranks, num_experts
        self.top_k, self.tokens_per_rank, self.seed = top_k, tokens_per_rank, seed
        self.recorded: torch.Tensor | None = None
        kind, _, arg = spec.partition(":")
        self.kind = kind
        if kind in ("uniform", "zipf", "dirichlet", "hot-shift"):
            try:
                self.arg = float(arg) if arg else {"zipf": 1.2, "dirichlet": 1.0, "hot-shift": 4.0}.get(kind, 0.0)
            except ValueError:
                raise ValueError(f"trace {spec!r}: {arg!r} is not a number") from None
            self._static = None if kind == "hot-shift" else inclusion_probs(self._popularity(0), top_k)
        elif Path(spec).suffix in (".pt", ".json"):
            self.kind = "file"
            self.recorded = load_trace(spec)
            if self.recorded.dim() == 4:
                self.num_ranks = self.recorded.shape[2]
            self.num_layers = min(num_layers, self.recorded.shape[1])
            if self.recorded.shape[-1] != num_experts:
                raise ValueError(f"{spec}: trace has {self.recorded.shape[-1]} experts, the model {num_experts}")
        else:
            raise ValueError(f"unknown trace {spec!r}: use uniform, zipf:A, dirichlet:A, hot-shift[:N] "
                             f"or a .pt/.json file")

    def _popularity(self, step: int) -> torch.Tensor:
        num_layers, num_experts = self.num_layers, self.num_experts
        gen = torch.Generator().manual_seed(self.seed * 7919 + 17)
        if self.kind == "uniform":
            return torch.ones(num_layers, num_experts, dtype=torch.float64)
        if self.kind == "zipf":
            base = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** self.arg
            return torch.stack([base[torch.randperm(num_experts, generator=gen)] for _ in range(num_layers)])
        if self.kind == "dirichlet":
            conc = torch.full((num_layers, num_experts), self.arg, dtype=torch.float64)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed * 7919 + 23)
                return torch.distributions.Dirichlet(conc).sample().clamp(min=1e-12)
        period = max(int(self.arg), 1)                                                     # hot-shift
        gen.manual_seed(self.seed * 7919 + 31 + step // period)
        num_hot = max(num_experts // 32, 1)
        pop = torch.full((num_layers, num_experts), 0.6 / (num_experts - num_hot), dtype=torch.float64)
        for layer in range(num_layers):
            pop[layer, torch.randperm(num_experts, generator=gen)[:num_hot]] = 0.4 / num_hot
        return pop

    def counts(self, step: int, gen: torch.Generator, layer: int | None = None) -> torch.Tensor:
        """[L, R, E] for `step` ([R, E] for one `layer`)."""
        layers = range(self.num_layers) if layer is None else [layer]
        if self.recorded is not None:
            rec = self.recorded[step % self.recorded.shape[0]]
            out = torch.stack([self._split(rec[l]) for l in layers])
        else:
            pi = self._static if self._static is not None else inclusion_probs(self._popularity(step), self.top_k)
            out = torch.stack([sample_counts(pi[l], self.num_ranks, self.tokens_per_rank, self.top_k, gen)
                               for l in layers])
        return out if layer is None else out[0]

    def _split(self, counts: torch.Tensor) -> torch.Tensor:
        if counts.dim() == 2:
            return counts.to(torch.int64)
        r = torch.arange(self.num_ranks)[:, None]
        return counts[None] // self.num_ranks + (r < counts[None] % self.num_ranks)


def save_trace(path: str | Path, tokens_per_expert: torch.Tensor) -> None:
    """Write a trace file ([steps, L, R, E] or [steps, L, E] ints) as .pt or .json."""
    path = Path(path)
    data = {"tokens_per_expert": tokens_per_expert.to(torch.int64)}
    if path.suffix == ".json":
        path.write_text(json.dumps({"tokens_per_expert": data["tokens_per_expert"].tolist()}))
    else:
        torch.save(data, path)


def load_trace(path: str | Path) -> torch.Tensor:
    path = Path(path)
    try:
        data = (json.loads(path.read_text()) if path.suffix == ".json"
                else torch.load(path, map_location="cpu", weights_only=True))
    except (OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"{path}: cannot read trace ({err})") from None
    if not isinstance(data, dict) or "tokens_per_expert" not in data:
        raise ValueError(f"{path}: a trace is a dict with key 'tokens_per_expert' ([steps, L, R, E] or [steps, L, E])")
    counts = torch.as_tensor(data["tokens_per_expert"], dtype=torch.int64)
    if counts.dim() not in (3, 4):
        raise ValueError(f"{path}: tokens_per_expert has shape {tuple(counts.shape)}; "
                         f"expected [steps, L, R, E] or [steps, L, E]")
    return counts
