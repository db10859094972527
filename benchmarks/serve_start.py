"""`k3ray serve`'s start, from outside: the command started as a user starts it, its time to `/health` answering 200
and to the first answered request (one completion of `--max-tokens` tokens), with the start's phases: the command's
own (imports, Ray's start, the engine actor, the front doors: its `started` line) and the engine's
(`start_seconds`), both from the line it prints once serving. Prints one table row per run, then the median of
each phase.

    python benchmarks/serve_start.py --checkpoint CKPT [--runs 3] [--set serve.KEY=VALUE ...]
    python benchmarks/serve_start.py --config configs/gpu2.yaml --set model.n_layers=4   # seeded weights first

Without --checkpoint the config's seeded weights (`k3ray init`, not timed) go into a temporary directory. Every run
starts its own local Ray cluster (the command's embedded default) and stops it with Ctrl-C (SIGINT) at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

ENGINE = ["read_weights", "hold_weights", "place_and_start_workers", "worker_process", "worker_imports", "worker_cuda",
          "worker_parts", "process_groups", "restore", "cache_pools", "graph_capture", "first_graph"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seeded(config: str, sets: list[str], out: str) -> None:
    cmd = [sys.executable, "-m", "k3ray", "init", "--config", config, "--out", out]
    subprocess.run(cmd + [a for s in sets for a in ("--set", s)], check=True, stdout=subprocess.DEVNULL)


def one_start(checkpoint: str, sets: list[str], max_tokens: int, timeout_s: float, show_output: bool) -> dict:
    """Start `k3ray serve`, wait for /health then one answer; the seconds of each from the command's start, and its
    phases."""
    port = free_port()
    cmd = [sys.executable, "-m", "k3ray", "serve", "--checkpoint", checkpoint, "--port", str(port)]
    cmd += [a for s in sets for a in ("--set", s)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    out: dict = {}
    try:
        with httpx.Client(timeout=10.0) as client:
            while "health" not in out:
                if proc.poll() is not None or time.perf_counter() - t0 > timeout_s:
                    raise RuntimeError("k3ray serve did not come up:\n" + "\n".join(l for _, l in lines[-30:]))
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        out["health"] = time.perf_counter() - t0
                except httpx.TransportError:
                    time.sleep(0.05)
            model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            r = client.post(f"{url}/v1/completions", timeout=timeout_s,
                            json={"model": model, "prompt": "def ", "max_tokens": max_tokens, "temperature": 0})
            r.raise_for_status()
            out["first_answer"] = time.perf_counter() - t0
        for t, line in lines:
            if line.startswith("{") and '"serving"' in line:
                doc = json.loads(line)
                out["engine"] = doc.get("engine_started", {})
                out["command"] = {"interpreter_and_cli_imports": t - doc["started"]["total"], **doc["started"]}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    if show_output:
        for t, line in lines:
            print(f"  {t:7.2f} {line}")
    return out


def table(runs: list[dict]) -> None:
    command = list(dict.fromkeys(k for r in runs for k in r.get("command", {})))
    engine = [k for k in ENGINE if any(k in r.get("engine", {}) for r in runs)]
    engine += [k for r in runs for k in r.get("engine", {}) if k not in engine]
    engine = list(dict.fromkeys(engine))
    cols = [("command", k) for k in command] + [("engine", k) for k in engine] + [("", "health"),
                                                                                   ("", "first_answer")]

    def value(r: dict, col: tuple[str, str]) -> float | None:
        where, key = col
        return (r.get(where, {}) if where else r).get(key)

    print("| run | " + " | ".join(f"{w + ': ' if w else ''}{k}" for w, k in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for i, r in enumerate(runs):
        print(f"| {i + 1} | " + " | ".join("" if value(r, c) is None else f"{value(r, c):.2f}" for c in cols) + " |")
    med = [[v for r in runs if (v := value(r, c)) is not None] for c in cols]
    print("| median | " + " | ".join(f"{statistics.median(v):.2f}" if v else "" for v in med) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a k3ray checkpoint (or released folder) to serve")
    ap.add_argument("--config", default="configs/tiny.yaml", help="without --checkpoint: its seeded weights")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="model.* / parallel.* go to `k3ray init`, serve.* to `k3ray serve`")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take")
    ap.add_argument("--show-output", action="store_true", help="print the command's output, each line's time first")
    args = ap.parse_args()
    serve_sets = [s for s in args.set if s.startswith("serve.")]
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            checkpoint = os.path.join(tmp, "weights")
            seeded(args.config, [s for s in args.set if not s.startswith("serve.")], checkpoint)
        runs = []
        for i in range(args.runs):
            runs.append(one_start(checkpoint, serve_sets, args.max_tokens, args.timeout, args.show_output))
            print(f"run {i + 1}: /health {runs[-1]['health']:.2f} s, first answer {runs[-1]['first_answer']:.2f} s",
                  flush=True)
    table(runs)


if __name__ == "__main__":
    main()
