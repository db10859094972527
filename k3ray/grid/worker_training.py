"""A Worker's training calls (k3ray.grid.worker owns one): the step, the evaluation, moving expert shards, trained
expert copies and the live settings the controller pushes at a step boundary, each on the engine of the place held
(k3ray.grid.worker_seat)."""
from __future__ import annotations

from k3ray.config import PoliciesConfig
from k3ray.grid.worker_seat import WorkerSeat


class WorkerTraining:
    def __init__(self, seat: WorkerSeat):
        self.seat = seat

    def train_step(self, step: int, batch_index: int, next_batch: int | None = None) -> dict:
        """The step report (k3ray.parallel.engine.StageEngine.train_step; `next_batch`: the next step's, to run
        ahead)."""
        return self.seat.engine.train_step(step, batch_index, next_batch)

    def evaluate(self) -> float:
        return self.seat.engine.evaluate()

    def export_shard(self, expert_ids: list[int] | None = None) -> dict:
        return self.seat.engine.export_shard(expert_ids)

    def set_placement(self, home: list[int], imports: dict | None = None) -> bool:
        self.seat.engine.set_placement(home, imports)
        return True

    def set_trained_copies(self, table: list[list[int]]) -> int:
        """Hold copies of hot experts in spare slots from the next step on (k3ray.parallel.engine_copies.
        EngineCopies.set_trained); the bytes fetched."""
        return self.seat.engine.copies.set_trained(table)

    def set_policies(self, policies: dict) -> bool:
        # the data-path policies (the EP placement planner, the expert-GEMM order) are the EP context's
        self.seat.engine.ctx.set_policies(PoliciesConfig.model_validate(policies))
        return True

    def set_lr_scale(self, scale: float) -> bool:
        self.seat.engine.lr_scale = scale
        return True
