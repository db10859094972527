"""The grid a GPU count gives and what each phase of a fault costs there, in seconds: the calibration's measured
figures scaled to the model's bytes, the grid's size and the bandwidths, as k3ray's code recovers
(k3ray.train.failures, k3ray.grid, k3ray.policies.recovery). `PhaseCosts.formulas` prints each with its value.

The grid: pp stages (parallel.pp) x C columns, C = G / pp; G must be a multiple of pp x ep (whole data-parallel
replicas of the configured grid, each training its own global batch: weak scaling, so t_step does not change with G).
A GPU lost takes its column out (every stage of that EP rank); a node lost takes gpus_per_node columns. Without a
spare for each, the grid is launched anew on the survivors and its survivors run the lost columns' micro-batches
(recovery.dp_ranks_of): a step takes ceil(C / C_alive) x t_step until the grow-back.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from k3ray.goodput.calibration import GB, Calibration


@functools.lru_cache(maxsize=8)
def _totals(model_json: str) -> tuple[int, int]:
    from k3ray.config import ModelConfig
    from k3ray.model.params import model_totals

    totals = model_totals(ModelConfig.model_validate_json(model_json))
    return totals["total_params"], totals["active_params"]


def state_bytes(cfg, calib: Calibration) -> float:
    """Bytes of one replica's training state (weights, masters, optimizer moments)."""
    return _totals(cfg.model.model_dump_json())[0] * calib.state_bytes_per_param


def grid_columns(cfg, gpus: int) -> int:
    """C for G = `gpus`; ValueError when G is not whole replicas of the configured pp x ep grid."""
    per_replica = cfg.parallel.pp * cfg.parallel.ep
    if gpus < per_replica or gpus % per_replica:
        raise ValueError(f"--gpus {gpus}: not a multiple of the config's pp x ep = {cfg.parallel.pp} x "
                         f"{cfg.parallel.ep} = {per_replica} (whole data-parallel replicas)")
    return gpus // cfg.parallel.pp


@dataclass(frozen=True)
class PhaseCosts:
    """Seconds of each phase on one grid (one GPU count); the stalls depend on the intervals."""
    gpus: int
    pp: int
    columns: int
    gpus_per_node: int
    step_s: float
    detect_s: dict                # by detection: crash, node, hang, guard, planned
    relaunch_s: float             # start the workers + process groups (a grid launched anew)
    swap_s: float                 # spares take the lost places + process groups
    restore_s: float              # a worker's snapshot into its device
    checkpoint_load_s: float      # every worker's part from durable storage
    checkpoint_write_s: float     # one replica's state to durable storage
    grow_back_s: float            # snapshot to the object store + start the added workers + groups + restore
    warmup_s: float               # a new grid's first steps, over what warm workers take
    grow_back_after_steps: int
    shrunk_share: float           # of ceil(C / C_alive) - 1 (calibration.shrunk_share)
    snapshot_stage_s: float       # training stalls while a worker stages its snapshot
    snapshot_offload_s: float     # the staged snapshot reaches the object store, beside training
    checkpoint_stage_s: float     # training stalls while a worker copies its part to host staging

    def snapshot_stall_s(self, every: int) -> float:
        """Stall per snapshot: staging, plus the wait when the previous snapshot's offload is not done."""
        return self.snapshot_stage_s + max(0.0, self.snapshot_offload_s - every * self.step_s)

    def checkpoint_stall_s(self, every: int) -> float:
        """Stall per checkpoint (0: none taken): staging, plus the wait on the previous write."""
        if every == 0:
            return 0.0
        return self.checkpoint_stage_s + max(0.0, self.checkpoint_write_s - every * self.step_s)

    def slowdown(self, lost_columns: int) -> float:
        """A shrunk grid's step over a full one's: the busiest survivor runs ceil(C / C_alive) columns' batches
        (times the calibrated share of the extra: 1 on GPUs)."""
        return 1.0 + self.shrunk_share * (math.ceil(self.columns / (self.columns - lost_columns)) - 1)


