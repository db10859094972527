"""What a process of a serving start pays before it works, each in a fresh interpreter: `import torch`, `import
ray`, the `k3ray serve` command's imports before Ray starts, the serving engine actor's module (what it imports
before it starts its workers) and its imports beside their start, the worker's module and its constructor's imports,
a front door's, the CUDA context (GPU). Prints a table (seconds, median of --runs) and the modules that cost most to
import in the command's set and in the engine's (`python -X importtime`, cumulative).

    python benchmarks/start_probe.py [--runs 3]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

COMMAND = ("from k3ray.control import serve_cli; from k3ray.control.ray_cluster import init_ray; "
           "from k3ray.formats.release_folder import is_hf_folder; from k3ray.io import checkpoint; "
           "from k3ray.serve.app import start_serving; from k3ray.serve.metrics import ServeMetrics; "
           "from k3ray.tokenizer import load_tokenizer")
ENGINE = ("from k3ray.serve import admission, availability, iterations, live, scheduler, streams; "
          "from k3ray.serve.grid import ServingGrid")
PROBES = {
    "interpreter": "pass",
    "import torch": "import torch",
    "import ray": "import ray",
    "k3ray serve command, until Ray starts": COMMAND,
    "serving engine module, until its workers start": "import k3ray.serve.engine",
    "serving engine's imports, beside its workers' start": ENGINE,
    "worker module": "import k3ray.grid.worker",
    "worker constructor's imports": "import torch; from k3ray import data; "
                                    "from k3ray.grid import worker_serving, worker_state, worker_training; "
                                    "from k3ray.parallel import engine",
    "front door's imports": "from k3ray.serve.front_door import build_app",
    "CUDA context": "import torch; torch.zeros(1, device='cuda') if torch.cuda.is_available() else None",
}


def timed(code: str) -> float:
    """Seconds of a fresh interpreter running `code`, its own start and exit included."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    return time.perf_counter() - t0


def costliest_imports(code: str, n: int) -> list[tuple[float, str]]:
    """The n modules with the largest cumulative import time (s) under `python -X importtime`."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                         check=True).stderr
    rows = []
    for line in err.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]) / 1e6, parts[2].rstrip()))
    return sorted(rows, reverse=True)[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    print("| what | seconds (median) | runs |\n|---|---|---|")
    for name, code in PROBES.items():
        times = [timed(code) for _ in range(args.runs)]
        print(f"| {name} | {statistics.median(times):.2f} | {', '.join(f'{t:.2f}' for t in times)} |", flush=True)
    for name, code in (("the k3ray serve command's, until Ray starts", COMMAND), ("the serving engine's", ENGINE)):
        print(f"\ncostliest imports of {name} (cumulative s):")
        for seconds, module in costliest_imports(code, args.top):
            print(f"{seconds:8.3f} {module}")


if __name__ == "__main__":
    main()
