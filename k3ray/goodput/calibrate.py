"""`python -m k3ray.goodput.calibrate runs/a/incidents.jsonl [...] --config C -o calib.json`: a calibration file
(k3ray.goodput.calibration) from the incidents of real runs, for `k3ray plan --faults --calibration`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k3ray.config import load_config
from k3ray.goodput.calibration import Calibration, from_incidents, read_incidents
from k3ray.goodput.costs import state_bytes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3ray.goodput.calibrate",
                                description="write a calibration file from the incidents.jsonl of real runs")
    p.add_argument("incidents", nargs="+", help="incidents.jsonl files")
    p.add_argument("--config", required=True, help="the runs' config (its model gives the bytes a worker holds)")
    p.add_argument("--step-s", type=float, help="the runs' measured step time without faults")
    p.add_argument("-o", "--out", required=True)
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    try:
        calib, measured = from_incidents(read_incidents(args.incidents), cfg.parallel.pp,
                                         state_bytes(cfg, Calibration()) / cfg.parallel.world_size, args.step_s,
                                         sources=tuple(args.incidents))
    except (OSError, ValueError) as err:
        print(f"calibration: {err}", file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps({**calib.to_json(), "measured": measured}, indent=1) + "\n")
    print(json.dumps(measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
