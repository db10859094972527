"""Reading checkpoints, which never modifies anything but `move_aside`: which steps are committed, verification
(sizes and sha256 against the manifest), the newest step that verifies, loading a part, and what a checkpoint says of
the job that wrote it."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from k3ray.io.checkpoint.layout import (FORMAT_NAME, FORMAT_VERSION, MANIFEST, CheckpointError, Manifest, PartInfo,
                                        check_name, step_dir, step_dirs)
from k3ray.io.json_object import read_json_object

log = logging.getLogger("k3ray.checkpoint")
MANIFEST_KEYS = ("format", "version", "step", "created", "parts", "meta")
CHUNK = 8 << 20  # bytes read per sha256 update


def model_hash(config: dict) -> str:
    """A short hash of a job config dump's model section: which model a checkpoint holds."""
    return hashlib.sha256(json.dumps(config.get("model"), sort_keys=True).encode()).hexdigest()[:16]


def owner(root: str | os.PathLike) -> dict | None:
    """What the newest committed checkpoint under root says of the job that wrote it (its manifest read, not
    verified): {"job", "model_hash", "config"}; None when there is none. The job a checkpoint folder belongs to."""
    for step in reversed(list_committed(root)):
        try:
            meta = read_manifest(root, step).meta
        except CheckpointError:
            continue
        config = meta.get("config") or {}
        return {"job": meta.get("job"), "model_hash": meta.get("model_hash") or model_hash(config), "config": config}
    return None


def list_committed(root: str | os.PathLike) -> list[int]:
    """Steps under root that have a manifest.json, ascending (not verified; see latest_verified)."""
    return sorted(s for s, d in step_dirs(Path(root)).items() if (d / MANIFEST).is_file())


def read_manifest(root, step: int) -> Manifest:
    """The manifest of `step`, parsed and checked for form, its parts not verified (`verify` does that)."""
    d = step_dir(root, step)
    path = d / MANIFEST
    doc = read_json_object(path, CheckpointError, "missing (incomplete checkpoint)")
    missing = [k for k in MANIFEST_KEYS if k not in doc]
    if missing:
        raise CheckpointError(f"{path}: missing keys {missing}")
    if doc["format"] != FORMAT_NAME or doc["version"] != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format {doc['format']!r} v{doc['version']!r}, this reader knows "
                              f"{FORMAT_NAME!r} v{FORMAT_VERSION}")
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
        while chunk := f.read(CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def verify(root: str | os.PathLike, step: int) -> Manifest:
    """Manifest of `step` after checking it parses and every part exists with the recorded size and sha256.
    Raises CheckpointError naming the first problem (path relative to root)."""
    m = read_manifest(root, step)
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
    dirs = step_dirs(Path(root))
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
    import torch  # here: reading what a checkpoint says (`owner`, manifests) imports no torch (`k3ray serve`'s checks)

    check_name(root, step, name)
    path = step_dir(root, step) / name
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as e:  # noqa: BLE001 - torch raises many types for damaged files; all mean "cannot load"
        raise CheckpointError(f"{path}: cannot load ({type(e).__name__}: {e})") from e
