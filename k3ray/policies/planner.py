"""How the EP layer asks where each expert's tokens are computed: one `Planner` per worker, built from the live
policies by `build_planner`.

A placement policy is a module with a planner (`plan(tokens_per_expert [R, E], home [E]) -> alloc [E, R]`), a policy
section in `PoliciesConfig` with an `enabled` field, and its line in `PLANNERS`. The first enabled one in `PLANNERS`
plans; with none enabled every expert's tokens go to its home rank.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from k3ray.config import PoliciesConfig
from k3ray.policies import moonep, scheduling


class Planner(Protocol):
    def plan(self, tokens_per_expert: torch.Tensor, home: torch.Tensor) -> torch.Tensor:
        """alloc [E, R] int64 (CPU): token slots of expert e computed on rank d, from the all-gathered counts [R, E];
        every rank calls it with the same counts and must get the same plan."""


class HomePlanner:
    """Every expert computed on its home rank (plain expert parallelism)."""

    def plan(self, tokens_per_expert: torch.Tensor, home: torch.Tensor) -> torch.Tensor:
        num_experts, num_ranks = home.numel(), tokens_per_expert.shape[0]
        alloc = torch.zeros(num_experts, num_ranks, dtype=torch.int64)
        alloc[torch.arange(num_experts), home] = tokens_per_expert.sum(0)
        return alloc


class MoonEPPlanner:
    """MoonEP: exact per-micro-batch balance with up to `slots_per_rank` replicas per rank (k3ray.policies.moonep)."""

    def __init__(self, slots_per_rank: int | None):
        self.slots_per_rank = slots_per_rank

    def plan(self, tokens_per_expert: torch.Tensor, home: torch.Tensor) -> torch.Tensor:
        if tokens_per_expert.shape[0] == 1:
            return HomePlanner().plan(tokens_per_expert, home)
        return moonep.plan(tokens_per_expert, self.slots_per_rank, home).alloc.cpu()


# policy name (a PoliciesConfig field) -> planner from that policy's config section
PLANNERS: dict[str, Callable[..., Planner]] = {
    "moonep": lambda policy: MoonEPPlanner(policy.slots_per_rank),
}


def build_planner(policies: PoliciesConfig) -> Planner:
    for name, build in PLANNERS.items():
        policy = getattr(policies, name)
        if policy.enabled:
            return build(policy)
    return HomePlanner()


def build_gemm_order(policies: PoliciesConfig) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The order a rank runs its expert GEMMs in (rows per group [G] -> permutation), or None for the kernel's own."""
    return scheduling.schedule_order if policies.scheduling.enabled else None