def phase_costs(cfg, gpus: int, calib: Calibration, gpus_per_node: int = 8) -> PhaseCosts:
    """The phases' seconds on G = `gpus` GPUs for cfg's model and grid (formulas: `formulas`)."""
    columns = grid_columns(cfg, gpus)
    par = cfg.parallel
    workers = par.pp * par.ep                                 # one replica's workers
    replicas = gpus // workers
    total, active = _totals(cfg.model.model_dump_json())
    state = total * calib.state_bytes_per_param
    per_worker = state / workers
    tokens = cfg.global_batch_sequences * cfg.data.seq_len     # one replica's step
    step_s = calib.step_s or tokens * 6 * active / (workers * calib.peak_tflops * 1e12 * calib.mfu)
    groups_s = calib.process_groups_s * math.log2(max(gpus, 2)) / math.log2(max(calib.process_groups_world, 2))
    restore_s = per_worker / GB / calib.restore_gb_per_s
    offload_s = per_worker / GB / calib.offload_gb_per_s
    return PhaseCosts(
        gpus=gpus, pp=par.pp, columns=columns, gpus_per_node=gpus_per_node, step_s=step_s,
        detect_s={"crash": calib.detect_crash_s, "node": calib.detect_node_s,
                  "hang": par.collective_timeout_s + calib.hang_grace_s, "guard": 0.0, "planned": 0.0},
        relaunch_s=calib.start_workers_s + groups_s, swap_s=calib.spare_swap_s + groups_s, restore_s=restore_s,
        checkpoint_load_s=replicas * state / GB / calib.storage_gb_per_s,
        checkpoint_write_s=state / GB / calib.storage_gb_per_s,
        grow_back_s=offload_s + calib.grow_back_start_s + groups_s + restore_s, warmup_s=calib.warmup_s,
        grow_back_after_steps=cfg.fault_tolerance.grow_back_after_steps, shrunk_share=calib.shrunk_share,
        snapshot_stage_s=per_worker / GB / calib.stall_gb_per_s, snapshot_offload_s=offload_s,
        checkpoint_stage_s=per_worker / GB / calib.d2h_gb_per_s)


def formulas(cfg, calib: Calibration, costs: PhaseCosts) -> list[str]:
    """Each phase's formula with the figures it was computed from, for G = costs.gpus."""
    total, active = _totals(cfg.model.model_dump_json())
    par, c = cfg.parallel, costs
    workers = par.pp * par.ep
    w_gb = total * calib.state_bytes_per_param / workers / GB
    state_gb = w_gb * workers
    tokens = cfg.global_batch_sequences * cfg.data.seq_len
    step = (f"t_step = tokens x 6 x N_active / (pp x ep x peak x MFU) = {tokens:,} x 6 x {active / 1e9:.1f}e9 / "
            f"({workers} x {calib.peak_tflops:g} TFLOP/s x {calib.mfu:g}) = {c.step_s:.1f} s"
            if calib.step_s is None else f"t_step = {c.step_s:.3f} s (measured)")
    groups = c.swap_s - calib.spare_swap_s
    return [
        f"G = {c.gpus:,}: pp {c.pp} x C {c.columns:,} columns ({c.gpus // workers} replicas of pp x ep = {workers}); "
        f"state b = {total / 1e9:,.1f}e9 params x {calib.state_bytes_per_param:g} B = {state_gb:,.0f} GB a replica, "
        f"b_w = {w_gb:.2f} GB a worker",
        step,
        f"detection: crash {c.detect_s['crash']:g} s (ActorDiedError); node {c.detect_s['node']:g} s (Ray health "
        f"check); hang = collective_timeout_s + grace = {par.collective_timeout_s:g} + {calib.hang_grace_s:g} s",
        f"process groups(G) = {calib.process_groups_s:g} s x log2(G) / log2({calib.process_groups_world}) = "
        f"{groups:.1f} s",
        f"swap = spare hand-over + groups = {calib.spare_swap_s:g} + {groups:.1f} = {c.swap_s:.1f} s; "
        f"relaunch = start workers + groups = {calib.start_workers_s:g} + {groups:.1f} = {c.relaunch_s:.1f} s",
        f"restore = b_w / {calib.restore_gb_per_s:.1f} GB/s = {c.restore_s:.2f} s; checkpoint load = replicas x b / "
        f"storage {calib.storage_gb_per_s:g} GB/s = {c.checkpoint_load_s:.1f} s; write = b / storage = "
        f"{c.checkpoint_write_s:.1f} s",
        f"replay = (steps since the snapshot) x t_step x slowdown; shrunk: every step x slowdown, slowdown = 1 + "
        f"{c.shrunk_share:g} x (ceil(C / C_alive) - 1) "
        f"until grow-back = offload + start added {calib.grow_back_start_s:g} s + groups + restore = "
        f"{c.grow_back_s:.1f} s, once the lost GPUs are back and {c.grow_back_after_steps} step(s) ran shrunk; "
        f"warm-up of every new grid's first steps {c.warmup_s:g} s",
        f"snapshot stall = b_w / {calib.stall_gb_per_s:.0f} GB/s + max(0, b_w / {calib.offload_gb_per_s:.2f} GB/s - "
        f"E_s x t_step) = {c.snapshot_stage_s:.3f} s + max(0, {c.snapshot_offload_s:.1f} s - E_s x t_step)",
        f"checkpoint stall = b_w / {calib.d2h_gb_per_s:g} GB/s + max(0, write - E_c x t_step) = "
        f"{c.checkpoint_stage_s:.2f} s + max(0, {c.checkpoint_write_s:.1f} s - E_c x t_step)",
    ]
