"""The token shard format written by `k3ray data prepare` and read by training (as Megatron's indexed datasets: a
flat token file beside an index of document boundaries, memory-mapped, never loaded whole).

    DIR/shard_00000.bin   uint32 little-endian token ids; every document ends with the tokenizer's end-of-text id
    DIR/shard_00000.idx   uint64 little-endian document end offsets into the .bin, in tokens ([documents])
    DIR/manifest.json     written last: format, tokenizer (name, vocab_size, eos_id, fingerprint), totals, and per
                          shard its name, tokens, documents and sha256 of both files

A shard is written to temporary names and renamed, then its entry; the manifest lists complete shards only. Reading
checks the manifest against the files' sizes (cheap, every start) and, on request, the checksums.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3ray.config import ConfigError

FORMAT = "k3ray-tokens/1"
MANIFEST = "manifest.json"
TOKEN_DTYPE = np.dtype("<u4")
INDEX_DTYPE = np.dtype("<u8")


class ShardError(ConfigError):
    """A shard set that cannot be used; the message names the file."""


def shard_name(i: int) -> str:
    return f"shard_{i:05d}"


def write_shard(folder: Path, name: str, tokens: np.ndarray, doc_ends: np.ndarray) -> dict:
    """Write one shard (tokens [T] uint32, doc_ends [D] uint64, the last equal to T) atomically; its manifest
    entry."""
    entry = {"name": name, "tokens": int(len(tokens)), "documents": int(len(doc_ends))}
    for suffix, array, dtype in ((".bin", tokens, TOKEN_DTYPE), (".idx", doc_ends, INDEX_DTYPE)):
        data = np.ascontiguousarray(array, dtype=dtype).tobytes()
        tmp = folder / f".{name}{suffix}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / f"{name}{suffix}")
        entry[f"{suffix[1:]}_sha256"] = hashlib.sha256(data).hexdigest()
    return entry


def write_json(path: Path, doc: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_manifest(folder: str | Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise ShardError(f"{path}: no manifest (prepare the folder with `k3ray data prepare`)")
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT:
            raise ShardError(f"{path}: format {doc.get('format')!r}, expected {FORMAT!r}")
        for s in doc["shards"]:
            int(s["tokens"]), int(s["documents"]), str(s["name"])
        doc["tokenizer"]["vocab_size"], doc["tokenizer"]["eos_id"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ShardError(f"{path}: unreadable manifest ({type(err).__name__}: {err})") from None
    if not doc["shards"] or sum(s["tokens"] for s in doc["shards"]) == 0:
        raise ShardError(f"{path}: the shard set holds no tokens")
    return doc


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify(folder: str | Path, checksums: bool = False) -> dict:
    """The manifest, once every shard it lists is present with the size its counts give (and, with checksums, the
    bytes it recorded); else ShardError naming the file."""
    folder = Path(folder)
    doc = read_manifest(folder)
    for entry in doc["shards"]:
        verify_entry(folder, entry, checksums)
    return doc


def verify_entry(folder: Path, entry: dict, checksums: bool = False) -> None:
    """One shard's files against its manifest entry: present, the right sizes, and with checksums the same bytes."""
    for suffix, count, dtype in ((".bin", entry["tokens"], TOKEN_DTYPE), (".idx", entry["documents"], INDEX_DTYPE)):
        path = folder / f"{entry['name']}{suffix}"
        if not path.is_file():
            raise ShardError(f"{path}: missing (listed in {folder / MANIFEST})")
        size, want = path.stat().st_size, count * dtype.itemsize
        if size != want:
            raise ShardError(f"{path}: {size} bytes, the manifest says {want} "
                             f"({'truncated' if size < want else 'manifest mismatch'})")
        if checksums and file_sha256(path) != entry[f"{suffix[1:]}_sha256"]:
            raise ShardError(f"{path}: checksum differs from {folder / MANIFEST} (corrupt shard)")


@dataclass
class ShardSet:
    """Every shard of a prepared folder as one memory-mapped token sequence. The pages a read touches come from the
    page cache; nothing is held but the maps and the document table (8 bytes per document).

    tokens: per-shard np.memmap uint32 [T_i]; starts: global offset of each shard [n_shards + 1];
    doc_ends: global end offset of every document [D]."""
    folder: Path
    manifest: dict
    tokens: list[np.ndarray]
    starts: np.ndarray
    doc_ends: np.ndarray

    @classmethod
    def open(cls, folder: str | Path, checksums: bool = False) -> ShardSet:
        folder = Path(folder)
        doc = verify(folder, checksums)
        tokens, ends, offset, starts = [], [], 0, [0]
        for s in doc["shards"]:
            if s["tokens"]:
                tokens.append(np.memmap(folder / f"{s['name']}.bin", dtype=TOKEN_DTYPE, mode="r"))
                # samples are scattered 16 KiB reads: without this each one faults in (and maps) its neighbours
                # too, 3 ms instead of 25 us a read on a 1e10-token set (benchmarks/data_loader.py)
                tokens[-1]._mmap.madvise(mmap.MADV_RANDOM)
                idx = np.fromfile(folder / f"{s['name']}.idx", dtype=INDEX_DTYPE)
                if len(idx) and int(idx[-1]) != s["tokens"]:
                    raise ShardError(f"{folder / s['name']}.idx: its last document ends at {int(idx[-1])}, the "
                                     f"shard holds {s['tokens']} tokens")
                ends.append(idx.astype(np.int64) + offset)
                offset += s["tokens"]
                starts.append(offset)
        return cls(folder, doc, tokens, np.asarray(starts, dtype=np.int64), np.concatenate(ends))

    @property
    def n_tokens(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of the whole set (int64 [n]), across shard boundaries."""
        out = np.empty(n, dtype=np.int64)
        i, done = int(np.searchsorted(self.starts, start, side="right")) - 1, 0
        while done < n:
            local = start + done - int(self.starts[i])
            take = min(n - done, len(self.tokens[i]) - local)
            out[done:done + take] = self.tokens[i][local:local + take]
            done, i = done + take, i + 1
        return out
