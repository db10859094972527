"""Persistent expert replication (DeepSeek EPLB style) from a load history.

Input  load [L, E] (or [E]) expert load (tokens, any non-negative scale). P = num_replicas physical experts, R ranks,
each rank holds exactly P/R physical experts; physical expert p lives on rank p // (P/R).
Output Placement (EPLB vocabulary):
  physical_to_logical [L, P]             logical expert held by physical slot p
  logical_to_physical [L, E, max_copies] physical slots of each logical expert, ascending, -1 padded
  logical_count       [L, E]             copies of each logical expert (>= 1)

Algorithm: (1) replicate: give one more copy to the expert with the largest load per copy, P - E times (or fewer:
4 splits of the spare slots between hot copies and near-empty slots are tried, the best kept per layer);
(2) pack: copies heaviest first (load/copies each) onto the lightest rank that still has a free slot, preferring
ranks that do not hold that expert yet; (3) refine: swap single copies between the heaviest rank and one of the
lightest while that lowers the heaviest load. With num_nodes > 1 (hierarchical, as EPLB): first pack groups of
experts onto nodes (E/num_nodes experts each), then replicate and pack inside each node. With `current` and
`moved_budget`, the ideal placement is aligned to the current one (rank matching, then slot matching) and at most
`moved_budget` slots change their expert: copy counts move towards the ideal's (hottest experts first), then
single-copy swaps.
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


def _replicate(load_be: torch.Tensor, num_phys: int, num_hot: int | None = None) -> torch.Tensor:
    """[B, P] physical_to_logical before packing: experts 0..E-1, then `num_hot` extra copies (default all), each to
    the expert with the largest load per copy, then one extra copy each for the coldest experts (near-empty slots)."""
    batch, num_experts = load_be.shape
    num_extra = num_phys - num_experts
    num_hot = num_extra if num_hot is None else num_hot
    count = torch.ones(batch, num_experts, dtype=torch.int64)
    extra = torch.empty(batch, num_extra, dtype=torch.int64)
    rows = torch.arange(batch)
    for i in range(num_hot):
        pick = torch.argmax(load_be / count, dim=1)                                       # first max on ties
        extra[:, i] = pick
        count[rows, pick] += 1
    if num_hot < num_extra:
        coldest = torch.sort(load_be, dim=1, stable=True).indices                         # ascending, ties by index
        extra[:, num_hot:] = coldest.repeat(1, -(-(num_extra - num_hot) // num_experts))[:, :num_extra - num_hot]
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
    """Flat EPLB for a batch of independent problems: [B, P] physical_to_logical, slots grouped by rank.

    With a fixed number of slots per rank, giving every spare slot to the hottest experts is not always best (many
    small hot copies leave ranks that must fill their load with few slots); so 4 splits of the spare slots between
    hot copies and near-empty slots are packed and each problem keeps its best (lowest max rank load).
    """
    batch, num_experts = load_be.shape
    num_extra = num_phys - num_experts
    best_phy, best_peak = None, None
    for num_hot in sorted({num_extra, (3 * num_extra) // 4, num_extra // 2, num_extra // 4}, reverse=True):
        phy = _replicate(load_be, num_phys, num_hot)
        count = torch.zeros_like(load_be).scatter_add_(1, phy, torch.ones_like(phy, dtype=torch.float64))
        weight = torch.gather(load_be / count, 1, phy)
        rank_of = _pack(weight, phy, num_ranks, num_experts)
        # lay out: rank-major; inside a rank, packing order (stable by item index)
        slot_order = torch.sort(rank_of * num_phys + torch.arange(num_phys), dim=1).indices
        phy = _refine(torch.gather(phy, 1, slot_order), torch.gather(weight, 1, slot_order), num_ranks)
        peak = torch.gather(load_be / count, 1, phy).reshape(batch, num_ranks, -1).sum(2).amax(1)
        if best_phy is None:
            best_phy, best_peak = phy, peak
        else:
            better = peak < best_peak * (1 - 1e-12)                                       # ties keep more copies
            best_phy = torch.where(better[:, None], phy, best_phy)
            best_peak = torch.where(better, peak, best_peak)
    return best_phy


def _refine(phy_bp: torch.Tensor, weight_bp: torch.Tensor, num_ranks: int, max_rounds: int | None = None,
            num_partners: int = 16) -> torch.Tensor:
    """Local search after packing: swap one copy of the heaviest rank with one copy of one of the `num_partners`
    lightest ranks whenever both end below the heaviest load, never putting two copies of an expert on one rank.
    Batched over problems; at most max_rounds (default 2R) swaps each. Returns [B, P]."""
    batch, num_phys = phy_bp.shape
    per_rank = num_phys // num_ranks
    phy = phy_bp.reshape(batch, num_ranks, per_rank).clone()
    weight = weight_bp.reshape(batch, num_ranks, per_rank).clone()
    rows = torch.arange(batch)
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    k = min(num_partners, num_ranks)
    for _ in range(2 * num_ranks if max_rounds is None else max_rounds):
        load = weight.sum(2)                                                              # [B, R]
        heavy = torch.argmax(load, dim=1)
        light = torch.topk(load, k, dim=1, largest=False, sorted=True).indices           # [B, k]
        w_h, e_h = weight[rows, heavy], phy[rows, heavy]                                  # [B, S]
        w_l, e_l = weight[rows[:, None], light], phy[rows[:, None], light]                # [B, k, S]
        # delta[b, r, i, j]: heavy gives its item i to partner r and takes r's item j
        delta = w_h[:, None, :, None] - w_l[:, :, None, :]
        load_h = load[rows, heavy][:, None, None, None]
        score = torch.maximum(load_h - delta, torch.gather(load, 1, light)[:, :, None, None] + delta)
        i_on_r = (e_h[:, None, :, None] == e_l[:, :, None, :]).any(3)                   # [B, k, S]
        j_on_h = (e_l[:, :, :, None] == e_h[:, None, None, :]).any(3)                    # [B, k, S]
        bad = i_on_r[:, :, :, None] | j_on_h[:, :, None, :] | (light == heavy[:, None])[:, :, None, None]
        score = torch.where(bad, inf, score).reshape(batch, -1)
        best = torch.argmin(score, dim=1)
        gain = load[rows, heavy] - score[rows, best]
        ok = gain > 1e-9 * load[rows, heavy]
        if not ok.any():
            break
        b = rows[ok]
        r = light[ok, best[ok] // (per_rank * per_rank)]
        i, j, h = (best[ok] // per_rank) % per_rank, best[ok] % per_rank, heavy[ok]
        e_i, w_i = phy[b, h, i].clone(), weight[b, h, i].clone()
        phy[b, h, i], weight[b, h, i] = phy[b, r, j], weight[b, r, j]
        phy[b, r, j], weight[b, r, j] = e_i, w_i
    return phy.reshape(batch, num_phys)


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
    """Start from `current` and change at most `budget` slots per layer. (1) Move copy counts towards the ideal's,
    most useful first: the expert with the largest load per copy among those the ideal gives more copies takes a
    slot of an expert the ideal gives fewer copies, on the rank that ends lightest and does not hold it yet; a change
    that would raise the max rank load is skipped. (2) Spend what is left on single-copy swaps (2 slots each)."""
    num_layers, num_phys = current.shape
    per_rank = num_phys // num_ranks
    slot_rank = torch.arange(num_phys) // per_rank
    out = current.clone()
    for layer in range(num_layers):
        load_e, phy = load_le[layer], out[layer].clone()
        want = torch.bincount(ideal[layer], minlength=load_e.numel())
        skipped = torch.zeros(load_e.numel(), dtype=torch.bool)
        moves = 0
        while moves < budget:
            have = torch.bincount(phy, minlength=load_e.numel())
            per_copy = load_e / have.clamp(min=1)
            loads = torch.zeros(num_ranks, dtype=torch.float64).index_add_(0, slot_rank, per_copy[phy])
            pending = (want > have) & ~skipped
            if not pending.any():
                break
            e = int(torch.argmax(torch.where(pending, per_copy, torch.tensor(-1.0, dtype=torch.float64))))
            holds_e = torch.zeros(num_ranks, dtype=torch.bool)
            holds_e[slot_rank[phy == e]] = True
            free = (have[phy] > want[phy]) & ~holds_e[slot_rank]
            if not free.any():
                skipped[e] = True
                continue
            after = loads[slot_rank] - per_copy[phy] + load_e[e] / (have[e] + 1)
            slot = int(torch.argmin(torch.where(free, after, torch.tensor(float("inf"), dtype=torch.float64))))
            trial = phy.clone()
            trial[slot] = e
            have_t = torch.bincount(trial, minlength=load_e.numel())
            peak = torch.zeros(num_ranks, dtype=torch.float64).index_add_(
                0, slot_rank, (load_e / have_t.clamp(min=1))[trial]).max()
            if peak > loads.max() * (1 + 1e-12):
                skipped[e] = True
                continue
            phy, moves = trial, moves + 1
        rounds = (budget - moves) // 2
        if rounds > 0:
            have = torch.bincount(phy, minlength=load_e.numel()).clamp(min=1)
            phy = _refine(phy[None], (load_e / have)[phy][None], num_ranks, max_rounds=rounds)[0]
        out[layer] = phy
    return out
