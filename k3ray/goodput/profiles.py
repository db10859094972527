"""Failure processes: classes of faults, each a Poisson process with a rate per GPU-hour, what a fault takes out
(one GPU's worker, a whole node, the whole job) and how k3ray finds out (the worker's process dies, Ray's health
check misses a node, a collective times out, a guard trips, or a planned stop).

Named profiles (`--faults`): `llama3` (Llama 3's 54 days on 16,384 H100s, Table 5 of "The Llama 3 Herd of Models":
419 unexpected interruptions by root cause, plus the 47 planned ones), `mtbf:H` (every GPU fails once in H hours,
its worker dies), `node-mtbf:H` (every node is lost once in H hours), `hang-mtbf:H` (every GPU hangs once in H
hours: found by the collective timeout); `A+B` adds profiles. Any other spec is a YAML or JSON file:

    repair_hours: 1.0            # a failed GPU or node is back (repaired or replaced) this long after its fault
    gpus_per_node: 8
    classes:
      - {name: gpu, mtbf_hours: 50000, scope: gpu, detection: crash}     # or rate_per_gpu_hour: 2.0e-5
      - {name: switch, rate_per_gpu_hour: 1.6e-6, scope: node, detection: hang}
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import yaml

Scope = Literal["gpu", "node", "job"]
Detection = Literal["crash", "node", "hang", "guard", "planned"]
SCOPES = ("gpu", "node", "job")
DETECTIONS = ("crash", "node", "hang", "guard", "planned")

# Llama 3 405B: 16,384 H100s for 54 days (Table 5). Each row: (cause, interruptions, scope, detection, hardware to
# repair). The counts add up to 419 and the shares match them except the first row's (148 is 35.3 % of 419; the
# paper prints 30.1 %): the counts are used. Which scope and detection each cause maps to is this simulator's
# reading of the cause, not the paper's.
LLAMA3_GPUS, LLAMA3_DAYS = 16384, 54
LLAMA3_TABLE = (
    ("faulty GPU", 148, "gpu", "crash", True),
    ("GPU HBM3 memory", 72, "gpu", "crash", True),
    ("software bug", 54, "gpu", "crash", False),
    ("network switch/cable", 35, "node", "hang", True),
    ("host maintenance (unplanned)", 32, "node", "node", True),
    ("GPU SRAM memory", 19, "gpu", "crash", True),
    ("GPU system processor", 17, "gpu", "crash", True),
    ("NIC", 7, "node", "hang", True),
    ("NCCL watchdog timeout", 7, "gpu", "hang", False),
    ("silent data corruption", 6, "gpu", "guard", False),
    ("GPU thermal interface + sensor", 6, "gpu", "crash", True),
    ("SSD", 3, "node", "node", True),
    ("power supply", 3, "node", "node", True),
    ("server chassis", 2, "node", "node", True),
    ("IO expansion board", 2, "node", "node", True),
    ("dependency", 2, "gpu", "crash", False),
    ("CPU", 2, "node", "node", True),
    ("system memory", 2, "node", "node", True),
    ("planned (maintenance, updates)", 47, "job", "planned", False),
)


@dataclass(frozen=True)
class FailureClass:
    """One cause of faults: `rate` events per GPU-hour of the grid (a node-scope fault hits the node of the GPU
    drawn); `repair`: the hardware is out until repaired (else the place is usable again at once)."""
    name: str
    rate: float
    scope: Scope
    detection: Detection
    repair: bool


@dataclass(frozen=True)
class Profile:
    name: str
    classes: tuple[FailureClass, ...]
    repair_hours: float = 1.0
    gpus_per_node: int = 8

    def mtbf_hours(self, gpus: int) -> float:
        """The job's mean time between faults on `gpus` GPUs."""
        return 1.0 / (sum(c.rate for c in self.classes) * gpus)

    def to_json(self) -> dict:
        return {"name": self.name, "repair_hours": self.repair_hours, "gpus_per_node": self.gpus_per_node,
                "classes": [c.__dict__ for c in self.classes]}


def llama3() -> Profile:
    gpu_hours = LLAMA3_GPUS * LLAMA3_DAYS * 24.0
    return Profile("llama3", tuple(FailureClass(name, n / gpu_hours, scope, det, rep)
                                   for name, n, scope, det, rep in LLAMA3_TABLE))


def _hours(spec: str, text: str) -> float:
    try:
        hours = float(text)
    except ValueError:
        raise ValueError(f"--faults {spec}: {text!r} is not a number of hours") from None
    if not hours > 0:
        raise ValueError(f"--faults {spec}: hours must be positive")
    return hours


def _named(spec: str) -> Profile | None:
    kind, _, arg = spec.partition(":")
    if kind == "llama3" and not arg:
        return llama3()
    if kind == "mtbf" and arg:
        return Profile(spec, (FailureClass("gpu", 1 / _hours(spec, arg), "gpu", "crash", True),))
    if kind == "hang-mtbf" and arg:
        return Profile(spec, (FailureClass("hung gpu", 1 / _hours(spec, arg), "gpu", "hang", False),))
    if kind == "node-mtbf" and arg:
        # a node's rate spread over its GPUs: one node of 8 GPUs fails once in H hours
        return Profile(spec, (FailureClass("node", 1 / _hours(spec, arg) / 8, "node", "node", True),))
    return None


def _from_file(path: str) -> Profile:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--faults {path}: neither a profile (llama3, mtbf:H, node-mtbf:H, hang-mtbf:H) nor a file")
    try:
        data = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"--faults {path}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                         f"{str(err).splitlines()[0]}") from None
    if not isinstance(data, dict) or not isinstance(data.get("classes"), list) or not data["classes"]:
        raise ValueError(f"--faults {path}: expected a mapping with a non-empty list `classes`")
    classes = []
    for i, c in enumerate(data["classes"]):
        where = f"--faults {path}: classes[{i}]"
        if not isinstance(c, dict):
            raise ValueError(f"{where}: expected a mapping")
        if ("rate_per_gpu_hour" in c) == ("mtbf_hours" in c):
            raise ValueError(f"{where}: give exactly one of rate_per_gpu_hour, mtbf_hours")
        rate = c["rate_per_gpu_hour"] if "rate_per_gpu_hour" in c else 1 / _hours(path, c["mtbf_hours"])
        scope, det = c.get("scope", "gpu"), c.get("detection", "crash")
        if scope not in SCOPES or det not in DETECTIONS:
            raise ValueError(f"{where}: scope must be one of {SCOPES}, detection one of {DETECTIONS}")
        if not isinstance(rate, (int, float)) or rate < 0:
            raise ValueError(f"{where}: the rate must be a number >= 0")
        classes.append(FailureClass(str(c.get("name", f"class {i}")), float(rate), scope, det,
                                    bool(c.get("repair", scope != "job"))))
    gpn = data.get("gpus_per_node", 8)
    if not isinstance(gpn, int) or gpn < 1:
        raise ValueError(f"--faults {path}: gpus_per_node must be a positive integer")
    return Profile(p.name, tuple(classes), _hours(path, data.get("repair_hours", 1.0)), gpn)


def load_profile(spec: str, repair_hours: float | None = None) -> Profile:
    """A named profile, several joined by '+', or a YAML/JSON file; ValueError names what is wrong."""
    parts = [_named(s) or _from_file(s) for s in spec.split("+")]
    classes = tuple(c for p in parts for c in p.classes)
    profile = replace(parts[0], name=spec, classes=classes)
    return profile if repair_hours is None else replace(profile, repair_hours=repair_hours)
