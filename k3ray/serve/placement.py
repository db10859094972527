"""Live expert placement of a serving grid: read-only copies of hot experts in spare expert slots, moved without a
stall. The engine owns one `ServePlacement` and calls it at iteration boundaries.

A move: from the decayed per-expert load (replication.history_decay over the workers' counts, collected every
replication.every_n_steps iterations) the copy policy (k3ray.policies.copies: replication.spare_slots_per_rank
slots per rank, at most replication.moved_budget copies fetched) decides a new copy table; the copies it lacks are
fetched in the background (`ServingGrid.stage_copies`: from the weights the engine holds in Ray's object store, on
the workers' second thread) while iterations go on with the old table; at the first iteration boundary after every
fetch ended, all workers switch to the new table in one call (`ServingGrid.use_copies`). The routing is the same
on every rank of a layer within an iteration, so the switch is atomic. An EP rank whose fetch failed keeps none of
the move's new copies; a grid rebuilt after a loss starts with no copies (a move under way is discarded).

Outputs never change: copies are the same weights, and the split over an expert's holders is a pure function of
the iteration's routing (k3ray.policies.copies.copy_alloc).
"""
from __future__ import annotations

import asyncio
import logging
import time

import torch

from k3ray.config import ReplicationPolicy
from k3ray.policies import copies as copies_policy

log = logging.getLogger("k3ray.serve")
MOVES_KEPT = 20  # moves `view` lists (the newest)


class ServePlacement:
    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.load: torch.Tensor | None = None  # [E] decayed routed tokens per expert
        self.table: list[list[int]] = []  # the copy table the grid uses: R lists of expert ids
        # the grid the table belongs to: its worker group and generation (a grid launched or rebuilt in place after a
        # loss joins as a new generation, and starts without copies)
        self.grid_key: tuple | None = None
        self.move: dict | None = None  # the move under way: its table, fetch task, decision time
        self.moves: list[dict] = []  # finished moves, newest last
        self.decide_next = False  # decide at the next boundary (new load seen, or a policy change)
        self.asked = False  # a move asked for (`ask`): collect the load after the next iteration

    def ask(self) -> None:
        """Decide a move from the load after the next iteration, not waiting for replication.every_n_steps."""
        self.asked = True

    def due(self, iteration: int, policy: ReplicationPolicy) -> bool:
        """Whether the expert load should be collected after this iteration."""
        return policy.enabled and (self.asked or iteration % policy.every_n_steps == 0)

    def observe(self, loads: list[dict], policy: ReplicationPolicy) -> None:
        """Fold the workers' routed-token counts (each layer -> [E]) into the decayed load; a move is decided next."""
        now = torch.zeros(self.num_experts, dtype=torch.float64)
        for worker in loads:
            for counts in worker.values():
                now += torch.tensor(counts, dtype=torch.float64)
        self.asked = False
        if now.sum() <= 0:
            return
        decay = policy.history_decay
        self.load = now if self.load is None else decay * self.load + (1 - decay) * now
        self.decide_next = policy.enabled

    def _sync(self, grid) -> None:
        key = (id(grid.group), grid.group.generation)
        if key != self.grid_key:  # a new grid (launched, or rebuilt in place, after a loss): no copies there
            if self.move is not None:
                self.move["task"].cancel()
                self.move = None
            self.grid_key, self.table = key, [[] for _ in range(grid.ep)]

    def start(self, grid, policy: ReplicationPolicy) -> bool:
        """Decide a new copy table and start fetching what it lacks (none while a move is under way). Returns
        whether a move started."""
        self._sync(grid)
        self.decide_next = False
        if self.move is not None:
            return False
        home = list(grid.group.home)
        if not policy.enabled or self.load is None:
            table = [[] for _ in range(grid.ep)]
        else:
            table = copies_policy.place_copies(self.load, home, grid.ep, policy.spare_slots_per_rank, self.table,
                                               policy.moved_budget)
        if table == self.table:
            return False
        fetch = [sorted(set(new) - set(old)) for new, old in zip(table, self.table)]
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(grid.stage_copies, fetch))
        self.move = {"table": table, "fetch": fetch, "task": task, "t_decided": time.perf_counter(),
                     "decided_at": time.time(), "home": home,
                     "balancedness_before": self.balancedness(home, self.table),
                     "balancedness_planned": self.balancedness(home, table)}
        log.info("serving placement: move decided, copies %s, fetching %s", table, fetch)
        return True

    @property
    def fetched(self) -> bool:
        """Whether a move's fetches all ended: it switches at the next boundary (`ready`)."""
        return self.move is not None and self.move["task"].done()

    def ready(self, grid) -> list[list[int]] | None:
        """At an iteration boundary: the table to switch to now (every fetch of the move ended), else None. EP
        ranks whose fetch failed switch to the old table's copies that the new one keeps."""
        self._sync(grid)
        move = self.move
        if move is None or not move["task"].done():
            return None
        self.move = None
        try:
            fetched = move["task"].result()
        except Exception as err:  # noqa: BLE001 - the fetch itself broke: the move is dropped
            fetched = {e: f"{type(err).__name__}: {err}" for e, f in enumerate(move["fetch"]) if f}
        failed = {e: why for e, why in fetched.items() if isinstance(why, str)}
        table = [sorted(set(new) & set(old)) if e in failed else new
                 for e, (new, old) in enumerate(zip(move["table"], self.table))]
        record = {"decided_at": move["decided_at"], "copies": table,
                  "fetched": {e: f for e, f in enumerate(move["fetch"]) if f and e not in failed},
                  "bytes_moved": sum(b for b in fetched.values() if not isinstance(b, str)),
                  "failed": failed, "balancedness_before": move["balancedness_before"],
                  "balancedness_after": self.balancedness(move["home"], table),
                  "t_decided": move["t_decided"]}
        for e, why in failed.items():
            log.warning("serving placement: EP rank %d's copies %s dropped: %s", e, move["fetch"][e], why)
        return record

    def switched(self, record: dict, iteration: int) -> None:
        """The grid uses record's table from `iteration` on."""
        self.table = record["copies"]
        record["switched_at_iteration"] = iteration
        record["seconds_decision_to_switch"] = time.perf_counter() - record.pop("t_decided")
        self.moves = [*self.moves[-(MOVES_KEPT - 1):], record]

    def balancedness(self, home: list[int], table: list[list[int]]) -> float | None:
        return None if self.load is None else copies_policy.balancedness(self.load, home, table)

    def view(self, grid) -> dict:
        """Per-expert load (decayed), homes, copies, each expert's holders, each rank's load under the table and
        home only, balancedness (mean / max rank load) both ways, the move under way and the finished ones."""
        self._sync(grid)
        home = list(grid.group.home)
        no_copies = [[] for _ in range(grid.ep)]
        loads = None if self.load is None else copies_policy.rank_loads(self.load, home, self.table).tolist()
        return {"expert_load": None if self.load is None else self.load.tolist(), "home": home,
                "copies": self.table, "holders": copies_policy.holders_of(home, self.table),
                "rank_load": loads, "balancedness": self.balancedness(home, self.table),
                "balancedness_home_only": self.balancedness(home, no_copies),
                "moving": None if self.move is None else {"copies": self.move["table"], "fetch": self.move["fetch"]},
                "moves": [dict(m) for m in self.moves]}
