"""What the alive nodes of the cluster hold for a worker grid, in workers of one bundle each (a worker group owns
one: k3ray.grid.worker_group). Nodes found silent (which Ray may still report alive) are neither counted nor placed
on, and a lost node's resources, which stay in ray.cluster_resources() for a while, are never counted."""
from __future__ import annotations

import ray


def alive_resources(free: bool, avoid_nodes: frozenset[str] = frozenset()) -> dict[str, float]:
    """Resources of the nodes Ray reports alive (but avoid_nodes), in total or (free) what is unused of them."""
    have: dict[str, float] = {}
    for node in ray.nodes():
        if node["Alive"] and node["NodeID"] not in avoid_nodes:
            for res, amount in node["Resources"].items():
                have[res] = have.get(res, 0) + amount
    if free:
        available = ray.available_resources()
        have = {res: min(amount, available.get(res, 0)) for res, amount in have.items()}
    return have


class AliveNodes:
    def __init__(self, bundle: dict[str, float], avoid_nodes: frozenset[str] = frozenset()):
        self.bundle = bundle  # one worker's resources
        self.avoid_nodes = frozenset(avoid_nodes)  # nodes found silent

    def avoid(self, nodes: set[str]) -> None:
        """Nodes found silent from now on (besides those already)."""
        self.avoid_nodes |= frozenset(nodes)

    def fits(self, size: int, extra_cluster_free: bool = False) -> tuple[bool, str]:
        """Whether they can hold a grid of `size` workers (in total, or in what is free right now), and if not
        why."""
        have = alive_resources(extra_cluster_free, self.avoid_nodes)
        for res, amount in self.bundle.items():
            need = amount * size
            if have.get(res, 0) < need:
                return False, f"needs {need:g} {res} (one per worker) but the cluster has {have.get(res, 0):g}"
        return True, ""

    def capacity(self, free: bool = False) -> int:
        """How many workers they can hold (a shrunk grid is planned to fit it): in total, or (free) in what they
        have unused now, where other holders (other jobs) keep theirs."""
        have = alive_resources(free, self.avoid_nodes)
        return int(min(have.get(res, 0) // amount for res, amount in self.bundle.items()))

    def room_for(self, n: int) -> bool:
        """Whether they have room for `n` more workers right now (what is free of them)."""
        have = alive_resources(True, self.avoid_nodes)
        return all(have.get(res, 0) >= amount * n for res, amount in self.bundle.items())

    def healthy(self) -> set[str]:
        """The nodes Ray reports alive but the silent ones."""
        return {n["NodeID"] for n in ray.nodes() if n["Alive"]} - self.avoid_nodes

    def label_selector(self, n: int) -> list[dict] | None:
        """A placement group's bundle label selector keeping `n` bundles off the silent nodes (Ray labels every
        node with its id)."""
        return [{"ray.io/node-id": f"!in({','.join(sorted(self.avoid_nodes))})"}] * n if self.avoid_nodes else None
