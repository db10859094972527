"""Control-plane figures while a tiny job trains (local Ray cluster, pp=1 ep=1 by default):
latency (p50, p99) of GET /v1/status and PUT /v1/policies/scheduling, step time with and without API load, and
the metrics publishing cost per step (measured inside the controller around JobMetrics.publish + sync).

    python benchmarks/control_api.py [--requests 2000] [--ep 1]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import ray

from k3ray.config import load_config
from k3ray.control.driver import running_job
from k3ray.control.ray_cluster import init_ray

REPO = Path(__file__).resolve().parents[1]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--ep", type=int, default=1)
    args = ap.parse_args()

    runs = Path(tempfile.mkdtemp(prefix="k3ray-bench-"))
    cfg = load_config(REPO / "configs/tiny.yaml", {"name": "bench", "train.eval_every": 0, "parallel.pp": 1,
                                                   "parallel.ep": args.ep,
                                                   "api.token_file": str(runs / "bench" / "api_token")})
    init_ray(None, cfg.parallel.world_size)
    try:
        with running_job(cfg) as controller:
            url = ray.get(controller.status.remote())["api_url"]
            token = (runs / "bench" / "api_token").read_text().strip()
            halt, step_s, step = threading.Event(), [], [0]

            def train() -> None:
                while not halt.is_set():
                    t0 = time.perf_counter()
                    ray.get(controller.train_step.remote(step[0], step[0]))
                    step_s.append(time.perf_counter() - t0)
                    step[0] += 1

            thread = threading.Thread(target=train, daemon=True)
            thread.start()
            try:
                while step[0] < 5:  # warm-up
                    time.sleep(0.1)
                time.sleep(3.0)
                idle_steps = list(step_s[5:])
                client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
                n_before = len(step_s)
                get_ms, put_ms = [], []
                for i in range(args.requests):
                    t0 = time.perf_counter()
                    client.get("/v1/status").raise_for_status()
                    get_ms.append((time.perf_counter() - t0) * 1e3)
                for i in range(args.requests // 2):
                    t0 = time.perf_counter()
                    client.put("/v1/policies/scheduling", json={"enabled": i % 2 == 0}).raise_for_status()
                    put_ms.append((time.perf_counter() - t0) * 1e3)
                loaded_steps = list(step_s[n_before:])
                overhead = ray.get(controller.__ray_call__.remote(
                    lambda self: [s for c in self.callbacks for s in getattr(c, "overhead_s", [])]))
            finally:
                halt.set()
                thread.join(timeout=120)
    finally:
        ray.shutdown()

    steps_all = step_s[5:]
    rows = [
        ("GET /v1/status latency", f"{statistics.median(get_ms):.2f} ms", f"{pct(get_ms, 0.99):.2f} ms", len(get_ms)),
        ("PUT /v1/policies/scheduling latency", f"{statistics.median(put_ms):.2f} ms",
         f"{pct(put_ms, 0.99):.2f} ms", len(put_ms)),
        ("step time, API idle", f"{statistics.median(idle_steps) * 1e3:.1f} ms",
         f"{pct(idle_steps, 0.99) * 1e3:.1f} ms", len(idle_steps)),
        ("step time, API under load", f"{statistics.median(loaded_steps) * 1e3:.1f} ms",
         f"{pct(loaded_steps, 0.99) * 1e3:.1f} ms", len(loaded_steps)),
        ("metrics publish per step", f"{statistics.median(overhead) * 1e3:.3f} ms",
         f"{pct(overhead, 0.99) * 1e3:.3f} ms", len(overhead)),
        ("publish / step time (medians)", f"{statistics.median(overhead) / statistics.median(steps_all) * 100:.2f} %",
         "", ""),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'p50':>12}  {'p99':>12}  {'n':>5}")
    for name, p50, p99, n in rows:
        print(f"{name:<{width}}  {p50:>12}  {p99:>12}  {n!s:>5}")


if __name__ == "__main__":
    main()
