"""The training progress that the controller's step loop carries (`TrainingProgress`): what a replay, a snapshot or
a checkpoint must reproduce (the next step, the batch each step trained on, the batches never trained on, the
learning-rate scale, the guards' running statistics), and the last accepted step's report. The controller owns it;
its recovery and scaling parts are handed the same object."""
from __future__ import annotations

from dataclasses import dataclass, field

from k3ray.config import JobConfig
from k3ray.io import checkpoint as ckpt
from k3ray.policies import guards
from k3ray.train.placement import Placement


@dataclass
class TrainingProgress:
    step: int = 0  # the next step to run
    skip: set[int] = field(default_factory=set)  # batch indices never trained on
    batches: dict[int, int] = field(default_factory=dict)  # step -> batch index it trained on
    guard_state: guards.GuardState = field(default_factory=guards.GuardState)
    lr_scale: float = 1.0
    last_report: dict | None = None

    def batch_for(self, step: int) -> int:
        """The next batch index after the previous step's, passing over skipped ones."""
        return self.batch_after(self.batches[step - 1] if step - 1 in self.batches else step - 1)

    def batch_after(self, batch: int) -> int:
        """The batch the step after one run on `batch` takes, if that one is accepted (`batch_for` then)."""
        b = batch + 1
        while b in self.skip:
            b += 1
        return b

    def accept(self, step: int, batch: int, report: dict) -> None:
        """`step`, run on `batch`, passed the guards: the next step is step + 1."""
        self.guard_state = guards.accept(report, self.guard_state)
        self.batches[step] = batch
        self.step = step + 1
        self.last_report = report

    def resume(self, step: int, meta: dict) -> None:
        """Continue from a checkpoint of the boundary before `step` (its `checkpoint_meta`)."""
        self.step = step
        if meta["last_batch"] is not None:
            self.batches[step - 1] = meta["last_batch"]
        self.skip |= set(meta["skip"])
        self.lr_scale = meta["lr_scale"]
        self.guard_state = guards.GuardState(**{k: v for k, v in meta["guard_state"].items() if k != "history"})

    def checkpoint_meta(self, step: int, cfg: JobConfig, table: Placement) -> dict:
        """What a checkpoint of the boundary before `step` records beside the workers' parts (the grid's size and
        homes from the placement `table`)."""
        job = cfg.model_dump(mode="json")
        return {"pp": cfg.parallel.pp, "ep": table.ep, "home": list(table.home),
                "last_batch": self.batches.get(step - 1), "skip": sorted(self.skip), "lr_scale": self.lr_scale,
                "guard_state": {k: v for k, v in vars(self.guard_state).items() if k != "history"},
                "job": cfg.name, "config": job, "model_hash": ckpt.model_hash(job),
                # steps 0..step-1 each trained one global batch; skipped batches were read past, not trained on
                "tokens_consumed": step * cfg.global_batch_sequences * cfg.data.seq_len,
                "samples_read": (self.batches.get(step - 1, -1) + 1) * cfg.global_batch_sequences}
