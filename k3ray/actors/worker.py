"""The Worker actor: one per device, a thin holder of a StageEngine (pipeline stage p, expert shard e) and of
in-memory snapshots: its own, and a copy of one neighbour's, so losing one worker loses nothing.

Threaded (two calls at once): while the training thread is stuck in a collective whose peer died, the controller
can still read this worker's snapshots."""
from __future__ import annotations

import os
import socket
import time

import ray
import torch

from k3ray.config import JobConfig


def part_name(world_rank: int) -> str:
    return f"rank{world_rank:05d}.pt"


@ray.remote(max_concurrency=2)
class Worker:
    def __init__(self, cfg_dict: dict, pp_rank: int, ep_rank: int, home: list[int], ep_size: int):
        from k3ray.runtime.engine import StageEngine

        cfg = JobConfig.model_validate(cfg_dict)
        torch.set_num_threads(max(1, int(os.environ.get("K3RAY_THREADS_PER_WORKER", "1"))))
        device = "cuda" if cfg.parallel.device == "cuda" else "cpu"
        self.engine = StageEngine(cfg, pp_rank, ep_rank, home, ep_size, device)
        self.snapshot: tuple[int, dict] | None = None  # (step, state)
        self.peer_snapshot: tuple[int, int, dict] | None = None  # (world rank, step, state)
        self.hang_at_step: int | None = None
        self.writer = None  # checkpoint AsyncWriter, made on first use

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
        if self.hang_at_step == step:  # fault drill: a collective that never completes
            self.hang_at_step = None
            time.sleep(10**6)
        return self.engine.train_step(step, batch_index)

    def evaluate(self) -> float:
        return self.engine.evaluate()

    def export_shard(self, expert_ids: list[int] | None = None) -> dict:
        return self.engine.export_shard(expert_ids)

    def set_placement(self, home: list[int], imports: dict | None = None) -> bool:
        self.engine.set_placement(home, imports)
        return True

    def set_policy(self, moonep_enabled: bool, slots_per_rank: int | None, scheduling_enabled: bool) -> bool:
        self.engine.set_policy(moonep_enabled, slots_per_rank, scheduling_enabled)
        return True

    def set_lr_scale(self, scale: float) -> bool:
        self.engine.lr_scale = scale
        return True

    # -- fault drills --------------------------------------------------------------------------------------------
    def set_poison(self, layer: int | None) -> bool:
        self.engine.set_poison(layer)
        return True

    def hang_at(self, step: int) -> bool:
        self.hang_at_step = step
        return True

    # -- snapshots -----------------------------------------------------------------------------------------------
    def take_snapshot(self, step: int) -> dict:
        """Keep the state to run `step` from in host RAM; the returned copy goes to a neighbour."""
        state = self.engine.state_dict()
        self.snapshot = (step, state)
        return state

    def hold_peer_snapshot(self, rank: int, step: int, state: dict) -> bool:
        self.peer_snapshot = (rank, step, state)
        return True

    def get_snapshots(self) -> dict:
        return {"own": self.snapshot, "peer": self.peer_snapshot}

    def rollback(self) -> bool:
        """Restore this worker's own last snapshot (same topology)."""
        _, state = self.snapshot
        self.engine.load_state(state, {layer: [p] for layer, p in state["experts"].items()})
        return True

    def restore(self, dense_state: dict, expert_payloads: dict) -> bool:
        self.engine.load_state(dense_state, expert_payloads)
        return True

    # -- durable checkpoints --------------------------------------------------------------------------------------
    def save_checkpoint(self, root: str, step: int) -> bool:
        """Copy the state now (training may go on) and write it in the background as this rank's part."""
        from k3ray.runtime.checkpoint import AsyncWriter

        self.writer = self.writer or AsyncWriter()
        engine = self.engine
        self.writer.submit(root, step, part_name(engine.pp_rank * engine.ep + engine.ep_rank), engine.state_dict())
        return True

    def checkpoint_parts(self) -> list[dict]:
        """Wait for this worker's pending part writes; their PartInfos as dicts."""
        return [] if self.writer is None else [p.to_json() for p in self.writer.wait()]

    def state(self) -> dict:
        return self.engine.state_dict()
