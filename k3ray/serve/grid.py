"""The serving engine's worker grid (plain Python, owned by the ServingEngine actor): launch it from the loaded
checkpoint, run iterations on it, and rebuild it when workers are lost.

Every grid is started from the checkpoint's weights held in the object store (k3ray.serve.launch). A lost worker
comes out of the one failure path of every call to workers (k3ray.grid.calls -> WorkerLost); what to do is
training's decision (`recovery.on_workers_lost`: carry on with the surviving EP columns, the lost experts re-homed
by load, or the same grid again when a whole column of every stage is gone; with hot spares, spares in the lost
ranks' places), carried out by the grid rebuild training's recovery uses too (k3ray.grid.rebuild, with serving's
steps: `RebuildFromWeights`). The grid is rebuilt in place around its surviving EP columns and ready spares (no
process started: seconds, whether or not a spare is up), else launched anew; either way its caches are new, so the
engine's scheduler prefills every unfinished request again (`Scheduler.reset`).

load [E]: routed tokens per expert served since the engine started (summed over layers), plus one.
"""
from __future__ import annotations

import logging
import time

import torch

from k3ray.config import JobConfig
from k3ray.serve.dag import ServingGraph
from k3ray.serve.launch import GridLauncher
from k3ray.grid.calls import TopologyError, WorkerLost
from k3ray.grid.rebuild import GridRebuild
from k3ray.grid.worker_group import WorkerGroup
from k3ray.parallel.serving import StageOutput
from k3ray.serve.decode_traffic import DecodeTraffic
from k3ray.policies import recovery

log = logging.getLogger("k3ray.serve")


