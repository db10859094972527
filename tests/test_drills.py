"""Randomized fault drills: workers killed (one, two at once, or a whole node of a two-raylet cluster) at random steps
and in random controller states, or two losses close together (the second during the recovery from the first, during
a grow-back, or at the checkpoint commit after it); every drilled run must end with the float64 losses of the
unfailed run (survivors take over the lost ranks' micro-batches, so the global batch never changes; bound as in
test_faults).

One random drill per run (each CI run draws another; benchmarks/drill_campaign.py runs them by the hundred).
Seeds are printed; K3RAY_DRILL_SEED=<seed>[,<seed>...] replays drills, K3RAY_DRILLS=<n> runs more random ones,
K3RAY_DRILL_KINDS picks the kinds drawn from."""
from __future__ import annotations

import os
import random

import pytest

from conftest import SMALL_BATCH
from k3ray.config import load_config
from k3ray.control.driver import running_job
from k3ray.control.local_nodes import head_room, kill_node
from k3ray.train.drills import DRILL_KINDS, DRILL_STEPS, TWO_FAULTS, drill_overrides, plan, run_drill

KINDS = tuple(os.environ.get("K3RAY_DRILL_KINDS", ",".join(DRILL_KINDS)).split(","))
STAGGERED = ("snapshot_stream", "snapshot_commit")  # two workers die as each reaches its point of its own stream


def tiny(tmp_path, faults=()):
    return load_config("configs/tiny.yaml", {**drill_overrides(str(tmp_path / "ckpt"), faults), **SMALL_BATCH})


def seeds() -> list[int]:
    if os.environ.get("K3RAY_DRILL_SEED"):
        return [int(seed) for seed in os.environ["K3RAY_DRILL_SEED"].split(",")]
    # one draw per run: pytest-xdist's workers each collect, and must collect the same seeds (the run's id)
    draw = random.Random(os.environ.get("PYTEST_XDIST_TESTRUNUID"))
    return [draw.randrange(2**31) for _ in range(int(os.environ.get("K3RAY_DRILLS", "1")))]


def train(cfg, drill: dict, lose_node=None) -> tuple[list[float], list[dict]]:
    with running_job(cfg) as controller:
        return run_drill(controller, drill, drill["steps"], lose_node)


@pytest.fixture(scope="module")
def unfailed(unfailed_ep4):
    return unfailed_ep4.losses[:DRILL_STEPS]


@pytest.mark.parametrize("seed", seeds())
def test_random_drill_ends_with_the_unfailed_losses(ray_cluster, extra_nodes, unfailed, tmp_path, seed):
    drill = plan(seed, KINDS)
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
        # both ranks of the pair or of the node, found together; killed where each finished its own stream, two
        # workers may die further apart than a death's grace for its peers (a loaded host): then the second is
        # found in the recovery from the first, at the same step
        found = [i for i in lost if i["step"] == lost[0]["step"]] if drill["state"] in STAGGERED else lost[:1]
        assert sum(len(i["ranks"]) for i in found) == 2, lost
    assert losses == pytest.approx(unfailed[:drill["steps"]], rel=1e-12, abs=0), (drill, incidents)
