"""Durable, verified checkpoints: parts written atomically by workers, a manifest written last by the controller.

Layout of step N under a root directory:

    <root>/step_<N:09d>/<name>          one file per worker part (torch.save of a dict of CPU tensors and scalars)
    <root>/step_<N:09d>/manifest.json   written LAST; a step dir without it is incomplete and ignored

Every file lands through `<file>.tmp` + flush + fsync + `os.replace`, and the directory is fsynced before and after
the manifest, so a crash leaves either the previous checkpoint or the complete new one, never a half-written
file under a final name. The manifest records each part's size and sha256; `verify` rechecks both, and
`latest_verified` falls back to the newest step that passes. Readers never modify or delete anything: a corrupt
checkpoint stays on disk for inspection (a resume moves it aside with `move_aside`, so that the resumed run does not
write over it). Only `commit` deletes (retention), and only other steps.

Typical use: every worker calls `write_part` (or `AsyncWriter.submit`) and returns its PartInfo; the controller
calls `commit` with all of them and the run's metadata; on restart `latest_verified(root)` says where to resume
and each worker calls `load_part`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

__all__ = ["CheckpointError", "PartInfo", "Manifest", "AsyncWriter", "write_part", "commit", "list_committed",
           "verify", "latest_verified", "scan", "move_aside", "load_part", "step_dir", "shape_mismatches",
           "FORMAT_VERSION"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_FORMAT_NAME = "k3ray-checkpoint"
_MANIFEST_KEYS = ("format", "version", "step", "created", "parts", "meta")
_PART_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_STEP_DIR = re.compile(r"step_(\d{9,})")
_CHUNK = 8 << 20  # bytes read per sha256 update

log = logging.getLogger("k3ray.checkpoint")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found, verified or loaded; the message names the path and the problem."""


@dataclass(frozen=True)
class PartInfo:
    """One part file of a step: its name in the step dir, its size in bytes and the sha256 hex digest."""
    name: str
    bytes: int
    sha256: str

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Manifest:
    """A committed step as recorded in its manifest.json; `path` is the step dir."""
    step: int
    parts: dict[str, PartInfo]
    meta: dict
    created: str  # ISO-8601 UTC
    path: Path = field(compare=False)
    version: int = FORMAT_VERSION


# -- paths --------------------------------------------------------------------------------------------------------
def part_name(world_rank: int) -> str:
    """The file name of world rank `world_rank`'s part inside a step directory."""
    return f"rank{world_rank:05d}.pt"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:09d}"


def _check_name(root, step: int, name: str) -> None:
    if not isinstance(name, str) or not _PART_NAME.fullmatch(name) or name in (".", "..") or name == MANIFEST:
        raise CheckpointError(f"{step_dir(root, step)}: invalid part name {name!r}: use only [A-Za-z0-9_.-] "
                              f"(and not {MANIFEST!r}, '.', '..')")


def _check_step(step: int) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"invalid step {step!r}: must be an int >= 0")


def _step_dirs(root: Path) -> dict[int, Path]:
    """step -> dir for every `step_<N>` directory under root (committed or not); {} when root is missing."""
    if not root.is_dir():
        return {}
    out = {}
    for entry in root.iterdir():
        m = _STEP_DIR.fullmatch(entry.name)
        if m and entry.is_dir():
            out[int(m.group(1))] = entry
    return out


# -- durable writes -----------------------------------------------------------------------------------------------
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
    _check_step(step)
    _check_name(root, step, name)
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
        _check_step(step)
        _check_name(root, step, name)
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


