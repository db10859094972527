"""The training job's worker grid (`TrainingGrid`): it owns the worker group in use, makes the next one (the group
factory, never on a node found silent), launches, rebuilds in place, restores and closes it, runs a step on it with
the workers' reports merged into one, and brings a grid that has just taken the snapshot's state up to date. The
controller, its recovery and its scaling parts share it: they ask it for a new group in place (a recovery, a resize),
and the step loop runs on whichever group is there."""
from __future__ import annotations

from k3ray.config import JobConfig
from k3ray.grid.snapshots import Snapshots
from k3ray.parallel.step import StepReport
from k3ray.policies.recovery import LossDecision
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

    def launch(self, ep: int, home: list[int], timeout_s: float, restore: dict | None = None,
               wait_for_spares: bool = True, on_phase=None) -> str:
        """A new group of pp x ep workers (experts homed by `home`) put in use and launched (`WorkerGroup.launch`),
        restored from `restore` (None: initialised from the seed); on_phase(phase) as each phase of its launch
        ends. Returns the backend."""
        self.group = self.new_group(ep, home)
        self.group.on_phase = on_phase
        return self.group.launch(timeout_s, restore=restore, wait_for_spares=wait_for_spares)

    def regroup(self, lost: set[int], decision: LossDecision, restore: dict, on_phase=None) -> None:
        """The group in use rebuilt in place as the recovery policy's `decision` says (`WorkerGroup.regroup`) and
        restored from `restore`; on_phase(phase) as each phase of the rebuild ends."""
        self.group.on_phase = on_phase
        self.group.regroup(lost, decision.ep, decision.home.tolist(), list(decision.keep), set(decision.spare_for),
                           restore, timeout_s=60.0)

    def restore_in_place(self, sources: dict | None) -> None:
        """Every worker of the group in use goes back to a snapshot's or checkpoint's state (`sources`) or, before the
        first snapshot of a job that started from its seed (None), takes its place again with its weights initialised
        from the seed (the grid rebuilt in place: same workers, same homes)."""
        if sources is not None:
            self.group.transfer.restore(sources)
            return
        ep, home = self.table.ep, list(self.table.home)
        self.group.regroup(set(), ep, home, list(range(ep)), set(), None, timeout_s=60.0)
        self.push_policies()  # the new engines hold the configured policies, not the live ones

    def avoid(self, nodes: set[str]) -> None:
        """Nodes found silent: never placed on again, neither by the group in use (its new spares) nor by later ones."""
        self.avoid_nodes |= nodes
        self.group.alive_nodes.avoid(nodes)

    def room_for(self, workers: int) -> bool:
        """Whether the alive nodes have room for `workers` more workers beside the places the group holds already
        (its spares' and standbys' included)."""
        return self.group.alive_nodes.room_for(max(0, workers - self.group.resources.places_held()))

    def after_step(self) -> None:
        """A step done: hot spares that replaced lost workers (or found no room before) and the standbys are
        started now, so that their imports slow neither a grid's start nor the recovery they follow."""
        if len(self.group.spares) < self.cfg.fault_tolerance.spares:
            self.group.resources.start_spares()
        self.group.start_standbys()

    def holdings(self) -> dict:
        """What the grid holds beside its workers: hot spares, standbys and how many of those are up."""
        if self.group is None:
            return {"spares": 0, "standbys": 0, "standbys_up": 0}
        standbys = self.group.resources.standbys
        return {"spares": len(self.group.spares), "standbys": len(standbys), "standbys_up": standbys.up_count()}

    def close(self) -> None:
        """The group in use stopped, its workers and what it holds given back; none is in use after."""
        if self.group is not None:
            self.group.close()
        self.group = None

    def run(self, step: int, batch: int, next_batch: int | None = None) -> dict:
        """`step` on `batch` on the grid: the workers' reports merged into one (no guards, no bookkeeping);
        `next_batch`: the next step's batch, which the workers may run ahead (k3ray.parallel.engine.StepAhead)."""
        reports = self.group.run_step(step, batch, self.cfg.parallel.collective_timeout_s + 30.0, next_batch)
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
