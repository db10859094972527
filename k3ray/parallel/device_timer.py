"""A training step's phases timed on the device (CUDA events), so a step's report says where the GPU's time went,
not only the host's: the host launches kernels ahead of the device, so its own timings end long before the work.

The events of step n are read at the end of step n+1, when they have surely completed (each step waits for its
gradient norm, after the previous step's optimizer): reading them never makes the host wait. Each report therefore
carries the previous step's device seconds (none on the job's first step, nor on CPU)."""
from __future__ import annotations

import torch

# marks in step order: a phase runs from one mark to the next
MARKS = ("start", "backward_done", "optimizer_start", "optimizer_done", "end")
PHASES = {"device_forward_backward": ("start", "backward_done"),  # forward, backward, pipeline and EP exchanges
          "device_gradient_sync": ("backward_done", "optimizer_start"),  # dense all-reduce, norm, expert copies back
          "device_optimizer": ("optimizer_start", "optimizer_done"),
          "device_total": ("start", "end")}


class DeviceTimer:
    def __init__(self, device: torch.device):
        self.on = device.type == "cuda"
        self.marks: dict[str, torch.cuda.Event] = {}
        self.previous: dict[str, torch.cuda.Event] = {}

    def mark(self, name: str) -> None:
        """Record mark `name` (one of MARKS) on the current stream: it completes when the work launched before it
        has."""
        if self.on:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event

    def finish(self) -> dict[str, float]:
        """The step is launched: the previous step's device seconds by phase (PHASES; empty on CPU and on the first
        step); this step's marks are kept for the next."""
        seconds = {}
        if self.previous:
            self.previous["end"].synchronize()  # done long ago (see the module's docstring): returns at once
            seconds = {phase: self.previous[a].elapsed_time(self.previous[b]) / 1e3 for phase, (a, b) in PHASES.items()}
        self.previous, self.marks = self.marks, {}
        return seconds
