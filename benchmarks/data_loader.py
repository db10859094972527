"""The shard loader's cost per training step, and random access into a shard set of >= 1e10 tokens.

A sparse shard set (one .bin of --tokens uint32 tokens, holes read as zeros; --documents documents) is made under
--dir; then, for the gpu2 config's batch shape (seq_len 4096, 1 row per micro-batch, 4 micro-batches, 2 EP ranks),
one worker's batches of random steps are read (its micro-batches: M reads of seq_len + 1 tokens each), timed, and the
process's memory read before and after (RssAnon: what the loader allocates; RssFile: mapped file pages, which the
kernel reclaims). Prints a table.

    python benchmarks/data_loader.py [--tokens 1e10] [--steps 2000] [--dir /tmp/k3ray-sparse]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import numpy as np

from k3ray.config import load_config
from k3ray.io import shards
from k3ray.shard_data import ShardData

STEP_S = 0.8  # the gpu2 config's step time on two H200s (benchmarks/RESULTS.md)


def memory() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssFile", "VmRSS"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def sparse_set(folder: Path, n_tokens: int, n_docs: int) -> None:
    """One shard of n_tokens (a sparse file) and n_docs documents of equal length."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "shard_00000.bin", "wb") as f:
        f.truncate(n_tokens * shards.TOKEN_DTYPE.itemsize)
    ends = np.linspace(n_tokens / n_docs, n_tokens, n_docs).astype(np.uint64)
    ends[-1] = n_tokens
    ends.tofile(folder / "shard_00000.idx")
    shards.write_json(folder / shards.MANIFEST, {
        "format": shards.FORMAT, "tokens": n_tokens, "documents": n_docs,
        "shards": [{"name": "shard_00000", "tokens": n_tokens, "documents": n_docs, "bin_sha256": "(not computed)",
                    "idx_sha256": "(not computed)"}],
        "tokenizer": {"name": "bytes", "vocab_size": 256, "eos_id": 0, "fingerprint": "bytes"}})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=float, default=1e10)
    p.add_argument("--documents", type=int, default=1_000_000)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--dir", default="/tmp/k3ray-sparse")
    args = p.parse_args()
    folder = Path(args.dir)
    sparse_set(folder, int(args.tokens), args.documents)
    try:
        cfg = load_config("configs/gpu2.yaml", {"data.source": str(folder), "data.tokenizer": "bytes"})
        par = cfg.parallel
        t0 = time.perf_counter()
        data = ShardData(cfg.data, cfg.train.seed, par.ep, par.micro_batches)
        open_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        steps = rng.integers(0, data.n_train // data.samples_per_batch, args.steps)
        for b in steps[:20]:  # warm: imports, first faults
            data.batch(int(b), 0, 0)
        before = memory()
        times = []
        for b in steps:
            t0 = time.perf_counter()
            for m in range(par.micro_batches):  # one worker's micro-batches of a step (EP rank 1)
                data.batch(int(b), 1, m)
            times.append(time.perf_counter() - t0)
        after = memory()
    finally:
        shutil.rmtree(folder)
    med = statistics.median(times)
    p99 = sorted(times)[int(0.99 * len(times))]
    print(f"shard set: {data.shards.n_tokens:.3g} tokens (sparse, {args.documents:,} documents), "
          f"{data.n_train:,} training samples of {cfg.data.seq_len + 1} tokens; opened in {open_s * 1e3:.1f} ms")
    print(f"batch shape: {par.micro_batches} micro-batches x {cfg.data.micro_batch_size} x {cfg.data.seq_len + 1} "
          f"per worker and step ({args.steps} random steps)")
    print(f"{'loader time per step':<34}{'median':>12}{'p99':>12}{'% of a 0.8 s step':>20}")
    print(f"{'':<34}{med * 1e3:>10.3f}ms{p99 * 1e3:>10.3f}ms{100 * med / STEP_S:>19.3f}%")
    print(f"{'memory over the steps (MiB)':<34}{'before':>12}{'after':>12}{'growth':>20}")
    for key in ("RssAnon", "RssFile", "VmRSS"):
        print(f"  {key:<32}{before[key] / 2**20:>12.1f}{after[key] / 2**20:>12.1f}"
              f"{(after[key] - before[key]) / 2**20:>20.1f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
