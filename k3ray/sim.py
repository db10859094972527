"""K3-scale placement simulator: routing traces in (k3ray.traces), per-policy balance, copy traffic and modelled
step time out; no weights, no Ray. Notation in k3ray/policies/__init__.py.

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
import math
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from k3ray.policies import moonep, replication
from k3ray.policies.expert_cost import ExpertCost
from k3ray.traces import Trace

POLICIES = ("none", "replicas", "moonep", "moonep-priced", "replicas+moonep", "replicas+moonep-priced")


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
                placement, moved = _replan(totals if history is None else history, placement, ranks, num_phys,
                                           rep_cfg.moved_budget)
                rebalance_ms.append((time.perf_counter() - t0) * 1e3)
                moved_total += moved
            history = totals if history is None else rep_cfg.history_decay * history + totals
            home_phys = torch.arange(num_phys) // slots
            bar.set_postfix_str("policies")
            for layer, counts in enumerate(counts_step):
                maxvios.append(moonep.maxvio(counts))
                _simulate_layer(stats, counts, placement, layer, home_phys, cfg.policies.moonep.slots_per_rank, cost,
                                cfg.parallel.micro_batches)
                bar.update(1)
    _finish_stats(stats, steps, num_layers, moved_total / ranks / steps, expert_bytes)
    return SimResult(trace=trace, ranks=ranks, experts=num_experts, top_k=top_k, layers=num_layers, steps=steps,
                     tokens_per_rank=tokens_per_rank, slots_per_rank_replicas=slots, expert_bytes=expert_bytes,
                     expert_maxvio_mean=statistics.fmean(maxvios), policies=stats, cost=cost,
                     rebalance_every=every, rebalance_ms_median=statistics.median(rebalance_ms),
                     wall_s=time.perf_counter() - started)


def _replan(load: torch.Tensor, placement, ranks: int, num_phys: int, moved_budget) -> tuple:
    """(the persistent replicas planned on `load` [L, E], physical slots that changed expert): the first placement
    is free, a re-plan is limited by `moved_budget`."""
    new = replication.rebalance(load, ranks, num_phys,
                                current=None if placement is None else placement.physical_to_logical,
                                moved_budget=None if placement is None else moved_budget)
    moved = 0 if placement is None else int((new.physical_to_logical != placement.physical_to_logical).sum())
    return new, moved


def _finish_stats(stats: dict[str, PolicyStats], steps: int, num_layers: int, moved_per_step: float,
                  expert_bytes: int) -> None:
    """Each policy's means over the steps and its copy bytes per step and rank: persistent copies move only when
    the placement changes (the first placement is set up before step 0); MoonEP copies move every step (replicas
    per rank per layer x layers)."""
    for name, st in stats.items():
        st.finish(steps)
        copies = (st.replicas_per_rank_mean * num_layers if "moonep" in name else 0.0) + \
            (moved_per_step if name.startswith("replicas") else 0.0)
        st.copy_bytes_per_step_per_rank = copies * expert_bytes


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
