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

A module per concern: `layout` (paths, part names, the manifest's records), `write` (parts, commit, retention),
`read` (verification, fallback, loading); every name is imported from here.
"""
from k3ray.io.checkpoint.layout import FORMAT_VERSION, CheckpointError, Manifest, PartInfo, part_name, step_dir
from k3ray.io.checkpoint.read import (latest_verified, list_committed, load_part, model_hash, move_aside, owner,
                                      read_manifest, scan, shape_mismatches, verify)
from k3ray.io.checkpoint.write import AsyncWriter, commit, write_part

__all__ = ["CheckpointError", "PartInfo", "Manifest", "AsyncWriter", "write_part", "commit", "list_committed",
           "verify", "read_manifest", "latest_verified", "scan", "move_aside", "load_part", "step_dir",
           "shape_mismatches", "FORMAT_VERSION", "part_name", "model_hash", "owner"]
