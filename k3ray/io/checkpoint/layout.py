"""The checkpoint layout: step directories, part names, the manifest's records, and the one error type."""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
FORMAT_NAME = "k3ray-checkpoint"
_PART_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_STEP_DIR = re.compile(r"step_(\d{9,})")


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


def check_name(root, step: int, name: str) -> None:
    if not isinstance(name, str) or not _PART_NAME.fullmatch(name) or name in (".", "..") or name == MANIFEST:
        raise CheckpointError(f"{step_dir(root, step)}: invalid part name {name!r}: use only [A-Za-z0-9_.-] "
                              f"(and not {MANIFEST!r}, '.', '..')")


def check_step(step: int) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"invalid step {step!r}: must be an int >= 0")


def step_dirs(root: Path) -> dict[int, Path]:
    """step -> dir for every `step_<N>` directory under root (committed or not); {} when root is missing."""
    if not root.is_dir():
        return {}
    out = {}
    for entry in root.iterdir():
        m = _STEP_DIR.fullmatch(entry.name)
        if m and entry.is_dir():
            out[int(m.group(1))] = entry
    return out
