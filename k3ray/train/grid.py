"""The training job's worker grid (`TrainingGrid`): the worker group in use, how the next one is made (the group
factory, never on a node found silent), a step run on it with the workers' reports merged into one, and a grid that
has just taken the snapshot's state brought up to date. The controller, its recovery and its scaling parts share
it: a recovery or a resize puts a new group in place, and the step loop runs on whichever group is there."""
from __future__ import annotations

from k3ray.config import JobConfig
from k3ray.grid.snapshots import Snapshots
from k3ray.parallel.step import StepReport
from k3ray.train.drills import FaultInjector
from k3ray.train.placement import Placement
from k3ray.train.progress import TrainingProgress


class TrainingGrid:
    def __init__(self, cfg: JobConfig, factory, table: Placement, progress: TrainingProgress, snapshots: Snapshots,
                 drills: FaultInjector):
        self.cfg, self.factory = cfg, factory  # factory: (cfg, ep, home, avoid_nodes) -> a worker group
        self.table, self.progress, self.snapshots, self.drills = table, progress, snapshots, drills
        self.group = None
        self.avoid_nodes: set[str] = set()  # nodes found silent (Ray may still report them alive): never placed on

    def new_group(self, ep: int, home: list[int]):
        return self.factory(self.cfg, ep, home, frozenset(self.avoid_nodes))

    def run(self, step: int, batch: int) -> dict:
        """`step` on `batch` on the grid: the workers' reports merged into one (no guards, no bookkeeping)."""
        reports = self.group.run_step(step, batch, self.cfg.parallel.collective_timeout_s + 30.0)
        return merge_reports(step, batch, reports, self.table.ep, self.cfg.step_tokens()).to_dict()

    def push_policies(self) -> None:
        self.group.call("set_policies", self.cfg.policies.model_dump())

    def joined(self) -> None:
        """A grid that has just taken the snapshot's (or the start point's) state, recovered or resized: drills due
        on it, live policies, the learning-rate scale, the neighbours' snapshot copies."""
        self.drills.kill_at(self.group, self.progress.step, "relaunch")
        self.push_policies()
        self.group.call("set_lr_scale", self.progress.lr_scale)
        snaps = self.snapshots
        # a store that holds one snapshot has no room for the neighbours' copies; the start point has none
        if snaps.committed.refs and not snaps.one_at_a_time:  # mapped again by the new grid's neighbours
            self.group.transfer.hold_peer_snapshots(snaps.committed.step, snaps.committed.refs)


def merge_reports(step: int, batch_index: int, reports: list[dict], ep: int, tokens: int) -> StepReport:
    """The step report of a grid with `ep` EP ranks per stage from its workers' reports (world-rank order)."""
    tpe, rank_load, balance, acts = {}, {}, {}, {}
    for i, r in enumerate(reports):
        if i % ep == 0:  # every EP rank of a stage holds the same gathered counts
            tpe.update(r["tokens_per_expert"])
            rank_load.update(r["rank_load"])
            balance.update(r.get("balance", {}))
        for layer, a in r["activations"].items():
            prev = acts.get(layer)
            acts[layer] = a if prev is None else {k: max(prev[k], a[k]) for k in a}
    phases = reports[0]["timings"].keys()
    timings = {k: max(r["timings"][k] for r in reports) for k in phases}
    return StepReport(step=step, batch_index=batch_index, loss=reports[0]["loss"], grad_norm=reports[0]["grad_norm"],
                      lr=reports[0]["lr"], tokens=tokens, tokens_per_expert=tpe, activations=acts, timings=timings,
                      rank_load=rank_load, balance=balance)