class ServingGrid:
    def __init__(self, cfg: JobConfig, weights, launch_timeout_s: float = 300.0):
        """weights: the packed weights in the object store (k3ray.serve.launch.hold_weights), perhaps still being
        read: a launch's workers start meanwhile."""
        self.cfg, self.pp = cfg, cfg.parallel.pp  # cfg.serve resolved for the device
        self.launcher = GridLauncher(cfg, weights, launch_timeout_s)
        self.load = torch.ones(cfg.model.n_experts, dtype=torch.float64)
        self.group: WorkerGroup | None = None
        self.graph = ServingGraph()  # the iteration as a compiled graph of the group's workers
        self.traffic = DecodeTraffic()  # the decode shapes served: a grid started later captures their graphs first
        self.spares_due = False  # start spares again after the next iteration (they replaced lost workers)

    @property
    def ep(self) -> int:
        return self.group.ep

    def launch(self, ep: int, home: list[int] | None = None, wait_for_spares: bool = True,
               progress=None, started: WorkerGroup | None = None) -> dict[str, float]:
        """A grid of pp x ep workers holding the checkpoint's weights (experts homed by `home`, contiguous blocks by
        default) with empty cache pools, and its hot spares; progress(phase) as each phase of the launch ends.
        started: its pp x ep workers, placed and started already (k3ray.serve.launch.start_workers). Returns the
        launch's phases in seconds."""
        home = recovery.grow(self.cfg.model.n_experts, ep).tolist() if home is None else home
        if started is None:
            started = WorkerGroup(self.cfg, ep, home, serving=True)
        else:  # started before the homes were decided
            started.home = list(home)
        self.group = started
        self.group.on_phase = progress
        phases = self.launcher.start(self.group, wait_for_spares, self.traffic.ranked())
        self.group.start_standbys()  # once the grid can serve: their imports do not slow its start
        return phases

    def run(self, plans: dict) -> dict[int, StageOutput]:
        """One iteration: rank -> RankPlan in, rank -> its stages' merged answer out (WorkerLost if a worker is).
        After the first iteration on a recovered grid, the spares that replaced lost workers are started again."""
        return self.collect(self.submit(plans))

    def submit(self, plans: dict):
        """Start an iteration (rank -> RankPlan) while the one before may still run (serve.overlap); `collect` its
        answers, every iteration's, in the order submitted."""
        self.traffic.record(plans)
        return self.graph.submit(self.group, plans, self.cfg.parallel.collective_timeout_s)

    def collect(self, handle) -> dict[int, StageOutput]:
        """The answers of an iteration from `submit`, as `run`'s."""
        outs = self.graph.collect(self.group, handle, self.cfg.parallel.collective_timeout_s)
        if self.spares_due:
            self.spares_due = False
            self.group.resources.start_spares()
        return {e: StageOutput.merge(stages) for e, stages in outs.items()}

    def expert_load(self) -> list[dict[int, list[int]]]:
        """Every worker's routed-token counts (layer -> [E]) since the last call; kept for re-homing too."""
        loads = self.group.call("expert_load")
        for worker in loads:
            for counts in worker.values():
                self.load += torch.tensor(counts, dtype=torch.float64)
        return loads

    def stage_copies(self, fetch: list[list[int]]) -> dict[int, int | str]:
        """EP rank e's workers (every stage) fetch read-only copies of the experts fetch[e] from the held weights,
        beside the iterations (a worker's second thread). Per EP rank with something to fetch: the bytes fetched,
        or why it failed (its copies are then dropped; a lost worker is the iterations' to find and recover)."""
        out: dict[int, int | str] = {}
        for e, experts in enumerate(fetch):
            if not experts:
                continue
            try:
                got = self.group.call_each("stage_copies", {p * self.ep + e: (experts, self.launcher.weights)
                                                            for p in range(self.pp)})
                out[e] = sum(got.values())
            except Exception as err:  # noqa: BLE001 - a copy that did not arrive is dropped, nothing else changes
                out[e] = f"{type(err).__name__}: {err}"
        return out

    def use_copies(self, table: list[list[int]]) -> bool:
        """Every worker switches to the copy table (between two iterations)."""
        self.group.call("use_copies", table)
        return True

    def recover(self, lost: WorkerLost, progress=None, attempts: int = 3) -> dict:
        """Replace the grid that lost workers by the one the recovery policy decides on (k3ray.grid.rebuild): rebuilt
        in place, no process started, where EP columns survive (ready hot spares in the lost ranks' places, the
        columns still lost left out, their survivors standing by as spares), else (or when lost in its rendezvous)
        launched anew; loaded from the held weights (a worker lost meanwhile starts the decision again from the grid
        being built). progress(phase) as each phase ends ('replan', then those of WorkerGroup.launch_seconds), from
        this thread. Returns the incident's fields: lost ranks, EP size before and after, spares used, phases in
        seconds."""
        t0 = time.perf_counter()
        incident = {"ranks": sorted(lost.ranks), "why": lost.why, "ep": [self.group.ep]}
        rebuild = GridRebuild(RebuildFromWeights(self, incident), self.pp, bool(self.cfg.fault_tolerance.spares),
                              attempts=attempts, progress=progress)
        rebuilt = rebuild.run(lost, self.load)
        decision = rebuilt.decision
        self.group.start_standbys()
        self.spares_due = bool(decision.spare_for)
        incident["ep"].append(decision.ep)
        incident["action"] = decision.action
        incident["spares_used"] = sorted(decision.spare_for)
        incident["standbys_used"] = sorted(rebuilt.standbys_used)
        incident["seconds"] = {"replan": rebuilt.planned_at - t0, **rebuilt.phases, "total": time.perf_counter() - t0}
        return incident

    def relaunch(self, progress=None) -> dict:
        """The last resort after recoveries that failed: whatever grid there is goes, and one is launched anew from
        the held weights on what the alive nodes hold (the configured EP size at most, experts in contiguous
        blocks); progress(phase) as `recover`'s. Returns the incident's fields, as `recover`'s."""
        progress = progress or (lambda phase: None)
        t0 = time.perf_counter()
        before = self.group.ep if self.group is not None else 0
        self.close()
        probe = WorkerGroup(self.cfg, 1, [0] * self.cfg.model.n_experts)  # no workers: counts what the nodes hold
        held = probe.alive_nodes.capacity()
        ep = min(self.cfg.parallel.ep, held // self.pp)
        if ep < 1:
            raise TopologyError(f"the alive nodes hold no {self.pp}-stage grid ({held} workers)")
        t_planned = time.perf_counter()
        progress("replan")
        phases = self.launch(ep, wait_for_spares=False, progress=progress)
        self.group.on_phase = None
        self.spares_due = False
        return {"ep": [before, ep], "action": "relaunch", "spares_used": [],
                "seconds": {"replan": t_planned - t0, **phases, "total": time.perf_counter() - t0}}

    def launch_beside(self, ep: int) -> tuple[WorkerGroup, dict] | None:
        """A pp x ep grid launched from the held weights while this one serves on (`adopt` switches to it), or None
        where the alive nodes have no room for both. TopologyError where a pp x ep grid cannot serve: ep does not
        divide the experts, or the alive nodes cannot hold it. A failure leaves this grid as it was."""
        experts = self.cfg.model.n_experts
        if ep < 1 or experts % ep:
            raise TopologyError(f"ep={ep} does not divide model.n_experts={experts}")
        held = self.group.alive_nodes.capacity()
        if self.pp * ep > held:
            raise TopologyError(f"ep={ep}: the alive nodes hold {held} workers, a {self.pp} x {ep} grid needs "
                                f"{self.pp * ep}")
        if not self.group.alive_nodes.room_for(self.pp * ep):
            return None
        t0 = time.perf_counter()
        group = WorkerGroup(self.cfg, ep, recovery.grow(experts, ep).tolist(), serving=True)
        try:
            phases = self.launcher.start(group, wait_for_spares=False, traffic=self.traffic.ranked())
        except BaseException:
            group.close()
            raise
        return group, {**phases, "launched_beside": time.perf_counter() - t0}

    def adopt(self, group: WorkerGroup, phases: dict) -> dict:
        """Serve on `group` (from `launch_beside`) from the next iteration; the old grid goes. The incident's
        fields."""
        t0, before = time.perf_counter(), self.group.ep
        self.close()
        self.group = group
        self.group.start_standbys()
        self.cfg.parallel = self.cfg.parallel.model_copy(update={"ep": group.ep})  # relaunches aim at this size
        self.spares_due = bool(self.cfg.fault_tolerance.spares)
        return {"ep": [before, group.ep], "action": "resize beside",
                "seconds": {**phases, "switch": time.perf_counter() - t0}}

    def resize(self, ep: int) -> dict:
        """A planned change of the EP size where no second grid fits beside this one, through a relaunch's path: the
        grid goes and one of pp x ep is launched from the held weights (serving pauses meanwhile). Returns the
        incident's fields, as `recover`'s."""
        t0 = time.perf_counter()
        before = self.group.ep
        self.close()
        t_planned = time.perf_counter()
        phases = self.launch(ep, wait_for_spares=False)
        self.cfg.parallel = self.cfg.parallel.model_copy(update={"ep": ep})  # relaunches aim at this size
        self.spares_due = bool(self.cfg.fault_tolerance.spares)
        return {"ep": [before, ep], "action": "resize",
                "seconds": {"replan": t_planned - t0, **phases, "total": time.perf_counter() - t0}}

    def close(self) -> None:
        self.graph.drop()
        if self.group is not None:
            self.group.close()


class RebuildFromWeights:
    """Serving's side of a grid rebuild (k3ray.grid.rebuild.RebuildSteps): every grid, rebuilt in place or launched
    anew, loads the held weights and gets new cache pools (their decode graphs those of the traffic served); each
    decision is logged, and each build that did not finish is named in the incident's `interrupted`."""

    def __init__(self, grid: ServingGrid, incident: dict):
        self.grid, self.incident = grid, incident

    @property
    def group(self) -> WorkerGroup:
        return self.grid.group

    def planned(self, lost: WorkerLost, old_ep: int, decision: recovery.LossDecision,
                standbys_used: frozenset[int]) -> None:
        log.warning("serving: %s; %s on pp=%d x ep=%d (%s)", lost,
                    f"rebuilt in place, {len(decision.spare_for)} hot spares in lost places" if decision.in_place
                    else "relaunching", self.grid.pp, decision.ep, decision.action)

    def regroup(self, lost: set[int], decision: recovery.LossDecision, on_phase) -> dict[str, float]:
        grid = self.grid
        grid.group.on_phase = on_phase
        grid.group.regroup(lost, decision.ep, decision.home.tolist(), list(decision.keep), set(decision.spare_for),
                           grid.launcher.sources(), grid.launcher.timeout_s)
        return {**grid.group.launch_seconds, **grid.launcher.cache_pools(grid.group, grid.traffic.ranked())}

    def launch(self, decision: recovery.LossDecision, on_phase) -> dict[str, float]:
        return self.grid.launch(decision.ep, decision.home.tolist(), wait_for_spares=False, progress=on_phase)

    def failed(self, err: TopologyError | WorkerLost) -> None:
        self.incident.setdefault("interrupted", []).append(str(err))
