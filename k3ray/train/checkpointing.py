"""Durable checkpoints of a running job, owned by the controller: every worker writes its part asynchronously at a step
boundary, the manifest is committed at the next one (k3ray.io.checkpoint); `--resume` restores the newest verified
checkpoint onto the configured EP size.

Interface: `resume` (before the workers start), `request`, `boundary` (every step boundary), `commit_pending`
(before a resize), `at_end` (before stopping), `abandon_pending` (its writers were lost), `committed` (what was
written), `start_point` (a committed one as a state to go back to)."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

import torch

from k3ray.config import CheckpointConfig
from k3ray.grid.snapshots import StartPoint, restore_sources
from k3ray.grid.calls import WorkerLost
from k3ray.io import checkpoint as ckpt
from k3ray.policies import guards

log = logging.getLogger("k3ray.controller")


@dataclass
class Resumed:
    """What a resume starts from: the checkpoint's step and metadata, and its parts by stage (`restore_sources`),
    mapped from their files: the job keeps them as its start point until its first snapshot, in the page cache (which
    the kernel may reclaim), not in the controller's heap."""
    path: str
    step: int
    meta: dict
    sources: dict[int, list]


class DurableCheckpoints:
    def __init__(self, cfg: CheckpointConfig, on_commit: list[Callable] | None = None,
                 on_incident: Callable[..., dict] | None = None, timeout_s: float = 600.0, job: str | None = None):
        """timeout_s: the longest wait on the workers' copies and writes; job: the job's name, which the folder's
        checkpoints must carry (`claim`)."""
        self.cfg, self.timeout_s, self.job = cfg, timeout_s, job
        self.pending: tuple[int, dict] | None = None  # parts being written: (step, manifest meta)
        self.requested = False
        self.committed: list[dict] = []  # step, path, seconds
        self.on_commit = on_commit or []  # each called as f(step, path, parts, seconds) after a commit
        self.on_incident = on_incident or (lambda kind, **fields: fields)  # records an incident
        self.warnings: list[str] = []  # what the driver shows on the console (fallbacks, failed writes)
        self.failures_in_a_row = 0  # failed writes since the last commit

    def claim(self, job: dict, resuming_from: str | None = None) -> None:
        """Check that the checkpoint folder belongs to this job (or holds nothing yet): checkpoints another job wrote
        (another name, or another model config) are never written among nor resumed from, unless the resume names
        them (`resuming_from`: --resume --from DIR). CheckpointError, one line, otherwise."""
        held = ckpt.owner(self.cfg.dir)
        if held is None:
            return
        name = held["job"]
        if name == job["name"] and held["model_hash"] == ckpt.model_hash(job):
            return
        differ = ckpt.shape_mismatches(held["config"], job) or [
            f"model.{k}" for k in _changed_fields(held["config"].get("model", {}), job["model"])]
        whose = f"job {name!r}" if name != job["name"] else \
            f"job {name!r} with another model config ({'; '.join(differ)})"
        if resuming_from is not None and Path(resuming_from).resolve() == Path(self.cfg.dir).resolve():
            raise ckpt.CheckpointError(
                f"--from {resuming_from}: it is also this job's checkpoint.dir; the resumed job writes its own "
                f"checkpoints elsewhere (the default runs/{job['name']}/checkpoints, or --set checkpoint.dir=...)")
        raise ckpt.CheckpointError(
            f"checkpoint.dir {self.cfg.dir} holds checkpoints of {whose}: refusing to write or resume there; use "
            f"another checkpoint.dir (the default is runs/<name>/checkpoints), or --resume --from {self.cfg.dir} "
            f"to start from them")

    def resume(self, job: dict, fresh: bool = False, source: str | None = None) -> Resumed | None:
        """The newest verified checkpoint. Every newer step dir that does not verify is moved aside (so the resumed
        run never writes over it) and reported: a warning, an incident, and in `warnings` for the driver to show.
        Nothing verifiable is an error, unless `fresh` (then None: start from step 0). `job` is the running job's
        config (a JobConfig JSON dump): a checkpoint whose shapes differ is an error; declared-safe changes (the
        fields `ckpt.shape_mismatches` does not look at, e.g. optimizer.lr, train.steps) are noted. `source`: another
        folder to start from (--resume --from DIR, read only: nothing there is moved)."""
        if source is not None:
            return self._resume_from_folder(job, source)
        manifest, problems = ckpt.scan(self.cfg.dir)
        target = f"resuming from step {manifest.step}" if manifest else "nothing older verifies"
        for step, why in problems:
            aside = ckpt.move_aside(self.cfg.dir, step)
            self._warn("checkpoint_damaged", f"checkpoint step {step} is damaged ({why}); moved aside to {aside}; "
                                             f"{target}", step=step, why=why, moved_to=str(aside))
        if manifest is None:
            if fresh:
                self._warn("checkpoint_none", f"--resume: no verified checkpoint under {self.cfg.dir}; starting "
                                              f"from step 0 (--fresh)")
                return None
            raise ckpt.CheckpointError(f"--resume: no verified checkpoint under {self.cfg.dir}; add --fresh to "
                                       f"start from step 0")
        return self._resumed(manifest, job, self.cfg.dir)

    def _resume_from_folder(self, job: dict, source: str) -> Resumed:
        manifest = ckpt.latest_verified(source)
        if manifest is None:
            raise ckpt.CheckpointError(f"--from {source}: no verified checkpoint there")
        return self._resumed(manifest, job, source)

    def _resumed(self, manifest, job: dict, root: str) -> Resumed:
        meta = manifest.meta
        mismatches = ckpt.shape_mismatches(meta["config"], job)
        if mismatches:
            raise ckpt.CheckpointError(f"{manifest.path} does not fit the config ({'; '.join(mismatches)}): "
                                       f"resume with the config it was written with")
        changed = _changed_fields(meta["config"], job)
        if changed:
            log.warning("resuming from %s with changed settings (none changes a tensor shape): %s", manifest.path,
                        "; ".join(changed))
            self.on_incident("resumed_with_changes", step=manifest.step, rule="resumed_with_changes",
                             changed=changed)
        return Resumed(str(manifest.path), manifest.step, meta, _mapped_sources(manifest, root))

    def start_point(self, step: int) -> StartPoint:
        """This job's committed checkpoint of `step` as a state to go back to (k3ray.grid.snapshots.Snapshots.durable):
        its parts mapped from their files, the guards' statistics it recorded."""
        manifest = ckpt.read_manifest(self.cfg.dir, step)
        return StartPoint(step, guards.GuardState(**manifest.meta["guard_state"]), _mapped_sources(manifest,
                                                                                                   self.cfg.dir))

    def _warn(self, kind: str, message: str, **fields) -> None:
        """A checkpoint problem the user must see: logged here, an incident, and kept for the driver's console."""
        log.warning("%s", message)
        self.warnings.append(message)
        self.on_incident(kind, rule=kind, message=message, **fields)

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
            if step in ckpt.list_committed(self.cfg.dir):  # this job's, from an earlier run (`claim`): kept as it is
                log.info("checkpoint of step %d already committed under %s: kept, not written over", step,
                         self.cfg.dir)
                return
            t0 = time.perf_counter()
            try:
                group.call("save_checkpoint", self.cfg.dir, step, timeout_s=self.timeout_s)
            except WorkerLost:
                raise
            except Exception as err:  # noqa: BLE001 - whatever a write raises (read-only, full disk), training goes on
                self._failed(step, err)
                return
            self.pending = (step, {**meta(), "step": step, "copy_seconds": time.perf_counter() - t0})

    def at_end(self, group, step: int, meta: Callable[[], dict]) -> None:
        """Before the job stops at the boundary before `step`: commit the pending checkpoint and write the final one
        (`checkpoint.at_end`, unless that step's is committed already; or one was requested)."""
        final = self.cfg.at_end and not any(c["step"] == step for c in self.committed)
        if final or self.requested:
            self.request(step)
            self.boundary(group, step, meta)
        self.commit_pending(group)

    def commit_pending(self, group) -> None:
        """Commit the pending checkpoint once every writer has finished its part; a writer lost first abandons it
        (WorkerLost is raised on for the controller to recover)."""
        if self.pending is None:
            return
        step, meta = self.pending
        t0 = time.perf_counter()
        try:
            parts = [ckpt.PartInfo(**p) for ps in group.call("checkpoint_parts", timeout_s=self.timeout_s) for p in ps]
        except WorkerLost as lost:
            self.abandon_pending(str(lost))
            raise
        except Exception as err:  # noqa: BLE001 - a part that could not be written
            self.pending = None
            self._failed(step, err)
            return
        self.pending = None
        try:
            path = ckpt.commit(self.cfg.dir, step, parts, meta, self.cfg.keep)
        except (ckpt.CheckpointError, OSError) as err:
            self._failed(step, err)
            return
        self.failures_in_a_row = 0
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
        self._warn("checkpoint_abandoned", f"checkpoint of step {step} abandoned ({why}); the newest checkpoint stays "
                                           f"step {newest}; writing another at the next step boundary",
                   step=step, why=why, newest=newest)

    def _failed(self, step: int, err: Exception) -> None:
        """A write that failed: a warning and an incident; the previous checkpoint stays the newest. The job stops
        (CheckpointError) only after `max_failures_in_a_row` of them."""
        self.failures_in_a_row += 1
        limit = self.cfg.max_failures_in_a_row
        why = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        newest = self.committed[-1]["step"] if self.committed else None
        self._warn("checkpoint_write_failed", f"checkpoint of step {step} could not be written under {self.cfg.dir} "
                                              f"({why}); the newest checkpoint stays step {newest} "
                                              f"({self.failures_in_a_row}/{limit} failures in a row)",
                   step=step, why=why, newest=newest)
        if self.failures_in_a_row >= limit:
            raise ckpt.CheckpointError(f"{self.cfg.dir}: {limit} checkpoint writes failed in a row (last: {why}); "
                                       f"stopping. Free space or make the directory writable, then --resume")


