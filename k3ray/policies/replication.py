"""Persistent expert replication (DeepSeek EPLB style) from a load history.

Input  load [L, E] (or [E]) expert load (tokens, any non-negative scale). P = num_replicas physical experts, R ranks,
each rank holds exactly P/R physical experts; physical expert p lives on rank p // (P/R).
Output Placement (EPLB vocabulary):
  physical_to_logical [L, P]             logical expert held by physical slot p
  logical_to_physical [L, E, max_copies] physical slots of each logical expert, ascending, -1 padded
  logical_count       [L, E]             copies of each logical expert (>= 1)

Algorithm: (1) replicate: P - E times, give one more copy to the expert with the largest load per copy;
(2) pack: copies heaviest first (load/copies each) onto the lightest rank that still has a free slot, preferring
ranks that do not hold that expert yet. With num_nodes > 1 (hierarchical, as EPLB): first pack groups of experts onto
nodes (E/num_nodes experts each), then replicate and pack inside each node. With `current` and `moved_budget`, the
ideal placement is aligned to the current one (rank matching, then slot matching) and at most `moved_budget` slots
change their expert, the most useful changes first (greedy on max rank load, then sum of squares).
All steps are batched over layers; ties go to the lowest index, so the result is deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    physical_to_logical: torch.Tensor   # [L, P] int64
    logical_to_physical: torch.Tensor   # [L, E, max_copies] int64, -1 padded
    logical_count: torch.Tensor         # [L, E] int64


def rebalance(load: torch.Tensor, num_ranks: int, num_replicas: int, num_nodes: int = 1,
              moved_budget: int | None = None, current: torch.Tensor | None = None,
              num_groups: int | None = None) -> Placement:
    """Placement of P = num_replicas physical experts on num_ranks ranks for load [L, E] or [E] (see module doc).

    num_groups (hierarchical mode only): experts form num_groups contiguous groups that move to nodes together
    (default E: every expert is its own group). moved_budget: max physical slots per layer whose expert differs
    from `current` [L, P] (ignored without `current`).
    """
    squeeze = load.dim() == 1
    load_le = load.double().cpu().reshape(-1, load.shape[-1])
    num_layers, num_experts = load_le.shape
    if num_replicas % num_ranks or num_replicas < num_experts:
        raise ValueError(f"rebalance: num_replicas={num_replicas} must be a multiple of num_ranks={num_ranks} "
                         f"and at least the {num_experts} experts")
    if num_nodes > 1:
        phy2log = _hierarchical(load_le, num_ranks, num_replicas, num_nodes, num_groups or num_experts)
    else:
        phy2log = _replicate_and_pack(load_le, num_ranks, num_replicas)
    if current is not None:
        current_lp = current.to("cpu", torch.int64).reshape(num_layers, num_replicas)
        phy2log = _align(phy2log, current_lp, num_ranks, num_experts)
        if moved_budget is not None:
            phy2log = _limit_moves(load_le, current_lp, phy2log, num_ranks, moved_budget)
    placement = placement_from_physical(phy2log, num_experts)
    if squeeze:
        placement = Placement(*(t[0] for t in (placement.physical_to_logical, placement.logical_to_physical,
                                               placement.logical_count)))
    return placement


def placement_from_physical(phy2log: torch.Tensor, num_experts: int) -> Placement:
    """Build the EPLB triple from physical_to_logical [L, P]."""
    num_layers, num_phys = phy2log.shape
    count = torch.zeros(num_layers, num_experts, dtype=torch.int64).scatter_add_(
        1, phy2log, torch.ones_like(phy2log))
    max_copies = int(count.max())
    # copy index of each physical slot among its expert's slots (slots ascending)
    order = torch.sort(phy2log * num_phys + torch.arange(num_phys), dim=1).indices        # grouped by expert
    sorted_log = torch.gather(phy2log, 1, order)
    first = torch.cumsum(count, 1) - count                                               # [L, E] start offsets
    rank_in_expert = torch.arange(num_phys).expand(num_layers, -1) - torch.gather(first, 1, sorted_log)
    log2phy = torch.full((num_layers, num_experts, max_copies), -1, dtype=torch.int64)
    log2phy[torch.arange(num_layers)[:, None], sorted_log, rank_in_expert] = order
    return Placement(phy2log, log2phy, count)


def round_robin(num_layers: int, num_experts: int, num_ranks: int, num_replicas: int) -> Placement:
    """Load-blind baseline: physical slot p holds logical expert p % E."""
    phy2log = (torch.arange(num_replicas) % num_experts).expand(num_layers, -1).contiguous()
    return placement_from_physical(phy2log, num_experts)


def rank_loads(load: torch.Tensor, physical_to_logical: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """[L, R] load of each rank when every logical expert's load is split evenly over its copies."""
    load_le = load.double().cpu().reshape(-1, load.shape[-1])
    phy2log = physical_to_logical.cpu().reshape(load_le.shape[0], -1)
    count = torch.zeros_like(load_le).scatter_add_(1, phy2log, torch.ones_like(phy2log, dtype=torch.float64))
    per_copy = torch.gather(load_le / count.clamp(min=1), 1, phy2log)                   # [L, P]
    return per_copy.reshape(load_le.shape[0], num_ranks, -1).sum(2)