# -- commit and retention -----------------------------------------------------------------------------------------
def commit(root: str | os.PathLike, step: int, parts: list[PartInfo], meta: dict, keep: int) -> Path:
    """Write manifest.json for `step` (after its parts), making it a checkpoint; then apply retention.

    Checks each part's file exists with its recorded size (sha256 is rechecked by `verify`, not here). Retention
    deletes committed steps older than the newest `keep` (never `step` itself) and incomplete step dirs older than
    the newest committed step. Returns the step dir."""
    _check_step(step)
    if not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"{root}: keep={keep!r} must be an int >= 1")
    d = step_dir(root, step)
    names = [p.name for p in parts]
    if not parts or len(set(names)) != len(names):
        raise CheckpointError(f"{d}: commit needs at least one part and unique names, got {names}")
    for p in parts:
        _check_name(root, step, p.name)
        f = d / p.name
        if not f.is_file():
            raise CheckpointError(f"{f}: part missing at commit (was write_part called for step {step}?)")
        if f.stat().st_size != p.bytes:
            raise CheckpointError(f"{f}: size {f.stat().st_size} != PartInfo {p.bytes} at commit")
    doc = {"format": _FORMAT_NAME, "version": FORMAT_VERSION, "step": step,
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
    dirs = _step_dirs(root)
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


# -- reading (never modifies anything) ----------------------------------------------------------------------------
def model_hash(config: dict) -> str:
    """A short hash of a job config dump's model section: which model a checkpoint holds."""
    return hashlib.sha256(json.dumps(config.get("model"), sort_keys=True).encode()).hexdigest()[:16]


def owner(root: str | os.PathLike) -> dict | None:
    """What the newest committed checkpoint under root says of the job that wrote it (its manifest read, not
    verified): {"job", "model_hash", "config"}; None when there is none. The job a checkpoint folder belongs to."""
    for step in reversed(list_committed(root)):
        try:
            meta = _read_manifest(root, step).meta
        except CheckpointError:
            continue
        config = meta.get("config") or {}
        return {"job": meta.get("job"), "model_hash": meta.get("model_hash") or model_hash(config), "config": config}
    return None


def list_committed(root: str | os.PathLike) -> list[int]:
    """Steps under root that have a manifest.json, ascending (not verified; see latest_verified)."""
    return sorted(s for s, d in _step_dirs(Path(root)).items() if (d / MANIFEST).is_file())


def _read_manifest(root, step: int) -> Manifest:
    d = step_dir(root, step)
    path = d / MANIFEST
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (incomplete checkpoint)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable or not JSON ({e})") from e
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    missing = [k for k in _MANIFEST_KEYS if k not in doc]
    if missing:
        raise CheckpointError(f"{path}: missing keys {missing}")
    if doc["format"] != _FORMAT_NAME or doc["version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {doc['format']!r} v{doc['version']!r}, this reader knows "
                              f"{_FORMAT_NAME!r} v{FORMAT_VERSION}")
    if doc["step"] != step:
        raise CheckpointError(f"{path}: records step {doc['step']!r}, dir says {step}")
    try:
        parts = {p["name"]: PartInfo(str(p["name"]), int(p["bytes"]), str(p["sha256"])) for p in doc["parts"]}
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed parts list ({e!r})") from e
    if not isinstance(doc["meta"], dict):
        raise CheckpointError(f"{path}: meta must be a JSON object")
    return Manifest(step, parts, doc["meta"], str(doc["created"]), d, doc["version"])


def _sha256_file(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def verify(root: str | os.PathLike, step: int) -> Manifest:
    """Manifest of `step` after checking it parses and every part exists with the recorded size and sha256.
    Raises CheckpointError naming the first problem (path relative to root)."""
    m = _read_manifest(root, step)
    for p in m.parts.values():
        f = m.path / p.name
        rel = f"{m.path.name}/{p.name}"
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{rel}: missing (listed in manifest) under {root}") from None
        if size != p.bytes:
            hint = "truncated?" if size < p.bytes else "overwritten?"
            raise CheckpointError(f"{rel}: size {size} != manifest {p.bytes} ({hint}) under {root}")
        try:
            sha = _sha256_file(f)
        except OSError as e:
            raise CheckpointError(f"{rel}: unreadable ({e}) under {root}") from e
        if sha != p.sha256:
            raise CheckpointError(f"{rel}: sha256 {sha[:12]}… != manifest {p.sha256[:12]}… (corrupted) "
                                  f"under {root}")
    return m


def scan(root: str | os.PathLike) -> tuple[Manifest | None, list[tuple[int, str]]]:
    """(newest committed step that verifies or None, [(step, what is wrong)] for every newer step dir that does not:
    a committed one that fails verification, or one holding parts but no manifest, an interrupted write or a deleted
    manifest). Modifies nothing."""
    dirs = _step_dirs(Path(root))
    problems: list[tuple[int, str]] = []
    found = None
    for step in sorted(dirs, reverse=True):
        if not (dirs[step] / MANIFEST).is_file():
            if any(f.is_file() and not f.name.endswith(".tmp") for f in dirs[step].iterdir()):
                problems.append((step, f"{dirs[step].name}: parts without {MANIFEST} (an interrupted write or a "
                                       f"deleted manifest)"))
            continue
        try:
            found = verify(root, step)
            break
        except CheckpointError as e:
            problems.append((step, str(e)))
    return found, problems


def latest_verified(root: str | os.PathLike) -> Manifest | None:
    """Newest committed step that verifies; a warning on logger 'k3ray.checkpoint' for each newer one that does
    not. None when nothing verifies or root is missing. Failed checkpoints are left on disk untouched."""
    found, problems = scan(root)
    target = f"falling back to step {found.step}" if found else "no checkpoint verifies"
    for step, why in problems:
        log.warning("checkpoint step %d failed verification: %s; %s", step, why, target)
    return found


def move_aside(root: str | os.PathLike, step: int) -> Path:
    """Rename a damaged step dir to `step_<N>.damaged-<UTC time>` (kept for inspection, never written to again,
    invisible to readers and retention). Returns the new path."""
    d = step_dir(root, step)
    target = d.with_name(f"{d.name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    n = 1
    while target.exists():
        target = target.with_name(f"{target.name.split('~')[0]}~{n}")
        n += 1
    os.replace(d, target)
    return target


def shape_mismatches(stored: dict, current: dict) -> list[str]:
    """The fields that decide tensor shapes (every `model.*` field and `parallel.pp`) on which a checkpoint's
    stored config and the current one differ, as 'field: checkpoint X, config Y'. Both are JobConfig dumps."""
    out = []
    for section, keys in (("model", None), ("parallel", ("pp",))):
        old, new = stored.get(section, {}), current.get(section, {})
        for key in keys or sorted(new):  # a field the schema no longer has decides no shape
            if old.get(key) != new.get(key):
                out.append(f"{section}.{key}: checkpoint {old.get(key)!r}, config {new.get(key)!r}")
    return out


def load_part(root: str | os.PathLike, step: int, name: str, map_location="cpu", mmap: bool = False) -> dict:
    """torch.load(weights_only=True) of one part (does not recheck sha256: call verify/latest_verified first). With
    mmap, tensors are mapped from the file and read when touched (a part larger than memory can be streamed)."""
    _check_name(root, step, name)
    path = step_dir(root, step) / name
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as e:  # noqa: BLE001 - torch raises many types for damaged files; all mean "cannot load"
        raise CheckpointError(f"{path}: cannot load ({type(e).__name__}: {e})") from e
