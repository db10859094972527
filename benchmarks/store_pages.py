"""A snapshot's way into the object store, fresh pages against touched ones: a worker streams N chunks of 1 GiB into
the node's store (as `Worker.snapshot` does) three times, on a local Ray cluster of its own; the first round writes
into pages the store has never used (the kernel allocates and zeroes each one as it is first touched), the later
ones into pages the round before freed. `--warm` first puts and frees N GiB of zeros from the same worker (pages
touched before the first snapshot); `--prealloc` starts the store with Ray's `preallocate_plasma_memory` (the
raylet maps the store populated; the worker's own mapping still faults).

    python benchmarks/store_pages.py [--gib 2] [--warm | --prealloc]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import ray

GiB = 1 << 30


@ray.remote
class ChunkWriter:
    def __init__(self):
        self.chunk = np.ones(GiB, np.uint8)  # a host chunk, its pages touched: only the store's pages are fresh

    def warm(self, n: int) -> float:
        t0 = time.perf_counter()
        refs = [ray.put(np.zeros(GiB, np.uint8)) for _ in range(n)]
        del refs
        return time.perf_counter() - t0

    @ray.method(num_returns="streaming")
    def stream(self, n: int):
        for _ in range(n):
            yield self.chunk


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=int, default=2, help="chunks of 1 GiB per round")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--warm", action="store_true")
    how.add_argument("--prealloc", action="store_true")
    args = ap.parse_args()
    ray.init(num_cpus=2, object_store_memory=(args.gib + 1) * GiB, include_dashboard=False, log_to_driver=False,
             _system_config={"preallocate_plasma_memory": True} if args.prealloc else {})
    try:
        writer = ChunkWriter.remote()
        ray.get(writer.__ray_ready__.remote())
        rows = []
        if args.warm:
            rows.append(("warm: put and free", ray.get(writer.warm.remote(args.gib))))
            time.sleep(2)  # the freed objects' space goes back to the store
        for r in range(3):
            t0 = time.perf_counter()
            refs = list(writer.stream.remote(args.gib))
            ray.wait(refs, num_returns=len(refs), fetch_local=False)
            rows.append((f"round {r}: {args.gib} GiB arrived", time.perf_counter() - t0))
            del refs
            time.sleep(2)
    finally:
        ray.shutdown()
    print("| what | s | s per GiB |\n|---|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.2f} | {seconds / args.gib:.2f} |")


if __name__ == "__main__":
    main()
