"""Durable checkpoints of a running job, owned by the controller: every worker writes its part asynchronously at a step
boundary, the manifest is committed at the next one (k3ray.io.checkpoint); `--resume` restores the newest verified
checkpoint onto the configured EP size.

Interface: `resume` (before the workers start), `request`, `boundary` (every step boundary), `commit_pending`
(before stopping), `abandon_pending` (its writers were lost), `committed` (what was written)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from k3ray.config import CheckpointConfig
from k3ray.controller.snapshots import restore_sources
from k3ray.controller.worker import part_name
from k3ray.controller.worker_group import WorkerLost
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
    def __init__(self, cfg: CheckpointConfig, on_commit: list[Callable] | None = None,
                 on_incident: Callable[..., dict] | None = None):
        self.cfg = cfg
        self.pending: tuple[int, dict] | None = None  # parts being written: (step, manifest meta)
        self.requested = False
        self.committed: list[dict] = []  # step, path, seconds
        self.on_commit = on_commit or []  # each called as f(step, path, parts, seconds) after a commit
        self.on_incident = on_incident or (lambda kind, **fields: fields)  # records an incident

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
        """Commit the pending checkpoint once every writer has finished its part; a writer lost first abandons it
        (WorkerLost is raised on for the controller to recover)."""
        if self.pending is None:
            return
        step, meta = self.pending
        t0 = time.perf_counter()
        try:
            parts = [ckpt.PartInfo(**p) for ps in group.call("checkpoint_parts", timeout_s=None) for p in ps]
        except WorkerLost as lost:
            self.abandon_pending(str(lost))
            raise
        self.pending = None
        path = ckpt.commit(self.cfg.dir, step, parts, meta, self.cfg.keep)
        wait_and_commit = time.perf_counter() - t0
        self.committed.append({"step": step, "path": str(path), "copy_seconds": meta["copy_seconds"],
                               "wait_and_commit_seconds": wait_and_commit})
        log.info("checkpoint of step %d committed at %s", step, path)
        for callback in self.on_commit:
            callback(step, path, parts, meta["copy_seconds"] + wait_and_commit)

    def abandon_pending(self, why: str) -> None:
        """Drop the pending checkpoint, whose writers are gone: committing it would miss their parts. The previous
        checkpoint stays the newest; a new one is asked for at the next boundary (written by the new grid)."""
        if self.pending is None:
            return
        step = self.pending[0]
        self.pending = None
        self.requested = True
        newest = self.committed[-1]["step"] if self.committed else None
        log.warning("checkpoint of step %d abandoned (%s); the newest checkpoint stays step %s; writing another at "
                    "the next step boundary", step, why, newest)
        self.on_incident("checkpoint_abandoned", step=step, why=why, newest=newest)
