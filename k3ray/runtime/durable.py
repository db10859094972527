"""Durable checkpoints of a running job, as a mixin of the Controller actor: every worker writes its part
asynchronously at a step boundary, the controller commits the manifest at the next one (k3ray.runtime.checkpoint);
`--resume` restores the newest verified checkpoint onto the configured EP size."""
from __future__ import annotations

import logging
import time

import ray

from k3ray.actors.worker import part_name
from k3ray.policies import guards
from k3ray.runtime import checkpoint as ckpt
from k3ray.runtime.group import restore_sources
from k3ray.runtime.resilience import JobState

log = logging.getLogger("k3ray.controller")


class DurableCheckpoints:
    def _resume_sources(self) -> dict | None:
        """Read the newest verified checkpoint (falling back past corrupt ones, loudly) and set the data order,
        guard statistics and step from it. Experts reshard onto the configured EP size."""
        root = self.cfg.checkpoint.dir
        manifest = ckpt.latest_verified(root)
        if manifest is None:
            log.warning("--resume: no verified checkpoint under %s; starting from step 0", root)
            return None
        meta = manifest.meta
        mismatches = ckpt.shape_mismatches(meta["config"], self.cfg.model_dump(mode="json"))
        if mismatches:
            raise ckpt.CheckpointError(f"{manifest.path} does not fit the config ({'; '.join(mismatches)}): "
                                       f"resume with the config it was written with")
        states = {r: ckpt.load_part(root, manifest.step, part_name(r)) for r in range(meta["pp"] * meta["ep"])}
        self.step = manifest.step
        if meta["last_batch"] is not None:
            self.batches[manifest.step - 1] = meta["last_batch"]
        self.skip |= set(meta["skip"])
        self.lr_scale = meta["lr_scale"]
        self.guard_state = guards.GuardState(**{k: v for k, v in meta["guard_state"].items() if k != "history"})
        self._transition(JobState.SCHEDULING, f"resuming from {manifest.path} (step {manifest.step}, "
                                              f"ep {meta['ep']} -> {self.ep_size})")
        return restore_sources(states, meta["pp"], meta["ep"])

    def request_checkpoint(self) -> dict:
        """Ask for a durable checkpoint at the next step boundary."""
        self.checkpoint_requested = True
        return {"requested": True, "at_step": self.step, "dir": self.cfg.checkpoint.dir}

    def _checkpoint_boundary(self, step: int) -> None:
        """Commit the checkpoint whose parts were written since the last boundary; start a new one if due."""
        self._commit_pending()
        every = self.cfg.checkpoint.every_n_steps
        if self.checkpoint_requested or (every and step > 0 and step % every == 0):
            self.checkpoint_requested = False
            t0 = time.perf_counter()
            ray.get([w.save_checkpoint.remote(self.cfg.checkpoint.dir, step) for w in self._all()])
            meta = {"step": step, "pp": self.cfg.parallel.pp, "ep": self.ep_size, "home": list(self.home),
                    "last_batch": self.batches.get(step - 1), "skip": sorted(self.skip), "lr_scale": self.lr_scale,
                    "guard_state": {k: v for k, v in vars(self.guard_state).items() if k != "history"},
                    "job": self.cfg.name, "config": self.cfg.model_dump(mode="json"),
                    "copy_seconds": time.perf_counter() - t0}
            self.pending_commit = (step, meta)

    def _commit_pending(self) -> None:
        if self.pending_commit is None:
            return
        step, meta = self.pending_commit
        self.pending_commit = None
        t0 = time.perf_counter()
        parts = [ckpt.PartInfo(**p) for ps in ray.get([w.checkpoint_parts.remote() for w in self._all()]) for p in ps]
        path = ckpt.commit(self.cfg.checkpoint.dir, step, parts, meta, self.cfg.checkpoint.keep)
        self.checkpoints.append({"step": step, "path": str(path), "copy_seconds": meta["copy_seconds"],
                                 "wait_and_commit_seconds": time.perf_counter() - t0})
        log.info("checkpoint of step %d committed at %s", step, path)
        if self.metrics is not None:
            self.metrics.record_checkpoint(meta["copy_seconds"] + self.checkpoints[-1]["wait_and_commit_seconds"])
        for i, fault in self.pending_faults:
            if fault.kind == "corrupt_checkpoint" and fault.step <= step and i not in self.fired:
                self.fired.add(i)
                victim = path / parts[0].name
                victim.write_bytes(victim.read_bytes()[: parts[0].bytes // 2])
                log.warning("fault drill: truncated %s", victim)

    def list_checkpoints(self) -> list[dict]:
        return list(self.checkpoints)
