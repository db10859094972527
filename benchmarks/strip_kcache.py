"""Shrink a kept kernel cache tarball (`k3ray warmup`, benchmarks/profile_gpu.sh's $OUT/kcache.tar.xz) to what a
cache hit reads: each Triton kernel's binary (.cubin), its metadata (.json) and the launchers (.so); the
intermediate IR (.source, .ttir, .ttgir, .llir, .ptx) is dropped and every kernel's group file rewritten to list only
what stays (Triton treats a group naming a missing file as a miss). ~11.5 MB -> ~3.8 MB, so Ray's carry, the grammar
libraries and the kernel cache fit one device call.

    python benchmarks/strip_kcache.py IN.tar.xz OUT.tar.xz
"""
from __future__ import annotations

import json
import sys
import tarfile
import tempfile
from pathlib import Path

KEEP = (".cubin", ".json", ".so")


def strip(folder: Path) -> int:
    """Drop the IR files of every Triton kernel group under folder; the number of files removed."""
    removed = 0
    for group in folder.glob("triton/*/__grp__*.json"):
        paths = json.loads(group.read_text())["child_paths"]
        kept = {name: path for name, path in paths.items() if name.endswith(KEEP)}
        for name in paths.keys() - kept.keys():
            (group.parent / name).unlink(missing_ok=True)
            removed += 1
        group.write_text(json.dumps({"child_paths": kept}))
    return removed


def main(argv: list[str]) -> None:
    src, dst = (Path(a) for a in argv)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(src) as t:
            t.extractall(tmp, filter="tar")
        print(f"removed {strip(Path(tmp))} IR files")
        with tarfile.open(dst, "w:xz") as t:
            t.add(tmp, arcname=".")
    print(f"{src}: {src.stat().st_size / 1e6:.1f} MB -> {dst}: {dst.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main(sys.argv[1:])
