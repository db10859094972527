"""A lost node on a cluster of two raylets on this machine: every rank it held is lost at once, the grid shrinks to
what the alive nodes hold, the snapshot copies held on the other node restore it, and the run's losses are those of
a run that never failed; when a node joins again the job grows back."""
from __future__ import annotations

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from k3ray.config import load_config
from k3ray.control.driver import start_controller, stop_controller


def tiny(**overrides):
    base = {"parallel.pp": 1, "parallel.ep": 4, "train.eval_every": 0, "model.dtype": "float64",
            "parallel.collective_timeout_s": 10, "fault_tolerance.snapshot_every": 4,
            "policies.guards.warmup_steps": 100, "fault_tolerance.grow_back_after_steps": 1}
    return load_config("configs/tiny.yaml", {**base, **overrides})


def test_lost_node_shrinks_restores_from_copies_elsewhere_and_grows_back(ray_cluster, extra_nodes):
    steps = 9
    reference = start_controller(tiny())
    try:
        want = [ray.get(reference.train_step.remote(s), timeout=600)["loss"] for s in range(steps)]
    finally:
        stop_controller(reference)

    head_cpus = int(ray.cluster_resources()["CPU"])
    node = extra_nodes(2)
    # leave 2 CPUs of the head free, so the 4 workers sit 2 on the head and 2 on the new node
    blocker = placement_group([{"CPU": head_cpus - 2}], strategy="STRICT_PACK")
    ray.get(blocker.ready(), timeout=120)
    controller = start_controller(tiny())
    try:
        losses = [ray.get(controller.train_step.remote(s), timeout=600)["loss"] for s in range(6)]
        extra_nodes.kill(node)  # the node and its 2 workers are gone, between steps
        losses.append(ray.get(controller.train_step.remote(6), timeout=600)["loss"])
        lost = ray.get(controller.get_incidents.remote())[0]
        assert lost["kind"] == "worker_lost" and len(lost["ranks"]) == 2 and lost["ep"][-1] == 2, lost
        assert ray.get(controller.status.remote())["ep"] == 2
        extra_nodes(2)  # capacity returns: the job grows back at the next boundary
        losses += [ray.get(controller.train_step.remote(s), timeout=600)["loss"] for s in range(7, steps)]
        incidents = ray.get(controller.get_incidents.remote())
        status = ray.get(controller.status.remote())
    finally:
        stop_controller(controller)
        remove_placement_group(blocker)
    assert [i["kind"] for i in incidents if i["kind"] in ("worker_lost", "grow_back")][-1] == "grow_back"
    assert status["ep"] == 4
    # survivors ran the lost ranks' micro-batches: the trajectory is the unfailed run's (see test_faults for the bound)
    assert losses == pytest.approx(want, rel=1e-12, abs=0)
