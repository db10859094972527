"""Randomized fault drills: workers killed (one, two at once, or a whole node of a two-raylet cluster) at random steps
and in random controller states, or two losses close together (the second during the recovery from the first, during
a grow-back, or at the checkpoint commit after it); every drilled run must end with the float64 losses of the
unfailed run (survivors take over the lost ranks' micro-batches, so the global batch never changes; bound as in
test_faults).

Seeds are printed; K3RAY_DRILL_SEED=<seed>[,<seed>...] replays drills, K3RAY_DRILLS=<n> runs more random ones,
K3RAY_DRILL_KINDS picks the kinds drawn from."""
from __future__ import annotations

import os
import random

import pytest
import ray

from k3ray.config import load_config
from k3ray.control.driver import running_job
from k3ray.control.local_nodes import head_room, kill_node

STEPS, SNAPSHOT_EVERY, CHECKPOINT_EVERY = 8, 3, 3
# where a kill lands: the state the controller is in when it meets the dead worker
STATES = ("step", "snapshot", "checkpoint_commit", "evaluation", "policy_change", "grow_back", "recovery",
          "second_at_commit")
TWO_FAULTS = ("grow_back", "recovery", "second_at_commit")  # a first loss, then a second close after it
NODE_STATES = ("step", "snapshot", "checkpoint_commit", "evaluation", "policy_change")  # a node dies between steps
KINDS = tuple(os.environ.get("K3RAY_DRILL_KINDS", "worker,two_workers,node").split(","))


def tiny(tmp_path, faults=()):
    return load_config("configs/tiny.yaml", {
        "parallel.pp": 1, "parallel.ep": 4, "train.eval_every": 0, "model.dtype": "float64",
        "parallel.collective_timeout_s": 10, "policies.guards.warmup_steps": 100,
        "fault_tolerance.snapshot_every": SNAPSHOT_EVERY, "fault_tolerance.grow_back_after_steps": 1,
        "checkpoint.dir": str(tmp_path / "ckpt"), "checkpoint.every_n_steps": CHECKPOINT_EVERY,
        "checkpoint.at_end": False, "fault_tolerance.faults": list(faults)})


def plan(seed: int) -> dict:
    """A drill: kind, state, the step it lands at, and the fault specs that make it happen."""
    rng = random.Random(seed)
    kind = rng.choice(KINDS)
    state = rng.choice(NODE_STATES if kind == "node" else STATES)
    ranks = rng.sample(range(4), 2 if kind == "two_workers" else 1)
    if state == "snapshot":
        step = rng.choice(range(SNAPSHOT_EVERY, STEPS, SNAPSHOT_EVERY))
    elif state in ("checkpoint_commit", "second_at_commit"):  # parts written at a boundary commit at the next
        step = rng.choice(range(CHECKPOINT_EVERY, STEPS - 1, CHECKPOINT_EVERY)) + 1
    else:
        step = rng.randrange(2 if state in ("grow_back", "recovery") else 1, STEPS - 2)
    faults = []
    if kind != "node":
        at = {"step": "step", "evaluation": "after_step"}.get(state, "boundary")
        if state in ("grow_back", "recovery"):  # a first loss, then one in the grid launched to recover or grow back
            faults.append({"kind": "kill_worker", "step": step, "worker": 3})
            at, ranks = "relaunch", [rng.randrange(2 if state == "recovery" else 4)]
            step += 1 if state == "grow_back" else 0
        if state == "second_at_commit":  # a loss during the step before a checkpoint commit abandons that commit;
            # a second at the next boundary, where the shrunk grid commits (and writes the checkpoint again)
            faults.append({"kind": "kill_worker", "step": step - 1, "worker": rng.randrange(4)})
            at, ranks = "boundary", [rng.randrange(3)]
        faults.append({"kind": "kill_worker", "step": step, "workers": sorted(ranks), "at": at})
    return {"seed": seed, "kind": kind, "state": state, "step": step, "faults": faults}


def seeds() -> list[int]:
    if os.environ.get("K3RAY_DRILL_SEED"):
        return [int(seed) for seed in os.environ["K3RAY_DRILL_SEED"].split(",")]
    return [random.randrange(2**31) for _ in range(int(os.environ.get("K3RAY_DRILLS", "2")))]


def train(cfg, drill: dict | None = None, lose_node=None) -> tuple[list[float], list[dict]]:
    with running_job(cfg) as controller:
        losses = []
        for s in range(STEPS):
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
                assert ray.get(controller.evaluate.remote(), timeout=600) > 0
        return losses, ray.get(controller.get_incidents.remote())


@pytest.fixture(scope="module")
def unfailed(unfailed_ep4):
    return unfailed_ep4.losses[:STEPS]


@pytest.mark.parametrize("seed", seeds())
def test_random_drill_ends_with_the_unfailed_losses(ray_cluster, extra_nodes, unfailed, tmp_path, seed):
    drill = plan(seed)
    print(f"drill seed {seed}: {drill}")  # replay: K3RAY_DRILL_SEED={seed}
    if drill["kind"] == "node":  # 2 workers on the head, 2 on a node of their own
        node = extra_nodes(2)
        with head_room(2):
            losses, incidents = train(tiny(tmp_path, drill["faults"]), drill, lambda: kill_node(node))
    else:
        losses, incidents = train(tiny(tmp_path, drill["faults"]), drill)
    lost = [i for i in incidents if i["kind"] == "worker_lost"]
    assert lost, incidents
    if drill["kind"] != "worker" and drill["state"] not in TWO_FAULTS:
        assert len(lost[0]["ranks"]) == 2, lost  # both ranks of the pair or of the node, found together
    assert losses == pytest.approx(unfailed, rel=1e-12, abs=0), (drill, incidents)
