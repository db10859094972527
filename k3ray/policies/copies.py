"""Read-only copies of hot experts in spare expert slots (serving): where to put them, and how each iteration's
tokens are split between an expert's holders.

Notation: E experts, R EP ranks, S spare slots per rank. home [E] is fixed (the shard each rank loaded); a copy table
`copies` is R lists of expert ids (at most S each, none homed on that rank, no repeats): rank r holds read-only
copies of those experts. An expert's holders are its home and the ranks holding a copy, ascending.

Model (EPLB's): an expert's load is split evenly over its holders. `place_copies` is greedy on that model: each
round adds the one copy that lowers the largest rank load most (ties: the lower sum of squared rank loads, then the
lower expert id, then the lower rank), until no copy helps or the slots are full. Copies the current table already
holds cost nothing to keep; copies it does not hold must be fetched, at most `moved_budget` of them (None: no
limit). Starting from nothing rather than from the current table lets a shifted hot set take over slots.
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
    """alloc [E, R] int64: each expert's tokens (summed over the sources of tokens_per_expert [R, E]) cut evenly
    over its holders, the remainder one each to the first holders. Every rank computes the same from the same
    counts; which routes go to which holder follows (k3ray.policies.moonep.send_matrix), so the split is a pure
    function of the iteration's routing."""
    num_ranks = tokens_per_expert.shape[0]
    total = tokens_per_expert.to(torch.int64).sum(0).tolist()
    alloc = torch.zeros(len(holders), num_ranks, dtype=torch.int64)
    for e, ranks in enumerate(holders):
        share, extra = divmod(total[e], len(ranks))
        for i, r in enumerate(ranks):
            alloc[e, r] = share + (i < extra)
    return alloc
