"""Read-only copies of hot experts in spare expert slots (serving): where to put them, and how each iteration's
tokens are split between an expert's holders.

Notation: E experts, R EP ranks, S spare slots per rank. home [E] is fixed (the shard each rank loaded); a copy table
`copies` is R lists of expert ids (at most S each, none homed on that rank, no repeats): rank r holds read-only
copies of those experts. An expert's holders are its home and the ranks holding a copy, ascending.

Placement model (EPLB's): an expert's load is split evenly over its holders. At run time each iteration's tokens are
water-filled over the holders instead (`copy_alloc`), which balances at least as well. `place_copies` is greedy on
that model: each round adds the one copy that lowers the largest rank load most (ties: the lower sum of squared rank
loads, then the lower expert id, then the lower rank), until no copy helps or the slots are full. Copies the current
table already holds cost nothing to keep; copies it does not hold must be fetched, at most `moved_budget` of them
(None: no limit). Starting from nothing rather than from the current table lets a shifted hot set take over slots.
"""
from __future__ import annotations

import torch


def holders_of(home: list[int], copies: list[list[int]]) -> list[list[int]]:
    """[E] ranks that hold each expert (home and copies), ascending."""
    out = [{h} for h in home]
    for rank, experts in enumerate(copies):
        for e in experts:
            out[e].add(rank)
    return [sorted(h) for h in out]


def rank_loads(load: torch.Tensor, home: list[int], copies: list[list[int]]) -> torch.Tensor:
    """[R] load of each rank, each expert's load [E] split evenly over its holders."""
    loads = torch.zeros(len(copies), dtype=torch.float64)
    for e, ranks in enumerate(holders_of(home, copies)):
        loads[ranks] += float(load[e]) / len(ranks)
    return loads


def balancedness(load: torch.Tensor, home: list[int], copies: list[list[int]]) -> float:
    """Mean rank load / max rank load (1.0 = perfect; 1.0 without any load)."""
    loads = rank_loads(load, home, copies)
    return 1.0 if float(loads.max()) <= 0 else float(loads.mean() / loads.max())


def place_copies(load: torch.Tensor, home: list[int], num_ranks: int, spare_slots: int,
                 current: list[list[int]] | None = None, moved_budget: int | None = None) -> list[list[int]]:
    """The copy table for expert load [E] (see the module doc): R sorted lists of expert ids."""
    load = load.double().cpu()
    held_now = {(r, e) for r, experts in enumerate(current or []) for e in experts}
    copies: list[list[int]] = [[] for _ in range(num_ranks)]
    holders = [{h} for h in home]
    loads = rank_loads(load, home, copies)
    fetched = 0
    while True:
        best = None
        budget_left = moved_budget is None or fetched < moved_budget
        for e in range(len(home)):
            share_now, share_new = float(load[e]) / len(holders[e]), float(load[e]) / (len(holders[e]) + 1)
            if share_now <= 0:
                continue
            for d in range(num_ranks):
                if d in holders[e] or len(copies[d]) >= spare_slots or not (budget_left or (d, e) in held_now):
                    continue
                trial = loads.clone()
                trial[sorted(holders[e])] -= share_now - share_new
                trial[d] += share_new
                key = (float(trial.max()), float((trial ** 2).sum()), e, d)
                if best is None or key < best[0]:
                    best = (key, e, d, trial)
        if best is None or (best[0][0], best[0][1]) >= (float(loads.max()), float((loads ** 2).sum())):
            break
        _, e, d, loads = best
        copies[d].append(e)
        holders[e].add(d)
        fetched += (d, e) not in held_now
    return [sorted(c) for c in copies]


def copy_alloc(tokens_per_expert: torch.Tensor, holders: list[list[int]]) -> torch.Tensor:
    """alloc [E, R] int64 for one iteration's counts tokens_per_expert [R, E] (summed over the sources): an expert
    with one holder goes whole to it; then the experts with copies, most tokens first, are water-filled over their
    holders (the least loaded rank first, up to a common level; whole tokens, leftovers to the lowest ranks of the
    level). Every rank computes the same from the same counts; which routes go to which holder follows
    (k3ray.policies.moonep.send_matrix), so the split is a pure function of the iteration's routing."""
    num_ranks = tokens_per_expert.shape[0]
    total = tokens_per_expert.to(torch.int64).sum(0).tolist()
    alloc = torch.zeros(len(holders), num_ranks, dtype=torch.int64)
    load = [0] * num_ranks
    for e, ranks in enumerate(holders):
        if len(ranks) == 1:
            alloc[e, ranks[0]] = total[e]
            load[ranks[0]] += total[e]
    for e in sorted((e for e, h in enumerate(holders) if len(h) > 1), key=lambda e: (-total[e], e)):
        ranks = sorted(holders[e], key=lambda r: (load[r], r))  # least loaded first
        left, level, n = total[e], load[ranks[0]], 1
        while left > 0:  # raise the level of the n least loaded holders, joining the next one when it is reached
            step = left // n if n == len(ranks) else min(left // n, load[ranks[n]] - level)
            if step == 0 and (n == len(ranks) or load[ranks[n]] > level):
                for r in sorted(ranks[:n])[:left]:  # fewer tokens than holders at this level: lowest ranks
                    alloc[e, r] += 1
                    load[r] += 1
                break
            for r in ranks[:n]:
                alloc[e, r] += level + step - load[r]
                load[r] = level + step
            left -= step * n
            level += step
            while n < len(ranks) and load[ranks[n]] <= level:
                n += 1
    return alloc
