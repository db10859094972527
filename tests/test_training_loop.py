"""The driver's step loop (k3ray.control.driver.run_training) and the controller's data order
(k3ray.train.progress.TrainingProgress), without Ray: which steps may run their successor ahead, and which batch
that successor takes."""
from __future__ import annotations

from k3ray.config import load_config
from k3ray.control.driver import run_training
from k3ray.parallel.step import StepReport
from k3ray.train.progress import TrainingProgress

from conftest import REPO


class RecordingBackend:
    """A backend that trains nothing: the calls it got, in order."""

    def __init__(self):
        self.calls: list[tuple] = []

    def train_step(self, step: int, batch_index: int, ahead: bool = False) -> StepReport:
        self.calls.append(("step", step, ahead))
        return StepReport(step=step, batch_index=batch_index, loss=1.0, grad_norm=1.0, lr=1e-3, tokens=8)

    def evaluate(self) -> float:
        self.calls.append(("evaluate",))
        return 1.0


def test_a_step_runs_ahead_only_when_the_next_call_is_the_next_step():
    """Not before an evaluation (it would discard the step ahead), nor on the last step (nothing follows)."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", {"train.eval_every": 2})
    backend = RecordingBackend()
    run_training(backend, cfg, steps=5, start_step=10, progress=False)
    assert backend.calls == [("evaluate",), ("step", 10, True), ("step", 11, False), ("evaluate",),
                             ("step", 12, True), ("step", 13, False), ("evaluate",), ("step", 14, False),
                             ("evaluate",)]


def test_the_batch_after_one_is_the_next_steps_once_it_is_accepted():
    progress = TrainingProgress(skip={4, 5, 9})
    assert progress.batch_for(0) == 0 and progress.batch_after(0) == 1
    assert progress.batch_after(3) == 6 and progress.batch_after(8) == 10
    for step, batch in [(0, 0), (1, 1), (2, 2), (3, 3)]:
        assert progress.batch_for(step) == batch
        progress.accept(step, batch, {"loss": 1.0, "grad_norm": 1.0})
    assert progress.batch_for(4) == progress.batch_after(3) == 6
