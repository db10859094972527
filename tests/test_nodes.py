"""Lost nodes on a cluster of two raylets on this machine. A killed node: every rank it held is lost at once, the grid
shrinks to what the alive nodes hold, the snapshot copies held on the other node restore it, and the run's losses
are those of a run that never failed; when a node joins again the job grows back. A silent node (its raylet and
workers stopped, not dead: Ray still reports it alive): the step timeout finds its ranks, placement avoids it, and the
losses are again the unfailed run's. One job meets both, one after the other."""
from __future__ import annotations

import tempfile

import os
import signal

import pytest
import ray

from conftest import SMALL_BATCH, UNFAILED_STEPS
from k3ray.config import load_config
from k3ray.control.driver import running_job
from k3ray.control.local_nodes import free_ports, head_room, kill_node, silence_node

STEPS = UNFAILED_STEPS  # the shared unfailed run's length and train.steps (its cosine decay starts at step 10)


def tiny(**overrides):
    base = {"parallel.pp": 1, "parallel.ep": 4, "train.eval_every": 0, "train.steps": STEPS, "model.dtype": "float64",
            "checkpoint.at_end": False, "parallel.collective_timeout_s": 10, "fault_tolerance.snapshot_every": 4,
            "policies.guards.warmup_steps": 100, "fault_tolerance.grow_back_after_steps": 1,
            "checkpoint.dir": tempfile.mkdtemp(prefix="k3ray-nodes-"), **SMALL_BATCH}  # a folder belongs to one job
    return load_config("configs/tiny.yaml", {**base, **overrides})


@pytest.fixture(scope="module")
def unfailed_losses(unfailed_ep4) -> list[float]:
    return unfailed_ep4.losses[:STEPS]


@pytest.fixture
def split_grid(extra_nodes):
    """A second node of 2 CPUs, and the head's CPUs but 2 blocked, so the 4 workers sit 2 on each node."""
    node = extra_nodes(2)
    with head_room(2):
        yield node


def test_a_lost_node_and_later_a_silent_one_shrink_the_grid_and_leave_the_losses(unfailed_losses, split_grid,
                                                                                 extra_nodes):
    """The split grid's second node is killed between steps 5 and 6, a new node joins and the job grows back onto
    it, and that node falls silent after step 8."""
    frozen = []
    try:
        with running_job(tiny()) as controller:
            losses = [ray.get(controller.train_step.remote(s), timeout=600)["loss"] for s in range(6)]
            kill_node(split_grid)  # the node and its 2 workers are gone, between steps
            losses.append(ray.get(controller.train_step.remote(6), timeout=600)["loss"])
            # (on a loaded machine a launch whose workers answer late is an incident of its own, before these)
            lost = [i for i in ray.get(controller.get_incidents.remote()) if i["kind"] == "worker_lost"]
            assert len(lost) == 1 and len(lost[0]["ranks"]) == 2 and lost[0]["ep"][-1] == 2, lost
            assert ray.get(controller.status.remote())["ep"] == 2
            joined = extra_nodes(2)  # capacity returns: the job grows back at the next boundary
            losses += [ray.get(controller.train_step.remote(s), timeout=600)["loss"] for s in range(7, 9)]
            grown = ray.get(controller.get_incidents.remote())
            assert [i["kind"] for i in grown if i["kind"] in ("worker_lost", "grow_back")][-1] == "grow_back", grown
            assert ray.get(controller.status.remote())["ep"] == 4, "the job did not grow back onto the joined node"
            # grow-back on: it must not count on the silent node's CPUs
            frozen = silence_node(joined)  # no process of the node answers, none has died
            losses += [ray.get(controller.train_step.remote(s), timeout=600)["loss"] for s in range(9, STEPS)]
            silent = ray.get(controller.get_incidents.remote())[len(grown):]
            status = ray.get(controller.status.remote())
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    lost = [i for i in silent if i["kind"] == "worker_lost"]
    assert len(lost) == 1 and lost[0]["rule"] == "collective_timeout" and len(lost[0]["ranks"]) == 2, silent
    assert status["ep"] == 2 and lost[0]["silent_nodes"] and not [i for i in silent if i["kind"] == "grow_back"]
    # found by the step's collective timeout (10 s) plus the grace for the silent ranks, not by Ray's node health check
    assert lost[0]["seconds"]["detection"] < 20, lost[0]["seconds"]
    # survivors ran the lost ranks' micro-batches: the trajectory is the unfailed run's (see test_faults for the bound)
    assert losses == pytest.approx(unfailed_losses, rel=1e-12, abs=0)


def test_free_ports_are_distinct_while_chosen_together():
    """Ports for one raylet's agents are chosen together, so no two of them are the same."""
    for _ in range(20):
        ports = free_ports(8)
        assert len(set(ports)) == 8
