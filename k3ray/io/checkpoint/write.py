"""Writing checkpoints: parts land atomically and durably (in the background with AsyncWriter), the manifest is
committed last, and retention deletes old steps (never the one just committed)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from k3ray.io.checkpoint.layout import (FORMAT_NAME, FORMAT_VERSION, MANIFEST, CheckpointError, PartInfo, check_name,
                                        check_step, step_dir, step_dirs)

log = logging.getLogger("k3ray.checkpoint")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """File-like wrapper that hashes and counts the bytes torch.save writes, so no second read is needed."""

    def __init__(self, f):
        self.f, self.sha, self.n = f, hashlib.sha256(), 0

    def write(self, b) -> int:
        self.sha.update(b)
        self.n += len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def _atomic_write(path: Path, fill, abandoned: threading.Event | None = None) -> tuple[int, str]:
    """Write `path` through a temporary file of this process and thread (fill(writer) produces the bytes), fsync,
    rename; return (bytes, sha256). Two writers of the same name (an abandoned one and its replacement, after ranks
    were renumbered) never share the temporary file; one whose `abandoned` is set by then drops it unrenamed."""
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            w = _HashingWriter(f)
            fill(w)
            f.flush()
            os.fsync(f.fileno())
        if abandoned is not None and abandoned.is_set():
            raise CheckpointError(f"{path}: write abandoned (its checkpoint was given up)")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return w.n, w.sha.hexdigest()


def write_part(root: str | os.PathLike, step: int, name: str, state: dict,
               abandoned: threading.Event | None = None) -> PartInfo:
    """torch.save `state` to <root>/step_<N>/<name> atomically and durably; creates the step dir.

    `state` holds tensors, ints, floats, strings, lists and dicts (what `load_part` can read back with
    weights_only=True). Returns the PartInfo to hand to `commit`."""
    import torch  # here, as in read.py: the package imports no torch until a part is written or read

    check_step(step)
    check_name(root, step, name)
    d = step_dir(root, step)
    try:
        d.mkdir(parents=True, exist_ok=True)
        if (d / MANIFEST).is_file():  # a committed checkpoint is never written over
            raise CheckpointError(f"{d}: already a committed checkpoint; its parts are not written over")
        n, sha = _atomic_write(d / name, lambda w: torch.save(state, w), abandoned)
    except OSError as e:
        raise CheckpointError(f"{d / name}: write failed: {e}") from e
    return PartInfo(name, n, sha)


def _cpu_tensors_only(obj, where: str) -> None:
    import torch  # as in write_part

    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise CheckpointError(f"{where}: tensor on {obj.device}; AsyncWriter takes CPU tensors "
                                  f"(pass t.detach().cpu().clone())")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _cpu_tensors_only(v, f"{where}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _cpu_tensors_only(v, f"{where}[{i}]")


class AsyncWriter:
    """Writes parts on one background thread so a worker can return to training while its part is written.

    The caller hands over ownership: `state` must hold CPU tensors it will NOT mutate until the future is done.
    Clone first, e.g. `{k: v.detach().cpu().clone() for k, v in model.state_dict().items()}` (on a GPU, `.cpu()`
    already copies). Parts are written in submission order. Use as a context manager or call `close()`."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3ray-ckpt")
        self._pending: list[Future] = []
        self._abandoned = threading.Event()  # set for the parts submitted before the last forget()

    def submit(self, root: str | os.PathLike, step: int, name: str, state: dict) -> Future:
        """Queue write_part(root, step, name, state); the Future resolves to its PartInfo (or raises its error)."""
        check_step(step)
        check_name(root, step, name)
        _cpu_tensors_only(state, f"{step_dir(root, step) / name}: state")
        fut = self._pool.submit(write_part, root, step, name, state, self._abandoned)
        self._pending.append(fut)
        return fut

    def wait(self) -> list[PartInfo]:
        """Block until every part submitted since the last wait() is written; their PartInfos in submission
        order. Raises the first failure (after all have finished)."""
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        for e in errors:
            if e is not None:
                raise e
        return [f.result() for f in pending]

    def forget(self) -> None:
        """Give up the parts submitted so far (their checkpoint was abandoned): those not started are cancelled, the
        one being written is dropped before its rename (it never lands under the part's name, where the new grid
        writes its own), and wait() no longer reports them."""
        self._abandoned.set()
        self._abandoned = threading.Event()
        for fut in self._pending:
            fut.cancel()
        self._pending = []

    def close(self) -> None:
        """Finish queued writes and stop the thread (errors stay in their futures)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> AsyncWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def commit(root: str | os.PathLike, step: int, parts: list[PartInfo], meta: dict, keep: int) -> Path:
    """Write manifest.json for `step` (after its parts), making it a checkpoint; then apply retention.

    Checks each part's file exists with its recorded size (sha256 is rechecked by `verify`, not here). Retention
    deletes committed steps older than the newest `keep` (never `step` itself) and incomplete step dirs older than
    the newest committed step. Returns the step dir."""
    check_step(step)
    if not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"{root}: keep={keep!r} must be an int >= 1")
    d = step_dir(root, step)
    names = [p.name for p in parts]
    if not parts or len(set(names)) != len(names):
        raise CheckpointError(f"{d}: commit needs at least one part and unique names, got {names}")
    for p in parts:
        check_name(root, step, p.name)
        f = d / p.name
        if not f.is_file():
            raise CheckpointError(f"{f}: part missing at commit (was write_part called for step {step}?)")
        if f.stat().st_size != p.bytes:
            raise CheckpointError(f"{f}: size {f.stat().st_size} != PartInfo {p.bytes} at commit")
    doc = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "step": step,
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "parts": [p.to_json() for p in parts], "meta": meta}
    try:
        text = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{d / MANIFEST}: meta is not plain JSON: {e}") from e
    try:
        _fsync_dir(d)  # the parts' renames are durable before the manifest can be
        _atomic_write(d / MANIFEST, lambda w: w.write(text))
        _fsync_dir(d)
        _fsync_dir(Path(root))
    except OSError as e:
        raise CheckpointError(f"{d / MANIFEST}: write failed: {e}") from e
    _apply_retention(Path(root), step, keep)
    return d


def _apply_retention(root: Path, just_committed: int, keep: int) -> None:
    dirs = step_dirs(root)
    committed = sorted(s for s, d in dirs.items() if (d / MANIFEST).is_file())
    keep_set = set(committed[-keep:]) | {just_committed}
    newest = committed[-1]
    for s, d in sorted(dirs.items()):
        is_committed = s in committed
        if (is_committed and s not in keep_set) or (not is_committed and s < newest):
            _remove_step(d, "old checkpoint" if is_committed else "stale incomplete checkpoint")


def _remove_step(d: Path, why: str) -> None:
    """Drop the manifest first, so an interrupted delete leaves an incomplete dir, never a broken committed one."""
    try:
        (d / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(d)
        log.info("retention: removed %s %s", why, d)
    except OSError as e:
        log.warning("retention: could not remove %s %s: %s", why, d, e)