def _mapped_sources(manifest: ckpt.Manifest, root: str) -> dict[int, list]:
    """A checkpoint's parts by stage (`restore_sources`), mapped from their files: in the page cache (which the
    kernel may reclaim), not in the controller's heap."""
    meta = manifest.meta
    states = {r: ckpt.load_part(root, manifest.step, ckpt.part_name(r), mmap=True)
              for r in range(meta["pp"] * meta["ep"])}
    return restore_sources(states, meta["pp"], meta["ep"])


def _changed_fields(stored: dict, current: dict, prefix: str = "") -> list[str]:
    """`key: old -> new` for every leaf that differs between two config dumps."""
    out = []
    for key in sorted(set(stored) | set(current)):
        a, b = stored.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed_fields(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


@torch.no_grad()
def write_seeded_weights(cfg, out: str) -> dict:
    """The model's initial weights (a pure function of train.seed and the model config: every parameter is drawn
    from (seed, its name)) as a weights-only k3ray checkpoint of one part at step 0 under `out` (a new directory),
    in model.dtype: what `k3ray serve --checkpoint` and `k3ray export --hf` read."""
    from pathlib import Path

    from k3ray.model.decoder import build_stage, is_expert_param
    from k3ray.optim import AdamW
    from k3ray.parallel import shards

    if Path(out).exists() and any(Path(out).iterdir()):
        raise ckpt.CheckpointError(f"{out}: not empty; seeded weights go into a new directory")
    m = cfg.model
    stage = build_stage(m, range(m.n_layers), seed=cfg.train.seed)
    state = {"stage": 0, "layers": list(range(m.n_layers)),
             "dense": {n: p.detach() for n, p in stage.named_parameters() if not is_expert_param(n)},
             "opt_dense": {}, "opt_steps": 0, "lr_scale": 1.0,
             "experts": {layer: shards.live_payload(shard, AdamW(cfg.optimizer), shards.shard_prefix(layer))
                         for layer, shard in stage.expert_shards().items()},  # no optimizer state yet
             "router_bias": {i: moe.router.bias.detach() for i, moe in stage.moe_layers().items()}}
    one = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"pp": 1, "ep": 1})})
    meta = {"pp": 1, "ep": 1, "home": [0] * m.n_experts, "last_batch": None, "skip": [], "lr_scale": 1.0,
            "guard_state": {}, "job": cfg.name, "config": one.model_dump(mode="json")}
    part = ckpt.write_part(out, 0, ckpt.part_name(0), state)
    path = ckpt.commit(out, 0, [part], meta, keep=1)
    return {"checkpoint": str(path), "parameters": sum(p.numel() for p in stage.parameters()), "bytes": part.bytes}
