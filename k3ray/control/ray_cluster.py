"""Ray for a k3ray command: connect to a cluster, or start the embedded local one sized for the job. Imports only Ray:
commands that start Ray without training (`k3ray serve`, `k3ray data prepare`) do not import the training controller
for it."""
from __future__ import annotations

import os

import ray


def init_ray(address: str | None, min_cpus: int) -> bool:
    """Connect to a cluster or start a local one sized for the job. Returns whether this call started Ray."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS")
    logs = os.environ.get("K3RAY_WORKER_LOGS") == "1"
    if address:
        ray.init(address=address, log_to_driver=logs)
    else:  # the embedded default: logical CPUs >= workers, so small machines still run every topology
        ray.init(num_cpus=max(os.cpu_count() or 1, min_cpus), include_dashboard=False, log_to_driver=logs,
                 object_store_memory=_object_store_bytes())
    return True


def _object_store_bytes() -> int | None:
    """K3RAY_OBJECT_STORE_GB for a local cluster (snapshots live in the object store: GPU jobs need tens of GB)."""
    value = os.environ.get("K3RAY_OBJECT_STORE_GB")
    if not value:
        return None
    try:
        gb = float(value)
    except ValueError:
        gb = -1.0
    if gb <= 0:
        raise ValueError(f"K3RAY_OBJECT_STORE_GB={value!r}: expected a positive number of GiB")
    return int(gb * 2**30)
