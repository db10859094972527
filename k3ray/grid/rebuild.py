"""A worker grid rebuilt after lost workers (`GridRebuild`), the one routine training's recovery and serving's share.

The recovery policy decides (k3ray.policies.recovery.on_workers_lost: with the hot spares ready, the standbys up and,
where the job asks, whether a lost rank's node went). Where the decision keeps EP columns in place the grid is rebuilt
around them (`WorkerGroup.regroup`: survivors keep their processes, spares and standbys take the lost places, no
process started); else the old grid is closed and one is launched anew, planned on what the alive nodes hold: on their
totals first (the grid just closed gave its resources back and Ray's free counts lag; a worker lost while a grid was
being built is no reason to doubt them), on what is free once a launch's placement failed (a lost node not yet reported
dead, or resources other jobs hold). A build that does not fit (TopologyError) is decided again, a few times; a worker
lost in the grid being built (WorkerLost) starts the decision again from that grid, or, where the job has its own loop
for it (training's state machine, from a fresh snapshot), goes to the job.

What differs between the jobs is passed in as their `RebuildSteps`: how a grid is rebuilt in place and launched anew
(training restores its snapshot; serving loads the held weights and makes cache pools) and what a decision and a build
that did not finish record (training an incident per decision; serving one incident and a log line).

load [E]: recent routed tokens per expert (any scale), for re-homing the lost ranks' experts."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from k3ray.grid.calls import TopologyError, WorkerLost
from k3ray.grid.worker_group import WorkerGroup
from k3ray.policies import recovery
from k3ray.policies.recovery import LossDecision


class RebuildSteps(Protocol):
    """A job's side of a rebuild. on_phase(phase): to be called as each phase of the build ends (the group's
    `on_phase`): it tells the rebuild whether a grid lost while being built had begun its rendezvous."""

    @property
    def group(self) -> WorkerGroup:
        """The grid in use: the one that lost workers, then the one being built."""

    def planned(self, lost: WorkerLost, old_ep: int, decision: LossDecision, standbys_used: frozenset[int]) -> None:
        """A decision taken for a grid of `old_ep` EP ranks per stage, before its build."""

    def regroup(self, lost: set[int], decision: LossDecision, on_phase: Callable[[str], None]) -> dict[str, float]:
        """The grid in use rebuilt in place as `decision` says, its state restored. Returns its phases in seconds."""

    def launch(self, decision: LossDecision, on_phase: Callable[[str], None]) -> dict[str, float]:
        """A grid launched anew as `decision` says and put in use, its state restored. Returns its phases in
        seconds."""

    def failed(self, err: TopologyError | WorkerLost) -> None:
        """The build of the last decision did not finish: it did not fit, or a worker was lost in it."""


@dataclass(frozen=True)
class Rebuilt:
    """The grid in use after a rebuild: the decision it was built on, when that was planned (perf_counter), the
    build's phases in seconds and the lost ranks whose own standbys took their places."""
    decision: LossDecision
    planned_at: float
    phases: dict[str, float]
    standbys_used: frozenset[int]


class GridRebuild:
    def __init__(self, steps: RebuildSteps, pp: int, spares: bool, off_lost_nodes: bool = False,
                 decide_again_when_lost: bool = True, attempts: int = 3,
                 progress: Callable[[str], None] | None = None):
        """spares: the job runs hot spares (fault_tolerance.spares). off_lost_nodes: a grid a lost rank's node went
        with is launched anew off it, unless spares fill in (training's); serving rebuilds around what survives.
        decide_again_when_lost: a worker lost in the grid being built starts the decision again here (else the
        WorkerLost goes to the job). attempts: builds tried. progress(phase): 'replan' once decided, then the
        phases of each build as they end."""
        self.steps, self.pp, self.spares, self.off_lost_nodes = steps, pp, spares, off_lost_nodes
        self.decide_again_when_lost, self.attempts = decide_again_when_lost, attempts
        self.progress = progress or (lambda phase: None)
        self.joining = False  # the grid being built has begun its rendezvous (it reported a phase of its build)

    def run(self, lost: WorkerLost, load: torch.Tensor) -> Rebuilt:
        """Rebuild the grid in use (`steps.group`), which lost `lost`. TopologyError when the last attempt did not
        fit, when nothing fits the alive nodes, or when every attempt lost a worker."""
        old, in_place_ok, placement_failed = self.steps.group, True, False
        for attempt in range(1, self.attempts + 1):
            decision, standing_by = self._decide(old, lost, load, in_place_ok, placement_failed)
            in_place_ok = decision.in_place  # launched anew, `old` is closed: nothing to rebuild in place from
            planned_at, standbys_used = time.perf_counter(), decision.spare_for & standing_by
            self.progress("replan")
            self.steps.planned(lost, old.ep, decision, standbys_used)
            self.joining = False
            try:
                if decision.in_place:
                    phases = self.steps.regroup(lost.ranks, decision, self._phase_ended)
                else:
                    phases = self.steps.launch(decision, self._phase_ended)
            except WorkerLost as again:
                self.steps.failed(again)
                if not self.decide_again_when_lost:
                    raise
                # decided again from the grid being built, in place unless it was lost in its rendezvous: its
                # survivors may wait there for the lost worker (until parallel.collective_timeout_s), and a rebuild
                # around them would wait on them
                old, lost, in_place_ok = self.steps.group, again, not self.joining
                continue
            except TopologyError as err:
                self.steps.failed(err)
                if attempt == self.attempts:
                    raise
                if not decision.in_place:  # the placement failed: plan on what the alive nodes have free
                    self.steps.group.close()
                    placement_failed = True
                continue
            self.steps.group.on_phase = None
            return Rebuilt(decision, planned_at, phases, standbys_used)
        raise TopologyError(f"grid rebuild: {self.attempts} attempts interrupted, the last by {lost}")

    def _decide(self, old: WorkerGroup, lost: WorkerLost, load: torch.Tensor, in_place_ok: bool,
                free: bool) -> tuple[LossDecision, frozenset[int]]:
        """The recovery policy's decision for `old` having lost `lost`, and the lost ranks whose standbys are up: in
        place where it says so and `in_place_ok`; else `old` is closed (a grid that lost workers holds their places:
        the new one is planned on what it gives back) and the grid launched anew planned on the alive nodes' totals,
        or on what they have `free`."""
        spares = old.resources.spares_ready() if self.spares else 0
        standing_by = old.standing_by(lost.ranks)
        nodes_lost = self.off_lost_nodes and recovery.on_lost_nodes(old.nodes, lost.ranks, old.alive_nodes.healthy())
        home = torch.tensor(old.home)
        decision = recovery.on_workers_lost(home, old.ep, lost.ranks, load, spares=spares, nodes_lost=nodes_lost,
                                            standing_by=standing_by)
        if decision.in_place and in_place_ok:
            return decision, standing_by
        old.close()
        max_ep = old.alive_nodes.capacity(free=free) // self.pp
        if max_ep < 1:
            raise TopologyError(f"the alive nodes hold no {self.pp}-stage grid")
        return recovery.on_workers_lost(home, old.ep, lost.ranks, load, max_ep=max_ep), standing_by

    def _phase_ended(self, phase: str) -> None:
        self.joining = True
        self.progress(phase)
