"""K3-scale placement simulator: routing traces in, per-policy balance and copy traffic out; no weights, no Ray.

Traces give tokens_per_expert [L, R, E] per step (notation in k3ray/policies/__init__.py):
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

A step here is one micro-batch: s tokens per rank through the L layers.

Policies compared per layer and step:
  none            every expert on its home rank (contiguous blocks)
  replicas        persistent replicas (policies.replication) from the decayed load history of the previous steps
                  (step 0 uses its own load); ceil(E/R) + spare slots per rank; each copy takes load/copies
  moonep          per-step MoonEP plan (policies.moonep), exact balance
  moonep-priced   the MoonEP plan its cost model prices cheapest (policies.moonep.cost_model)
  replicas+moonep MoonEP over the physical experts of the persistent placement (and -priced, as above)
Weight-copy bytes per step and rank = non-resident experts computed x 3 * d_latent * I * dtype bytes, over all layers.
Modelled time per step (k3ray.policies.expert_cost, training: copies go out and gradients come home): per layer, the
busiest rank's rows plus the weight traffic of MoonEP's copies; persistent copies other than an expert's first exchange
gradient and weights with it once per optimizer step, counted as 1/micro_batches of that traffic per step.
"""
from __future__ import annotations

import contextlib
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from k3ray.policies import moonep, replication
from k3ray.policies.expert_cost import ExpertCost

POLICIES = ("none", "replicas", "moonep", "moonep-priced", "replicas+moonep", "replicas+moonep-priced")


# ------------------------------------------------------------------------------------------------------- traces


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


# ---------------------------------------------------------------------------------------------------- simulation


@dataclass
class PolicyStats:
    """Aggregates over (step, layer). imbalance = max/mean rank load; balancedness = mean/max."""

    imbalance_mean: float = 0.0
    imbalance_worst: float = 0.0
    balancedness_mean: float = 0.0
    replicas_per_rank_mean: float = 0.0     # non-resident experts a rank computes, per layer
    replicas_per_rank_max: float = 0.0
    copy_bytes_per_step_per_rank: float = 0.0   # weight bytes a rank receives per step, all layers (mean rank)
    plan_ms_median: float = 0.0             # per layer (rebalance: per step, all layers)
    modelled_ms_per_step: float = 0.0       # expert work of all layers, modelled (mean over steps)
    weights_ms_per_step: float = 0.0        # of which weight traffic
    _samples: dict = field(default_factory=dict, repr=False)

    def add(self, loads: torch.Tensor, replicas_per_rank: torch.Tensor, plan_s: float, cost: ExpertCost,
            copy_src: torch.Tensor, copy_dst: torch.Tensor, shared_copies_s: float = 0.0) -> None:
        """One layer of one step: rank loads [R], replicas per rank [R], planning seconds, and the weight copies the
        placement moves this step ([n] home and computing ranks), plus persistent copies' share of traffic."""
        loads = loads.double()
        s = self._samples
        s.setdefault("imb", []).append(float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0)
        s.setdefault("rep_mean", []).append(float(replicas_per_rank.double().mean()))
        s.setdefault("rep_max", []).append(float(replicas_per_rank.max()))
        s.setdefault("ms", []).append(plan_s * 1e3)
        weights_s = cost.transfer_s(copy_src, copy_dst, loads.numel()) + shared_copies_s
        s.setdefault("layer_s", []).append(cost.row_s * float(loads.max()) + weights_s)
        s.setdefault("weights_s", []).append(weights_s)

    def finish(self, steps: int) -> None:
        s = self._samples
        self.imbalance_mean = statistics.fmean(s["imb"])
        self.imbalance_worst = max(s["imb"])
        self.balancedness_mean = statistics.fmean(1 / x for x in s["imb"])
        self.replicas_per_rank_mean = statistics.fmean(s["rep_mean"])
        self.replicas_per_rank_max = max(s["rep_max"])
        self.plan_ms_median = statistics.median(s["ms"])
        self.modelled_ms_per_step = math.fsum(s["layer_s"]) / steps * 1e3
        self.weights_ms_per_step = math.fsum(s["weights_s"]) / steps * 1e3

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


@dataclass
class SimResult:
    trace: str
    ranks: int
    experts: int
    top_k: int
    layers: int
    steps: int
    tokens_per_rank: int
    slots_per_rank_replicas: int
    expert_bytes: int
    expert_maxvio_mean: float
    policies: dict[str, PolicyStats]
    cost: ExpertCost
    rebalance_every: int = 1
    rebalance_ms_median: float = 0.0
    wall_s: float = 0.0

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "policies"}
        out["policies"] = {name: st.to_json() for name, st in self.policies.items()}
        return out


