"""Training fault drills (`fault_tolerance.faults`, `k3ray drill`): faults injected from outside the training code.

The FaultInjector is a controller callback: it fires each configured fault (kinds: k3ray.faults.TRAINING_FAULTS)
through `k3ray.faults.inject`, or truncates a committed checkpoint part. Below it, the randomized training drills
that tests/test_drills.py and benchmarks/drill_campaign.py run (serving drills: k3ray.serve.drills).
"""
from __future__ import annotations

import logging
import random

import ray

from k3ray.config import FaultSpec
from k3ray.faults import SNAPSHOT_PHASES, clear, inject

log = logging.getLogger("k3ray.controller")


class FaultInjector:
    """Fires each configured drill once at its step: one per attempt, so a drill listed twice hits the retry too."""

    def __init__(self, faults: list[FaultSpec]):
        self.pending = list(enumerate(faults))
        self.fired: set[int] = set()
        self.poisoned = False  # a NaN drill is armed on the workers for the current attempt

    def before_attempt(self, group, step: int, settle) -> None:
        """Fire the next drill due during this step. `settle()` waits for the boundary's snapshot first, so that
        drills that hit during the step (kill, hang) have a reproducible outcome."""
        for i, fault in self.pending:
            if fault.step != step or i in self.fired or fault.kind == "corrupt_checkpoint" or fault.at != "step":
                continue  # corrupt_checkpoint: at commit; other kills: where `at` says
            self.fired.add(i)
            log.warning("fault drill: %s at step %d", fault.kind, step)
            if fault.kind in ("kill_worker", "hang_collective"):
                settle()
            inject(group, fault.kind, fault.workers or [fault.worker or 0], fault.layer)
            self.poisoned = fault.kind == "nan"
            return

    def kill_at(self, group, step: int, at: str, settle=None) -> None:
        """Fire the kill_worker drills due at this point: `at` is "boundary" (of `step`; the snapshot-phase kills are
        armed there, after `settle()` has waited for the previous snapshot, so that this boundary's is taken, not
        skipped), "after_step" (`step` done) or "relaunch" (a new grid just launched at the boundary of `step`)."""
        for i, fault in self.pending:
            due = fault.step <= step if at == "relaunch" else fault.step == step
            armed = at == "boundary" and fault.at in SNAPSHOT_PHASES  # dies in that phase of the boundary's snapshot
            if fault.kind == "kill_worker" and (fault.at == at or armed) and due and i not in self.fired:
                self.fired.add(i)
                log.warning("fault drill: kill_worker %s at step %d", fault.at, step)
                if armed:
                    settle()
                inject(group, "kill_worker", fault.workers or [fault.worker or 0],
                       phase=fault.at if armed else None)

    def after_attempt(self, group) -> None:
        if self.poisoned:
            self.poisoned = False
            clear(group)

    def on_checkpoint(self, step: int, path, parts: list, seconds: float) -> None:
        """Truncate the first part of the first checkpoint committed at or after a corrupt_checkpoint drill's step."""
        for i, fault in self.pending:
            if fault.kind == "corrupt_checkpoint" and fault.step <= step and i not in self.fired:
                self.fired.add(i)
                victim = path / parts[0].name
                victim.write_bytes(victim.read_bytes()[: parts[0].bytes // 2])
                log.warning("fault drill: truncated %s", victim)


# Randomized training drills (tests/test_drills.py, benchmarks/drill_campaign.py): pp=1 x ep=4 in float64, snapshots
# and checkpoints every 3 steps; each drill runs only as many steps as put its faults in their state and see the job
# through the recovery, and its losses must equal the unfailed run's first losses.
DRILL_STEPS, SNAPSHOT_EVERY, CHECKPOINT_EVERY = 8, 3, 3  # DRILL_STEPS: the most a drill runs (its reference's)
FAULT_BEFORE = 5  # faults land in steps 1-4: every state exists by then (the first snapshot at 3, commit at 4)
# where a kill lands: the state the controller is in when it meets the dead worker
# (a kill in a phase of a snapshot: entering its staging, mid-stream, after it streamed, before the commit)
SNAPSHOT_STATES = ("snapshot_stage", "snapshot_stream", "snapshot_commit")
DRILL_STATES = ("step", "snapshot", *SNAPSHOT_STATES, "checkpoint_commit", "evaluation", "policy_change", "grow_back",
                "recovery", "second_at_commit")
TWO_FAULTS = ("grow_back", "recovery", "second_at_commit")  # a first loss, then a second close after it
NODE_STATES = ("step", "snapshot", "checkpoint_commit", "evaluation", "policy_change")  # a node dies between steps
DRILL_KINDS = ("worker", "two_workers", "node")


def drill_overrides(checkpoint_dir: str, faults=()) -> dict:
    """configs/tiny.yaml's overrides for a randomized training drill (and, without faults, for its unfailed run)."""
    return {"parallel.pp": 1, "parallel.ep": 4, "train.eval_every": 0, "model.dtype": "float64",
            "parallel.collective_timeout_s": 10, "policies.guards.warmup_steps": 100,
            "fault_tolerance.snapshot_every": SNAPSHOT_EVERY, "fault_tolerance.grow_back_after_steps": 1,
            "checkpoint.dir": checkpoint_dir, "checkpoint.every_n_steps": CHECKPOINT_EVERY,
            "checkpoint.at_end": False, "fault_tolerance.faults": list(faults)}


def plan(seed: int, kinds=DRILL_KINDS) -> dict:
    """A training drill: kind, state, the step it lands at, the fault specs that make it happen and the steps to run
    (the fault's step and enough after it for the recovery, and a grow-back's second loss, to be seen through)."""
    rng = random.Random(seed)
    kind = rng.choice(kinds)
    state = rng.choice(NODE_STATES if kind == "node" else DRILL_STATES)
    ranks = rng.sample(range(4), 2 if kind == "two_workers" else 1)
    if state == "snapshot" or state in SNAPSHOT_STATES:
        step = rng.choice(range(SNAPSHOT_EVERY, FAULT_BEFORE, SNAPSHOT_EVERY))
    elif state in ("checkpoint_commit", "second_at_commit"):  # parts written at a boundary commit at the next
        step = rng.choice(range(CHECKPOINT_EVERY + 1, FAULT_BEFORE, CHECKPOINT_EVERY))
    else:  # a grow-back's second loss comes a step later
        step = rng.randrange(2 if state in ("grow_back", "recovery") else 1, FAULT_BEFORE - 1)
    faults = []
    if kind != "node":
        at = {"step": "step", "evaluation": "after_step", **{s: s for s in SNAPSHOT_STATES}}.get(state, "boundary")
        if state in ("grow_back", "recovery"):  # a first loss, then one in the grid launched to recover or grow back
            faults.append({"kind": "kill_worker", "step": step, "worker": 3})
            at, ranks = "relaunch", [rng.randrange(2 if state == "recovery" else 4)]
            step += 1 if state == "grow_back" else 0
        if state == "second_at_commit":  # a loss during the step before a checkpoint commit abandons that commit;
            # a second at the next boundary, where the shrunk grid commits (and writes the checkpoint again)
            faults.append({"kind": "kill_worker", "step": step - 1, "worker": rng.randrange(4)})
            at, ranks = "boundary", [rng.randrange(3)]
        faults.append({"kind": "kill_worker", "step": step, "workers": sorted(ranks), "at": at})
    # a lost node may finish its step and be met at the next; a grow-back launches its grid a step after `step`
    steps = min(DRILL_STEPS, step + (3 if state == "grow_back" else 2) + (kind == "node"))
    return {"seed": seed, "kind": kind, "state": state, "step": step, "faults": faults, "steps": steps}


def run_drill(controller, drill: dict | None, steps: int, lose_node=None) -> tuple[list[float], list[dict]]:
    """Steps 0..steps-1 of a job's controller with the drill's outside actions (a node lost, a policy pushed, an
    evaluation); its own kills fire from the job's fault specs. The losses and the job's incidents."""
    losses = []
    for s in range(steps):
        if drill and drill["kind"] == "node" and s == drill["step"] and drill["state"] != "evaluation":
            if drill["state"] == "policy_change":
                ray.get(controller.set_policy.remote("moonep", {"enabled": True}, "drill"))
            lose_node()
        if drill and drill["state"] == "policy_change" and drill["kind"] != "node" and s == drill["step"]:
            ray.get(controller.set_policy.remote("moonep", {"enabled": True}, "drill"))  # pushed at the boundary
        losses.append(ray.get(controller.train_step.remote(s), timeout=600)["loss"])
        if drill and drill["state"] == "evaluation" and s == drill["step"]:
            if drill["kind"] == "node":
                lose_node()
            if not ray.get(controller.evaluate.remote(), timeout=600) > 0:
                raise RuntimeError(f"the evaluation after step {s} returned no loss")
    return losses, ray.get(controller.get_incidents.remote())
