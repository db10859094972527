"""The Worker actor: one per device, a thin holder of a StageEngine (pipeline stage p, expert shard e)."""
from __future__ import annotations

import os
import socket

import ray
import torch

from k3ray.config import JobConfig


@ray.remote
class Worker:
    def __init__(self, cfg_dict: dict, pp_rank: int, ep_rank: int, home: list[int]):
        from k3ray.runtime.engine import StageEngine

        cfg = JobConfig.model_validate(cfg_dict)
        torch.set_num_threads(max(1, int(os.environ.get("K3RAY_THREADS_PER_WORKER", "1"))))
        device = "cuda" if cfg.parallel.device == "cuda" else "cpu"
        self.engine = StageEngine(cfg, pp_rank, ep_rank, home, device)

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port, for the process-group rendezvous (asked of world rank 0)."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            return ip, s.getsockname()[1]

    def setup(self, init_method: str, backend: str) -> bool:
        if init_method.startswith("tcp://127.0.0.1"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.engine.init_process_groups(init_method, backend)
        return True

    def train_step(self, step: int, batch_index: int) -> dict:
        return self.engine.train_step(step, batch_index)

    def evaluate(self) -> float:
        return self.engine.evaluate()

    def export_shard(self, expert_ids: list[int] | None = None) -> dict:
        return self.engine.export_shard(expert_ids)

    def set_placement(self, home: list[int], imports: dict | None = None) -> bool:
        self.engine.set_placement(home, imports)
        return True

    def set_policy(self, moonep_enabled: bool, slots_per_rank: int | None) -> bool:
        self.engine.set_policy(moonep_enabled, slots_per_rank)
        return True