@contextlib.contextmanager
def _single_thread():
    """Small tensors: one intra-op thread is faster and immune to a busy neighbour core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _split_over_copies(counts_re: torch.Tensor, placement_phy: torch.Tensor, log2phy: torch.Tensor,
                       logcnt: torch.Tensor) -> torch.Tensor:
    """[R, P]: each source rank's tokens of expert e split evenly over e's copies (first copies take the rest)."""
    num_phys = placement_phy.numel()
    cnt = logcnt[placement_phy]                                                            # [P]
    copy_idx = (log2phy[placement_phy] < torch.arange(num_phys)[:, None]).logical_and(
        log2phy[placement_phy] >= 0).sum(1)                                                # [P]
    tok = counts_re[:, placement_phy]                                                      # [R, P]
    return tok // cnt + (copy_idx[None] < tok % cnt).to(torch.int64)


def run_simulation(cfg, ranks: int, trace: str, steps: int = 3, layers: int | None = None,
                   tokens_per_rank: int = 4096, seed: int = 0, progress: bool = False,
                   rebalance_every: int | None = None) -> SimResult:
    """Simulate `steps` steps of `layers` MoE layers (default: all of cfg.model) on `ranks` EP ranks.

    cfg: k3ray.config.JobConfig (model shape, parallel.micro_batches, policies.moonep (slots and cost model),
    policies.replication.*).
    Persistent replicas are placed before step 0 from step 0's own load (a warm start), then re-planned every
    `rebalance_every` steps (default policies.replication.every_n_steps) from the decayed history of the steps
    before, limited by policies.replication.moved_budget.
    """
    model, rep_cfg = cfg.model, cfg.policies.replication
    num_experts, top_k = model.n_experts, model.top_k
    num_layers = layers or model.n_layers
    cost = ExpertCost.from_config(cfg.policies.moonep, model, training=True)
    expert_bytes = cost.weight_bytes
    tr = Trace(trace, num_layers, ranks, num_experts, top_k, tokens_per_rank, seed)
    num_layers, ranks = tr.num_layers, tr.num_ranks                  # a trace file fixes both
    slots = math.ceil(num_experts / ranks) + rep_cfg.spare_slots_per_rank
    num_phys = slots * ranks
    stats = {name: PolicyStats() for name in POLICIES}
    every = rebalance_every or rep_cfg.every_n_steps
    gen = torch.Generator().manual_seed(seed)
    history: torch.Tensor | None = None
    placement = None
    moved_total, rebalance_ms, maxvios = 0, [], []
    started = time.perf_counter()
    with _single_thread(), tqdm(total=2 * steps * num_layers, disable=not progress, unit="layer",
                                desc=f"sim {trace} R={ranks}") as bar:   # each layer: sampled, then simulated
        for step in range(steps):
            bar.set_postfix_str("sampling")
            counts_step = []                                                                      # L x [R, E]
            for layer in range(num_layers):
                counts_step.append(tr.counts(step, gen, layer=layer))
                bar.update(1)
            totals = torch.stack([c.sum(0) for c in counts_step]).double()                        # [L, E]
            if placement is None or step % every == 0:
                bar.set_postfix_str("replication")
                t0 = time.perf_counter()
                new = replication.rebalance(totals if history is None else history, ranks, num_phys,
                                            current=None if placement is None else placement.physical_to_logical,
                                            moved_budget=None if placement is None else rep_cfg.moved_budget)
                rebalance_ms.append((time.perf_counter() - t0) * 1e3)
                if placement is not None:
                    moved_total += int((new.physical_to_logical != placement.physical_to_logical).sum())
                placement = new
            history = totals if history is None else rep_cfg.history_decay * history + totals
            home_phys = torch.arange(num_phys) // slots
            bar.set_postfix_str("policies")
            for layer, counts in enumerate(counts_step):
                maxvios.append(moonep.maxvio(counts))
                _simulate_layer(stats, counts, placement, layer, home_phys, cfg.policies.moonep.slots_per_rank, cost,
                                cfg.parallel.micro_batches)
                bar.update(1)
    # Persistent copies move only when the placement changes (the first placement is set up before step 0);
    # MoonEP copies move every step: replicas per rank per layer x layers.
    moved_per_step = moved_total / ranks / steps
    for name, st in stats.items():
        st.finish(steps)
        copies = (st.replicas_per_rank_mean * num_layers if "moonep" in name else 0.0) + \
            (moved_per_step if name.startswith("replicas") else 0.0)
        st.copy_bytes_per_step_per_rank = copies * expert_bytes
    return SimResult(trace=trace, ranks=ranks, experts=num_experts, top_k=top_k, layers=num_layers, steps=steps,
                     tokens_per_rank=tokens_per_rank, slots_per_rank_replicas=slots, expert_bytes=expert_bytes,
                     expert_maxvio_mean=statistics.fmean(maxvios), policies=stats, cost=cost,
                     rebalance_every=every, rebalance_ms_median=statistics.median(rebalance_ms),
                     wall_s=time.perf_counter() - started)


def _simulate_layer(stats: dict[str, PolicyStats], counts: torch.Tensor, placement, layer: int,
                    home_phys: torch.Tensor, moonep_slots: int | None, cost: ExpertCost, micro_batches: int) -> None:
    num_ranks, num_experts = counts.shape
    zero, no_copies = torch.zeros(num_ranks), torch.zeros(0, dtype=torch.int64)
    stats["none"].add(moonep.home_loads(counts), zero, 0.0, cost, no_copies, no_copies)

    phy = placement.physical_to_logical[layer]
    rep_loads = replication.rank_loads(counts.sum(0), phy, num_ranks)[0]
    resident = torch.zeros(num_ranks, num_experts, dtype=torch.bool)
    resident[home_phys, phy] = True
    spare = torch.bincount(home_phys, minlength=num_ranks) - torch.bincount(
        moonep.default_home(num_experts, num_ranks), minlength=num_ranks)                # slots beyond E/R
    # every other copy of an expert syncs with its first copy (gradient in, weights out) once per optimizer step
    first = home_phys[placement.logical_to_physical[layer][:, 0]]                        # [E] rank of the first copy
    holder, expert = resident.nonzero(as_tuple=True)
    other = holder != first[expert]
    shared_s = cost.transfer_s(first[expert[other]], holder[other], num_ranks) / micro_batches
    stats["replicas"].add(rep_loads, spare, 0.0, cost, no_copies, no_copies, shared_s)

    for name, priced in (("moonep", None), ("moonep-priced", cost)):
        t0 = time.perf_counter()
        plan = moonep.plan(counts, slots_per_rank=moonep_slots, cost=priced)
        plan_s = time.perf_counter() - t0
        stats[name].add(moonep.rank_loads(plan.alloc), plan.replicas_per_rank, plan_s, cost, *plan.copies())

    for name, priced in (("replicas+moonep", None), ("replicas+moonep-priced", cost)):
        t0 = time.perf_counter()
        counts_phys = _split_over_copies(counts, phy, placement.logical_to_physical[layer],
                                         placement.logical_count[layer])
        plan_p = moonep.plan(counts_phys, home=home_phys, cost=priced)
        plan_s = time.perf_counter() - t0
        # a rank that already holds the expert needs no copy; one copy per (rank, expert), from the lowest slot's home
        rank_idx, phys_idx = plan_p.replica_mask.nonzero(as_tuple=True)
        fresh = ~resident[rank_idx, phy[phys_idx]]
        pair = rank_idx[fresh] * num_experts + phy[phys_idx[fresh]]
        pair, keep = _first_of_each(pair)
        needed = torch.zeros(num_ranks, num_experts, dtype=torch.bool)
        needed.view(-1)[pair] = True
        stats[name].add(moonep.rank_loads(plan_p.alloc), needed.sum(1), plan_s, cost,
                        home_phys[phys_idx[fresh][keep]], rank_idx[fresh][keep], shared_s)


def _first_of_each(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct keys [m] and the index of each one's first occurrence in `keys` [n]."""
    distinct, inverse = torch.unique(keys, return_inverse=True)
    first = torch.full((distinct.numel(),), keys.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(keys.numel()), reduce="amin")
    return distinct, first


