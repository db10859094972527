"""In-GPU expert scheduling: the order in which one GPU runs its G local expert GEMMs.

A rank's expert GEMMs differ in rows (tokens) by 10x or more under skew. With the SMs split into `num_groups` groups
that each run one GEMM at a time, longest-processing-time-first (LPT) list scheduling keeps the groups' finish times
close: makespan <= (4/3 - 1/(3*num_groups)) * optimum (Graham 1969). The cost of one GEMM is affine in its rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CostModel:
    """time(rows) = overhead_us + per_row_us * rows for one expert GEMM (0 rows = skipped, costs nothing)."""

    overhead_us: float
    per_row_us: float

    def time(self, rows: torch.Tensor | int | float) -> torch.Tensor:
        rows_t = torch.as_tensor(rows, dtype=torch.float64)
        return torch.where(rows_t > 0, self.overhead_us + self.per_row_us * rows_t, torch.zeros_like(rows_t))


@dataclass(frozen=True)
class Schedule:
    """order [G] int64 (experts, largest first); group [G] int64 SM group of each expert (indexed by expert);
    finish_us [num_groups] predicted finish time of each group; makespan_us = finish_us.max()."""

    order: torch.Tensor
    group: torch.Tensor
    finish_us: torch.Tensor

    @property
    def makespan_us(self) -> float:
        return float(self.finish_us.max())


def schedule_order(rows_per_expert: torch.Tensor) -> torch.Tensor:
    """Permutation of the G local experts, most rows first, ties by ascending index ([G] int64)."""
    rows = rows_per_expert.to(torch.int64)
    return torch.sort(-rows, stable=True).indices


def schedule(rows_per_expert: torch.Tensor, num_groups: int, cost: CostModel) -> Schedule:
    """LPT: take experts largest first, give each to the SM group that frees up first (ties: lowest group)."""
    order = schedule_order(rows_per_expert)
    times = cost.time(rows_per_expert.cpu()[order.cpu()]).tolist()
    finish = [0.0] * num_groups
    group_of = [0] * len(times)
    for i, t in enumerate(times):
        g = min(range(num_groups), key=finish.__getitem__)       # first minimum -> lowest index on ties
        finish[g] += t
        group_of[i] = g
    group = torch.empty(len(times), dtype=torch.int64)
    group[order.cpu()] = torch.tensor(group_of, dtype=torch.int64)
    return Schedule(order=order, group=group.to(rows_per_expert.device),
                    finish_us=torch.tensor(finish, dtype=torch.float64))


def lower_bound_us(rows_per_expert: torch.Tensor, num_groups: int, cost: CostModel) -> float:
    """No schedule beats max(total / num_groups, longest single GEMM)."""
    times = cost.time(rows_per_expert.cpu())
    if times.numel() == 0:
        return 0.0
    return float(torch.maximum(times.sum() / num_groups, times.max()))


def calibrate(rows: torch.Tensor, times_us: torch.Tensor) -> CostModel:
    """Least-squares fit of time_us = overhead_us + per_row_us * rows from measured points (>= 2 distinct rows).

    Negative fitted coefficients (noise) are clamped to 0 and the other refitted.
    """
    x = torch.as_tensor(rows, dtype=torch.float64).flatten()
    y = torch.as_tensor(times_us, dtype=torch.float64).flatten()
    if x.numel() < 2 or torch.unique(x).numel() < 2:
        raise ValueError("calibrate: need measurements at two or more distinct row counts")
    design = torch.stack([torch.ones_like(x), x], dim=1)
    overhead, per_row = torch.linalg.lstsq(design, y[:, None]).solution.flatten().tolist()
    if per_row < 0:
        return CostModel(overhead_us=max(float(y.mean()), 0.0), per_row_us=0.0)
    if overhead < 0:
        per_row = float((x * y).sum() / (x * x).sum())
        return CostModel(overhead_us=0.0, per_row_us=max(per_row, 0.0))
    return CostModel(overhead_us=overhead, per_row_us=per_row)
