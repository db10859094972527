"""Where experts go when the EP dimension shrinks (a worker lost) or grows back, and whether to replace lost workers
by hot spares, shrink or restart: pure decisions over homes and loads.

home [E] int64: the EP rank each expert lives on. load [E]: recent tokens per expert (any scale)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from k3ray.policies.moonep import default_home


def shrink(home: torch.Tensor, lost: set[int], load: torch.Tensor) -> tuple[torch.Tensor, dict[int, int]]:
    """Survivors keep their experts (renumbered densely); the lost ranks' experts go, heaviest first, to the
    survivor with the least load so far. Returns (new home [E], old rank -> new rank for survivors)."""
    num_ranks = int(home.max()) + 1 if home.numel() else 0
    survivors = [r for r in range(num_ranks) if r not in lost]
    if not survivors:
        raise ValueError("no EP rank survives")
    renumber = {old: new for new, old in enumerate(survivors)}
    new_home = home.clone()
    rank_load = torch.zeros(len(survivors), dtype=torch.float64)
    for old, new in renumber.items():
        mask = home == old
        new_home[mask] = new
        rank_load[new] = load[mask].double().sum()
    orphans = [e for e in range(home.numel()) if int(home[e]) in lost]
    orphans.sort(key=lambda e: (-float(load[e]), e))
    for e in orphans:
        target = int(torch.argmin(rank_load))  # ties -> lowest rank: deterministic
        new_home[e] = target
        rank_load[target] += float(load[e])
    return new_home, renumber


def dp_ranks_of(ep_rank: int, ep: int, dp: int) -> list[int]:
    """The data-parallel ranks (of `dp`, the configured EP size) whose micro-batches EP rank `ep_rank` of a grid with
    `ep` live EP ranks runs: d with d % ep == ep_rank. At full size each runs its own; shrunk, the survivors take
    over the lost ranks' micro-batches, so the global batch, and with it the result, stays that of the full grid."""
    return list(range(ep_rank, dp, ep))


def grow(num_experts: int, num_ranks: int) -> torch.Tensor:
    """Back at full size: the configured contiguous homes (what a fresh job has), so a grown-back job and a job
    that never shrank place experts identically."""
    return default_home(num_experts, num_ranks)


def spare_cover(lost_ranks: set[int], ep: int, spares: int, standing_by: frozenset[int] = frozenset()) -> set[int]:
    """The lost world ranks of a [pp][ep] grid that `spares` hot spares and the standbys of `standing_by` (lost ranks
    whose own standby is up, which take only their own place) take the places of: whole EP columns only (a column
    with a lost rank left unreplaced is dropped, spares and all), those needing the fewest spares first, ties to the
    lowest column."""
    columns: dict[int, list[int]] = {}
    for r in sorted(lost_ranks):
        columns.setdefault(r % ep, []).append(r)
    needs = sorted((sum(r not in standing_by for r in ranks), c) for c, ranks in columns.items())
    covered: set[int] = set()
    used = 0
    for need, c in needs:
        if need <= spares - used:
            covered |= set(columns[c])
            used += need
    return covered


@dataclass(frozen=True)
class LossDecision:
    """`replace`: hot spares take every lost rank's place, the grid keeps its size and homes; `reshard`: carry on with
    `ep` EP ranks per stage (the surviving columns, experts re-homed to `home`); `restart`: a whole EP column is gone
    (every rank of some stage), so the same grid starts again on other resources. `keep`: the old EP columns the new
    grid is made of, in its EP-rank order; `spare_for`: the lost world ranks a spare takes the place of. `in_place`:
    the grid is rebuilt from the workers it already has (survivors keep their processes, spares fill lost places,
    survivors of columns left out stand by as spares), no process started; else it is launched anew."""
    action: Literal["replace", "reshard", "restart"]
    ep: int
    home: torch.Tensor
    keep: tuple[int, ...] = ()
    spare_for: frozenset[int] = frozenset()
    in_place: bool = False


def on_workers_lost(home: torch.Tensor, ep: int, lost_ranks: set[int], load: torch.Tensor,
                    max_ep: int | None = None, spares: int = 0, nodes_lost: bool = False,
                    standing_by: frozenset[int] = frozenset()) -> LossDecision:
    """Replace, shrink or restart after losing world ranks `lost_ranks` of a [pp][ep] grid (world rank = p * ep + e):
    `spares` ready hot spares and the standbys of `standing_by` (lost ranks whose own standby is up) take the places
    of whole columns' lost ranks (`spare_cover`); an EP rank is gone from
    every stage when any of its workers is lost and not replaced. The survivors' columns are kept in place unless
    `nodes_lost` (a lost rank's node is gone or silent: the grid's placement is made again off it, so it is launched
    anew; spares still fill in in place). `max_ep`: the most EP ranks the alive nodes hold for a grid launched anew
    (after a node loss fewer than the survivors): the highest-numbered survivors beyond it are let go too."""
    spare_for = frozenset(spare_cover(lost_ranks, ep, spares, standing_by))
    lost_cols = {r % ep for r in lost_ranks - spare_for}
    anew = max_ep is not None  # a plan for a grid launched anew: nothing is kept in place
    if not lost_cols:
        return LossDecision("replace", ep, home.clone(), tuple(range(ep)), spare_for, in_place=not anew)
    cap = ep if max_ep is None else max_ep
    if cap < 1:
        raise ValueError(f"no EP rank fits the alive nodes (max_ep={max_ep})")
    survivors = [c for c in range(ep) if c not in lost_cols]
    if survivors:
        keep = survivors[:cap]
        new_home, _ = shrink(home, set(range(ep)) - set(keep), load)
        spare_for = frozenset(r for r in spare_for if r % ep in keep)
        return LossDecision("reshard", len(keep), new_home, tuple(keep), spare_for,
                            in_place=not anew and (bool(spare_for) or not nodes_lost))
    if cap < ep:  # every EP rank lost and fewer fit: start again smaller from the snapshot
        return LossDecision("reshard", cap, grow(home.numel(), cap))
    return LossDecision("restart", ep, home.clone())


def silent_nodes(node_of_rank: list[str], hung_ranks: set[int]) -> set[str]:
    """Nodes that went silent: every rank they held gave no answer (hung, not dead), while some other node's ranks
    answered. One hung rank among answering peers is a hung worker, not a node; every node silent is no evidence
    against any one of them. node_of_rank[r]: the node of world rank r ("" where Ray has none for it: a bundle being
    placed again after its node was lost, which names no node to keep off)."""
    nodes = set(node_of_rank)
    silent = {n for n in nodes if all(r in hung_ranks for r, m in enumerate(node_of_rank) if m == n)}
    return silent - {""} if silent != nodes else set()


def on_lost_nodes(node_of_rank: list[str], lost_ranks: set[int], healthy: set[str]) -> bool:
    """Whether any lost world rank was on a node that is not `healthy` (lost, or found silent): the node went, not
    just the worker's process. node_of_rank[r]: the node of world rank r."""
    return any(node_of_rank[r] not in healthy for r in lost_ranks)
