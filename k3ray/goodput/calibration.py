"""Measured figures the phase costs are scaled from (k3ray.goodput.costs), and the calibration file: JSON written
from the `incidents.jsonl` of real runs (`python -m k3ray.goodput.calibrate`), read by `k3ray plan --faults
--calibration FILE`.

The defaults are k3ray's own measurements on two H200s (benchmarks/RESULTS.md, "Training end to end on 2 H200s":
the fault drill, the snapshot figures, the MFU) and Ray's health-check defaults (K3_NOTES); the few figures nobody
measured yet are named in ASSUMED.

    python -m k3ray.goodput.calibrate runs/a/incidents.jsonl [more ...] --config configs/gpu2.yaml -o calib.json
"""
from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

GB = 1e9


@dataclass(frozen=True)
class Calibration:
    detect_crash_s: float = 0.002            # ActorDiedError of a killed worker (GPU drill)
    detect_node_s: float = 15.0              # Ray's health check: 3 s period x 5 misses
    hang_grace_s: float = 5.0                # after parallel.collective_timeout_s, the grace for peers' answers
    start_workers_s: float = 5.2             # place and start a worker process (parallel over nodes; GPU drill)
    spare_swap_s: float = 0.05               # hand a ready spare its place, no process start (CPU, 1 spare)
    grow_back_start_s: float = 16.2          # a grow-back's start of the added workers: 75.3 s - snapshot 45.2 s -
                                             # groups 9.0 s - restore 4.9 s (GPU drill)
    warmup_s: float = 4.8                    # a new grid's first steps over a warm one's: 12.8 s replaying 5 steps
                                             # at 2 x 0.8 s (GPU drill)
    shrunk_share: float = 1.0                # a shrunk step takes 1 + share x (ceil(C / C_alive) - 1) steps: 1 on
                                             # GPUs (survivors run the lost columns' micro-batches after their own)
    process_groups_s: float = 9.0            # build the process groups of a grid of process_groups_world ranks
    process_groups_world: int = 2            # (NCCL, 2 H200s)
    restore_gb_per_s: float = 59.0 / 4.9     # object store -> device, per worker (59.0 GB in 4.9 s)
    stall_gb_per_s: float = 59.0 / 0.109     # snapshot staging on the device: training stalls (59.0 GB in 0.109 s)
    offload_gb_per_s: float = 59.0 / 45.2    # staged snapshot -> object store beside training (first touch)
    d2h_gb_per_s: float = 25.0               # a checkpoint part's copy to host staging: training stalls
    storage_gb_per_s: float = 2000.0         # durable storage, the whole job (Llama 3: Tectonic, 2 TB/s sustained)
    state_bytes_per_param: float = 14.0      # bf16 weights + fp32 masters + two fp32 Adam moments (59.0 GB / 4.22 B)
    peak_tflops: float = 792.0               # bf16 dense, measured on an H200
    mfu: float = 0.235                       # model FLOPs utilisation measured end to end (23-24 %)
    step_s: float | None = None              # a measured step of the planned grid; None: from the FLOPs and MFU
    sources: tuple[str, ...] = field(default=("benchmarks/RESULTS.md: Training end to end on 2 H200s",))

    def to_json(self) -> dict:
        out = asdict(self)
        out["sources"] = list(self.sources)
        return out


# Not measured by k3ray: taken from elsewhere, to be replaced by measurements.
ASSUMED = {"d2h_gb_per_s": "PCIe 5 x16 device-to-host, about half its peak",
           "storage_gb_per_s": "Llama 3's storage (Tectonic, 2 TB/s sustained)",
           "spare_swap_s": "measured on CPU (GPU spare swaps not yet timed; NCCL groups are counted apart)",
           "detect_node_s": "Ray's defaults: health check every 3 s, 5 misses"}