def balancedness(load: torch.Tensor, physical_to_logical: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """[L] mean rank load / max rank load (1.0 = perfect)."""
    loads = rank_loads(load, physical_to_logical, num_ranks)
    return torch.where(loads.amax(1) > 0, loads.mean(1) / loads.amax(1).clamp(min=1e-300), torch.ones(()))


def _replicate(load_be: torch.Tensor, num_phys: int) -> torch.Tensor:
    """[B, P] physical_to_logical before packing: experts 0..E-1, then extra copies of the hottest per copy."""
    batch, num_experts = load_be.shape
    count = torch.ones(batch, num_experts, dtype=torch.int64)
    extra = torch.empty(batch, num_phys - num_experts, dtype=torch.int64)
    rows = torch.arange(batch)
    for i in range(num_phys - num_experts):
        pick = torch.argmax(load_be / count, dim=1)                                       # first max on ties
        extra[:, i] = pick
        count[rows, pick] += 1
    return torch.cat([torch.arange(num_experts).expand(batch, -1), extra], dim=1)


def _pack(weight_bn: torch.Tensor, label_bn: torch.Tensor, num_bins: int, num_labels: int) -> torch.Tensor:
    """Balanced packing with exactly n/num_bins items per bin; heaviest item first onto the lightest bin with room,
    preferring bins without an item of the same label. Returns bin index per item [B, n]."""
    batch, n = weight_bn.shape
    per_bin = n // num_bins
    order = torch.sort(-weight_bn, dim=1, stable=True).indices
    rows = torch.arange(batch)
    bin_load = torch.zeros(batch, num_bins, dtype=torch.float64)
    bin_fill = torch.zeros(batch, num_bins, dtype=torch.int64)
    holds = torch.zeros(batch, num_bins, num_labels, dtype=torch.bool)
    bin_of = torch.empty(batch, n, dtype=torch.int64)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    for i in range(n):
        item = order[:, i]
        label = label_bn[rows, item]
        full = bin_fill >= per_bin
        dup = holds[rows, :, label]                                                       # [B, bins]
        any_bin = torch.where(full, inf, bin_load)                                        # lightest with room
        fresh = torch.where(dup, inf, any_bin)                                            # ... without the label
        key = torch.where(torch.isinf(fresh).all(1, keepdim=True), any_bin, fresh)
        target = torch.argmin(key, dim=1)
        bin_of[rows, item] = target
        bin_load[rows, target] += weight_bn[rows, item]
        bin_fill[rows, target] += 1
        holds[rows, target, label] = True
    return bin_of


def _replicate_and_pack(load_be: torch.Tensor, num_ranks: int, num_phys: int) -> torch.Tensor:
    """Flat EPLB for a batch of independent problems: [B, P] physical_to_logical, slots grouped by rank."""
    batch, num_experts = load_be.shape
    phy = _replicate(load_be, num_phys)
    count = torch.zeros_like(load_be).scatter_add_(1, phy, torch.ones_like(phy, dtype=torch.float64))
    weight = torch.gather(load_be / count, 1, phy)
    rank_of = _pack(weight, phy, num_ranks, num_experts)
    # lay out: rank-major; inside a rank, packing order (stable by item index)
    slot_order = torch.sort(rank_of * num_phys + torch.arange(num_phys), dim=1).indices
    return torch.gather(phy, 1, slot_order)


def _hierarchical(load_le: torch.Tensor, num_ranks: int, num_phys: int, num_nodes: int,
                  num_groups: int) -> torch.Tensor:
    num_layers, num_experts = load_le.shape
    if num_groups % num_nodes or num_experts % num_groups or num_ranks % num_nodes:
        raise ValueError(f"rebalance: num_nodes={num_nodes} must divide num_groups={num_groups} and num_ranks="
                         f"{num_ranks}, and num_groups must divide the {num_experts} experts")
    group_size = num_experts // num_groups
    group_load = load_le.reshape(num_layers, num_groups, group_size).sum(2)
    node_of_group = _pack(group_load, torch.arange(num_groups).expand(num_layers, -1), num_nodes, num_groups)
    # experts of each node, node-major, groups in ascending order inside a node
    group_order = torch.sort(node_of_group * num_groups + torch.arange(num_groups), dim=1).indices
    experts = (group_order[:, :, None] * group_size + torch.arange(group_size)).reshape(num_layers, num_experts)
    per_node = num_experts // num_nodes
    node_load = torch.gather(load_le, 1, experts).reshape(num_layers * num_nodes, per_node)
    local = _replicate_and_pack(node_load, num_ranks // num_nodes, num_phys // num_nodes)  # node-local ids
    local = local.reshape(num_layers, num_nodes, -1) + (torch.arange(num_nodes) * per_node)[None, :, None]
    return torch.gather(experts, 1, local.reshape(num_layers, num_phys))


def _align(ideal: torch.Tensor, current: torch.Tensor, num_ranks: int, num_experts: int) -> torch.Tensor:
    """Relabel the ideal's ranks (greedy max overlap) and order each rank's slots to match `current` where the same
    expert is kept. Rank loads and copy counts are unchanged; only the labels move."""
    num_layers, num_phys = ideal.shape
    per_rank = num_phys // num_ranks
    out = torch.empty_like(ideal)
    for layer in range(num_layers):
        ideal_r = ideal[layer].reshape(num_ranks, per_rank).tolist()
        cur_r = current[layer].reshape(num_ranks, per_rank).tolist()
        holders: dict[int, list[int]] = {}
        for r, row in enumerate(cur_r):
            for e in set(row):
                holders.setdefault(e, []).append(r)
        overlap: dict[tuple[int, int], int] = {}
        for i, row in enumerate(ideal_r):
            for e in set(row):
                for r in holders.get(e, ()):
                    overlap[(i, r)] = overlap.get((i, r), 0) + 1
        match, used = [-1] * num_ranks, [False] * num_ranks
        for (i, r), _ in sorted(overlap.items(), key=lambda kv: (-kv[1], kv[0])):
            if match[i] < 0 and not used[r]:
                match[i], used[r] = r, True
        free = iter(r for r in range(num_ranks) if not used[r])
        rows = [None] * num_ranks
        for i in range(num_ranks):
            r = match[i] if match[i] >= 0 else next(free)
            rows[r] = _match_slots(ideal_r[i], cur_r[r])
        out[layer] = torch.tensor(rows, dtype=torch.int64).flatten()
    return out


def _match_slots(ideal_row: list[int], cur_row: list[int]) -> list[int]:
    remaining = list(ideal_row)
    out: list[int | None] = [None] * len(cur_row)
    for j, e in enumerate(cur_row):
        if e in remaining:
            remaining.remove(e)
            out[j] = e
    rest = iter(sorted(remaining))
    return [e if e is not None else next(rest) for e in out]


def _limit_moves(load_le: torch.Tensor, current: torch.Tensor, ideal: torch.Tensor, num_ranks: int,
                 budget: int) -> torch.Tensor:
    """Start from `current`; apply at most `budget` of the slot changes current -> ideal, greedily the one that most
    lowers (max rank load, sum of squared rank loads); stop when none helps. Never drops an expert's last copy."""
    num_layers, num_phys = current.shape
    per_rank = num_phys // num_ranks
    out = current.clone()
    for layer in range(num_layers):
        load_e = load_le[layer]
        phy = out[layer].clone()
        slot_rank = torch.arange(num_phys) // per_rank
        for _ in range(budget):
            cand = (phy != ideal[layer]).nonzero().flatten()
            if cand.numel() == 0:
                break
            count = torch.bincount(phy, minlength=load_e.numel())
            mult = torch.zeros(num_ranks, load_e.numel(), dtype=torch.float64)
            mult.index_put_((slot_rank, phy), torch.ones(num_phys, dtype=torch.float64), accumulate=True)
            loads = (mult * (load_e / count.clamp(min=1))).sum(1)                         # [R]
            old_e, new_e, at = phy[cand], ideal[layer][cand], slot_rank[cand]
            ok = count[old_e] > 1
            cand, old_e, new_e, at = cand[ok], old_e[ok], new_e[ok], at[ok]
            if cand.numel() == 0:
                break
            new_loads = loads.expand(cand.numel(), -1).clone()                          # [C, R]
            for e, sign in ((old_e, -1), (new_e, 1)):
                per_copy_old = load_e[e] / count[e]
                per_copy_new = load_e[e] / (count[e] + sign)
                m_old = mult[:, e].T                                                      # [C, R]
                m_new = m_old.clone()
                m_new[torch.arange(cand.numel()), at] += sign
                new_loads += m_new * per_copy_new[:, None] - m_old * per_copy_old[:, None]
            peak, sq = new_loads.amax(1), (new_loads ** 2).sum(1)
            best_peak = peak.min()
            tol = 1e-9 * max(float(best_peak), 1.0)
            sq_masked = torch.where(peak <= best_peak + tol, sq, torch.full_like(sq, float("inf")))
            pick = int(torch.argmin(sq_masked))
            cur_peak, cur_sq = float(loads.max()), float((loads ** 2).sum())
            if not (float(peak[pick]) < cur_peak - tol or
                    (float(peak[pick]) <= cur_peak + tol and float(sq[pick]) < cur_sq * (1 - 1e-12))):
                break
            phy[cand[pick]] = new_e[pick]
        out[layer] = phy
    return out
