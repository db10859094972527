"""Durable checkpoints of a running job, owned by the controller: every worker writes its part asynchronously at a step
boundary, the manifest is committed at the next one (k3ray.io.checkpoint); `--resume` restores the newest verified
checkpoint onto the configured EP size.

Interface: `resume` (before the workers start), `request`, `boundary` (every step boundary), `commit_pending`
(before stopping), `committed` (what was written)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from k3ray.config import CheckpointConfig
from k3ray.controller.snapshots import restore_sources
from k3ray.controller.worker import part_name
from k3ray.io import checkpoint as ckpt

log = logging.getLogger("k3ray.controller")


@dataclass
class Resumed:
    """What a resume starts from: the checkpoint's step and metadata, and its parts by stage (`restore_sources`)."""
    path: str
    step: int
    meta: dict
    sources: dict[int, list]


class DurableCheckpoints:
    def __init__(self, cfg: CheckpointConfig, on_commit: list[Callable] | None = None):
        self.cfg = cfg
        self.pending: tuple[int, dict] | None = None  # parts being written: (step, manifest meta)
        self.requested = False
        self.committed: list[dict] = []  # step, path, seconds
        self.on_commit = on_commit or []  # each called as f(step, path, parts, seconds) after a commit

    def resume(self, job: dict) -> Resumed | None:
        """The newest verified checkpoint (falling back past corrupt ones, loudly), or None when there is none.
        `job` is the running job's config (a JobConfig JSON dump): a checkpoint whose shapes differ is an error."""
        manifest = ckpt.latest_verified(self.cfg.dir)
        if manifest is None:
            log.warning("--resume: no verified checkpoint under %s; starting from step 0", self.cfg.dir)
            return None
        meta = manifest.meta
        mismatches = ckpt.shape_mismatches(meta["config"], job)
        if mismatches:
            raise ckpt.CheckpointError(f"{manifest.path} does not fit the config ({'; '.join(mismatches)}): "
                                       f"resume with the config it was written with")
        states = {r: ckpt.load_part(self.cfg.dir, manifest.step, part_name(r)) for r in range(meta["pp"] * meta["ep"])}
        return Resumed(str(manifest.path), manifest.step, meta, restore_sources(states, meta["pp"], meta["ep"]))

    def request(self, step: int) -> dict:
        """Ask for a durable checkpoint at the next step boundary."""
        self.requested = True
        return {"requested": True, "at_step": step, "dir": self.cfg.dir}

    def boundary(self, group, step: int, meta: Callable[[], dict]) -> None:
        """Commit the checkpoint whose parts were written since the last boundary; start a new one if due. `meta()`
        gives what the manifest records beside the parts (the controller's progress: data order, lr scale, ...)."""
        self.commit_pending(group)
        every = self.cfg.every_n_steps
        if self.requested or (every and step > 0 and step % every == 0):
            self.requested = False
            t0 = time.perf_counter()
            group.call("save_checkpoint", self.cfg.dir, step, timeout_s=None)
            self.pending = (step, {**meta(), "step": step, "copy_seconds": time.perf_counter() - t0})

    def commit_pending(self, group) -> None:
        if self.pending is None:
            return
        step, meta = self.pending
        self.pending = None
        t0 = time.perf_counter()
        parts = [ckpt.PartInfo(**p) for ps in group.call("checkpoint_parts", timeout_s=None) for p in ps]
        path = ckpt.commit(self.cfg.dir, step, parts, meta, self.cfg.keep)
        wait_and_commit = time.perf_counter() - t0
        self.committed.append({"step": step, "path": str(path), "copy_seconds": meta["copy_seconds"],
                               "wait_and_commit_seconds": wait_and_commit})
        log.info("checkpoint of step %d committed at %s", step, path)
        for callback in self.on_commit:
            callback(step, path, parts, meta["copy_seconds"] + wait_and_commit)


@dataclass
class ServingWeights:
    """The weights of a durable checkpoint merged out of its grid, for serving on any pp x ep: every stage's dense
    parameters and router biases by name, every layer's experts in one payload (no optimizer state). Workers keep
    the names of their stage and the experts homed on them (`shards.load_weights`)."""
    path: str
    step: int
    config: dict  # the training job's config
    state: dict


def serving_weights(root: str) -> ServingWeights:
    manifest = ckpt.latest_verified(root)
    if manifest is None:
        raise ckpt.CheckpointError(f"{root}: no verified checkpoint (train with checkpoint.every_n_steps, or "
                                   f"`k3ray checkpoint` on a running job)")
    meta = manifest.meta
    state = {"dense": {}, "opt_dense": {}, "router_bias": {}, "experts": {}, "opt_steps": 0, "lr_scale": 1.0}
    for r in range(meta["pp"] * meta["ep"]):
        part = ckpt.load_part(root, manifest.step, part_name(r))
        state["dense"].update(part["dense"])
        state["router_bias"].update(part["router_bias"])
        for layer, payload in part["experts"].items():
            state["experts"].setdefault(layer, []).append(payload)
    for layer, payloads in state["experts"].items():
        ids = [e for p in payloads for e in p["expert_ids"]]
        order = sorted(range(len(ids)), key=ids.__getitem__)
        state["experts"][layer] = {"expert_ids": sorted(ids), "opt": {"w1": None, "w2": None},
                                   **{w: torch.cat([p[w] for p in payloads])[order] for w in ("w1", "w2")}}
    return ServingWeights(str(manifest.path), manifest.step, meta["config"], state)