def load(path: str) -> Calibration:
    """A calibration file: any subset of Calibration's fields; ValueError names what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise ValueError(f"--calibration {path}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--calibration {path}: not valid JSON: {err}") from None
    known = {f.name for f in fields(Calibration)}
    unknown = sorted(set(data) - known - {"measured"})
    if unknown:
        raise ValueError(f"--calibration {path}: unknown fields {unknown}; known: {sorted(known)}")
    values = {k: v for k, v in data.items() if k in known}
    for key, value in values.items():
        if key != "sources" and value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"--calibration {path}: {key} must be a positive number")
    if "sources" in values:
        values["sources"] = tuple(values["sources"])
    return Calibration(**values)


def read_incidents(paths: list[str]) -> list[dict]:
    """The incidents of incidents.jsonl files; an incident updated later is written again, the last line wins."""
    out = []
    for path in paths:
        latest: dict[tuple, dict] = {}
        for line in Path(path).read_text().splitlines():
            if line.strip():
                incident = json.loads(line)
                latest[(incident.get("time"), incident.get("kind"))] = incident
        out += latest.values()
    return out


def from_incidents(incidents: list[dict], pp: int, state_bytes_per_worker: float, step_s: float | None = None,
                   base: Calibration = Calibration(), sources: tuple[str, ...] = ()) -> tuple[Calibration, dict]:
    """A calibration from recovered worker losses (kind worker_lost with seconds): medians of the phases, the
    restore bandwidth from the state bytes a worker holds; `pp` gives the world size of the grid each one built.
    Returns (calibration, the measured medians and counts)."""
    lost = [i for i in incidents if i.get("kind") == "worker_lost" and isinstance(i.get("seconds"), dict)]
    if not lost:
        raise ValueError("no recovered worker_lost incident (with its seconds) in the incidents given")

    def median(key: str, rows: list[dict]) -> float | None:
        values = [r["seconds"][key] for r in rows if key in r["seconds"]]
        return statistics.median(values) if values else None

    crash = [i for i in lost if i.get("rule") != "collective_timeout"]
    # a replay on a grid of the same size: its time over (steps replayed) x t_step is the new workers' warm-up; on a
    # shrunk one, its steps over t_step give the share of the ceil(C / C_alive) - 1 extra a shrunk step takes
    replays = [(i["seconds"]["replay"], i["replayed_steps"][1] - i["replayed_steps"][0], -(-i["ep"][0] // i["ep"][1]))
               for i in lost if step_s and "replay" in i["seconds"] and "replayed_steps" in i]
    warm = [replay - steps * step_s for replay, steps, ceil in replays if ceil == 1]
    share = [(replay / steps / step_s - 1) / (ceil - 1) for replay, steps, ceil in replays if ceil > 1 and steps]
    launched = [i for i in lost if "place_and_start_workers" in i["seconds"]]
    swapped = [i for i in lost if "swap_in_spares" in i["seconds"]]
    measured = {"incidents": len(lost), "detection_s": median("detection", crash),
                "place_and_start_workers_s": median("place_and_start_workers", launched),
                "swap_in_spares_s": median("swap_in_spares", swapped),
                "process_groups_s": median("process_groups", lost),
                "restore_s": median("restore", lost), "replay_s": median("replay", lost),
                "world": statistics.median(i["ep"][1] * pp for i in lost)}
    grow = [i["seconds"] for i in incidents if i.get("kind") == "grow_back" and isinstance(i.get("seconds"), float)]
    measured["grow_back_s"] = statistics.median(grow) if grow else None
    measured["warmup_s"] = statistics.median(warm) if warm else None
    measured["shrunk_share"] = statistics.median(share) if share else None
    update = {"detect_crash_s": measured["detection_s"], "start_workers_s": measured["place_and_start_workers_s"],
              "spare_swap_s": measured["swap_in_spares_s"], "process_groups_s": measured["process_groups_s"],
              "process_groups_world": int(measured["world"]), "step_s": step_s,
              "warmup_s": None if measured["warmup_s"] is None else max(measured["warmup_s"], 0.0),
              "shrunk_share": None if measured["shrunk_share"] is None else max(measured["shrunk_share"], 0.0)}
    if share and not warm:  # only shrunk replays: their warm-up is in the share measured
        update["warmup_s"] = 0.0
    if grow:
        update["grow_back_start_s"] = max(measured["grow_back_s"] - (measured["process_groups_s"] or 0.0)
                                          - (measured["restore_s"] or 0.0), 0.0)
    if measured["restore_s"]:
        update["restore_gb_per_s"] = state_bytes_per_worker / GB / measured["restore_s"]
    update = {k: v for k, v in update.items() if v is not None and (k != "process_groups_world" or v > 1)}
    # a phase measured as 0 s (a timer's resolution) still costs a little: floor at a microsecond
    update = {k: max(v, 1e-6) if isinstance(v, float) else v for k, v in update.items()}
    return replace(base, **update, sources=tuple(sources) or base.sources), measured
