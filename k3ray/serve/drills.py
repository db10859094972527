"""Serving drills (tests/test_serving_*.py, benchmarks/drill_campaign.py): a request's stream read beside the faults
the engine's `drill` injects (k3ray.faults), and the single-process reference every request must end with."""
from __future__ import annotations

import threading
import time

import ray
import torch

from k3ray.config import serving_config
from k3ray.formats.serving_weights import serving_weights
from k3ray.model.decoder import build_stage
from k3ray.model.sampling import SamplingParams
from k3ray.optim import AdamW
from k3ray.parallel import shards
from k3ray.parallel.reference import generate_reference


def reference_model(checkpoint: str):
    """The whole model of a checkpoint in this process (one intra-op thread)."""
    torch.set_num_threads(1)
    w = serving_weights(checkpoint)
    cfg = serving_config(w.config, 1, 1)
    model = build_stage(cfg.model, range(cfg.model.n_layers), init=False)
    shards.load_weights(model, AdamW(cfg.optimizer), w.state, {i: [w.state["experts"][i]] for i in model.layers},
                        set(range(cfg.model.n_experts)))
    return model


def serving_reference(checkpoint: str):
    """The single-process reference generation from a checkpoint: (prompt ids, SamplingParams) -> (generated ids,
    finish reason); what a serving drill's every request must end with."""
    model = reference_model(checkpoint)
    return lambda prompt_ids, params: generate_reference(model, prompt_ids, params)


class Stream(threading.Thread):
    """One request's stream from a serving engine (what the front door forwards): items with their arrival times."""

    def __init__(self, engine, prompt: list[int], params: dict):
        """params: the drill's sampling settings (SamplingParams' fields)."""
        super().__init__(daemon=True)
        self.gen = engine.generate.options(num_returns="streaming").remote(prompt, SamplingParams(**params))
        self.items: list[tuple[float, dict]] = []

    def run(self) -> None:
        for ref in self.gen:
            self.items.append((time.perf_counter(), ray.get(ref)))

    def tokens(self, before: float = float("inf")) -> list[int]:
        return [t for at, item in self.items if at < before for t in item.get("tokens", ())]
