"""The placement table the controller owns: which EP rank is home to each expert (the same for every stage), which
EP ranks hold copies of hot experts in spare slots (k3ray.policies.copies), the live EP size, and the decayed
per-expert load that periodic re-homing and copy placement plan from (k3ray.policies.replication).

Interface: `track` every accepted step, `expert_load` for recovery decisions, `rebalance_on_schedule` after each
step (`rebalance` when due), `rehome` to move experts (shards travel with their optimizer moments), `reset` after a
resize, `drop_copies` after a restore, `view` for status. Workers drop their copies whenever their weights or homes
are replaced (a restore, a re-homing), so the table here follows: copies come back at the next rebalance."""
from __future__ import annotations

import logging

import torch

from k3ray.config import JobConfig
from k3ray.jobs.incidents import IncidentLog
from k3ray.parallel import shards
from k3ray.policies import copies as copies_policy
from k3ray.policies import recovery, replication

log = logging.getLogger("k3ray.controller")


class Placement:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.ep = cfg.parallel.ep  # live EP size: smaller than configured while shrunk
        self.home: list[int] = recovery.grow(cfg.model.n_experts, cfg.parallel.ep).tolist()
        self.load_history: torch.Tensor | None = None  # [E] decayed tokens per expert
        self.copies: list[list[int]] = [[] for _ in range(self.ep)]  # EP rank -> experts it holds copies of

    def reset(self, ep: int, home: list[int]) -> None:
        self.ep, self.home = ep, list(home)
        self.drop_copies()

    def drop_copies(self) -> None:
        self.copies = [[] for _ in range(self.ep)]

    def track(self, report: dict) -> None:
        decay = self.cfg.policies.replication.history_decay
        now = _expert_totals(report, self.cfg.model.n_experts)
        self.load_history = now if self.load_history is None else decay * self.load_history + (1 - decay) * now

    def expert_load(self, last_report: dict | None) -> torch.Tensor:
        """[E] tokens per expert in the last step, plus one (so unused experts still count)."""
        load = torch.ones(self.cfg.model.n_experts, dtype=torch.float64)
        return load if last_report is None else load + _expert_totals(last_report, self.cfg.model.n_experts)

    def rebalance(self, group) -> tuple[list[int], list[list[int]]]:
        """Persistent placement from the load history, within the migration budget: experts re-homed (the
        replication policy with one slot per expert; skipped while shrunk when the EP size does not divide the
        experts), then copies of hot experts in `spare_slots_per_rank` spare slots per rank. With copies in place
        each step's tokens of an expert are split over its holders; without, MoonEP balances each micro-batch on
        top. Returns the experts moved and the copy table now in use."""
        policy = self.cfg.policies.replication
        moved = self._rehome_from_history(group)
        table = [[] for _ in range(self.ep)]
        if policy.spare_slots_per_rank > 0 and self.load_history is not None:
            table = copies_policy.place_copies(self.load_history, self.home, self.ep, policy.spare_slots_per_rank,
                                               self.copies, policy.moved_budget)
        if table != self.copies:
            group.call("set_trained_copies", table)
            self.copies = table
        return moved, self.copies

    def rebalance_on_schedule(self, group, step: int, incidents: IncidentLog) -> None:
        """After `step - 1` was accepted: `rebalance` where the replication policy is on and due (every
        `every_n_steps` steps); a placement that changed is an incident."""
        policy = self.cfg.policies.replication
        if not policy.enabled or step % policy.every_n_steps:
            return
        before = self.copies
        moved, copies = self.rebalance(group)
        if moved or copies != before:
            incidents.record("rebalance", step=step, moved=moved, copies=copies)
            log.info("rebalance at step %d moved experts %s, copies %s", step, moved, copies)

    def _rehome_from_history(self, group) -> list[int]:
        E, R = self.cfg.model.n_experts, self.ep
        if E % R or self.load_history is None:
            return []
        per = E // R
        current = torch.tensor(sorted(range(E), key=lambda e: (self.home[e], e)))  # physical slot -> expert
        plan = replication.rebalance(self.load_history, R, E, moved_budget=self.cfg.policies.replication.moved_budget,
                                     current=current)
        new_home = [0] * E
        for slot, e in enumerate(plan.physical_to_logical.tolist()):
            new_home[e] = slot // per
        moved = [e for e in range(E) if new_home[e] != self.home[e]]
        if moved:
            self.rehome(group, new_home)
        return moved

    def rehome(self, group, new_home: list[int]) -> None:
        """Move every expert whose home changes, in every stage: its rows leave the old home's shard (weights and
        optimizer moments) and join the new home's."""
        ep = self.ep
        for p in range(self.cfg.parallel.pp):
            imports: list[dict] = [{} for _ in range(ep)]
            leaving = {src: [e for e in range(len(new_home)) if self.home[e] == src and new_home[e] != src]
                       for src in range(ep)}
            exported = group.call_each("export_shard", {p * ep + src: (ids,) for src, ids in leaving.items() if ids})
            for rank, payloads in exported.items():
                ids = leaving[rank - p * ep]
                for layer, payload in payloads.items():
                    for dst in sorted({new_home[e] for e in ids}):
                        part = shards.select_experts(payload, {e for e in ids if new_home[e] == dst})
                        imports[dst].setdefault(layer, []).append(part)
            group.call_each("set_placement", {p * ep + r: (new_home, imports[r] or None) for r in range(ep)})
        self.home = list(new_home)
        group.home = list(new_home)
        self.drop_copies()  # the workers dropped theirs with their new homes

    def view(self, last_report: dict | None) -> dict:
        experts_of = {r: [e for e, h in enumerate(self.home) if h == r] for r in range(self.ep)}
        return {"home": list(self.home), "experts_of_ep_rank": experts_of, "copies": [list(c) for c in self.copies],
                "holders": copies_policy.holders_of(self.home, self.copies),
                "rank_load": None if last_report is None else last_report["rank_load"]}


def _expert_totals(report: dict, num_experts: int) -> torch.Tensor:
    """[E] tokens routed to each expert over every MoE layer of a step report."""
    total = torch.zeros(num_experts, dtype=torch.float64)
    for rows in report["tokens_per_expert"].values():
        total += torch.tensor(rows, dtype=torch.float64).sum(0)
    return total