def format_table(result: SimResult) -> str:
    """A fixed-width table of the per-policy figures."""
    r, c = result, result.cost
    gib = 2**30
    lines = [f"trace {r.trace}: R={r.ranks} E={r.experts} K={r.top_k} L={r.layers} steps={r.steps} "
             f"s={r.tokens_per_rank}; expert MaxVio {r.expert_maxvio_mean:.2f}; expert weights "
             f"{r.expert_bytes / 2**20:.0f} MiB; replica slots/rank {r.slots_per_rank_replicas}; "
             f"rebalance every {r.rebalance_every} steps, {r.rebalance_ms_median:.0f} ms (all layers)",
             f"modelled (training): a row {c.row_s * 1e6:.3f} us, a copy with its gradient "
             f"{c.copy_s(True) * 1e3:.2f} ms over NVLink ({c.nvlink_bytes_per_s / 1e9:.0f} GB/s), "
             f"{c.copy_s(False) * 1e3:.2f} ms over InfiniBand ({c.ib_bytes_per_s / 1e9:.0f} GB/s), "
             f"{c.ranks_per_node} ranks per node; a step is s tokens per rank through the L layers",
             f"{'policy':<22} {'max/mean':>9} {'worst':>7} {'balanced':>9} {'repl/rank':>9} {'max':>5} "
             f"{'copy GiB/step/rank':>19} {'plan ms/layer':>14} {'modelled ms/step':>17} {'of which weights':>17}"]
    for name, st in r.policies.items():
        lines.append(f"{name:<22} {st.imbalance_mean:>9.3f} {st.imbalance_worst:>7.3f} {st.balancedness_mean:>9.3f} "
                     f"{st.replicas_per_rank_mean:>9.2f} {st.replicas_per_rank_max:>5.0f} "
                     f"{st.copy_bytes_per_step_per_rank / gib:>19.2f} {st.plan_ms_median:>14.2f} "
                     f"{st.modelled_ms_per_step:>17.1f} {st.weights_ms_per_step:>17.1f}")
    return "\n".join(lines)
