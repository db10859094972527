"""How the EP layer asks where each expert's tokens are computed: one `Planner` per worker, built from the live
policies by `build_planner`.

A placement policy is a module with a planner (`plan(tokens_per_expert [R, E], home [E], training) -> alloc [E, R]`),
a policy section in `PoliciesConfig` with an `enabled` field, and its line in `PLANNERS` (built from that section and
the model's shape). The first enabled one in `PLANNERS` plans; with none enabled every expert's tokens go to its home
rank. Read-only copies of experts in place (serving: k3ray.policies.copies) come first: while any expert has one,
`CopiesPlanner` splits each expert's tokens over its holders and nothing else moves weights.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from k3ray.config import ModelConfig, MoonEPPolicy, PoliciesConfig
from k3ray.policies import copies, moonep, scheduling
from k3ray.policies.expert_cost import ExpertCost


class Planner(Protocol):
    def plan(self, tokens_per_expert: torch.Tensor, home: torch.Tensor, training: bool) -> torch.Tensor:
        """alloc [E, R] int64 (CPU): token slots of expert e computed on rank d, from the all-gathered counts [R, E];
        every rank calls it with the same counts and must get the same plan. training: a backward follows (replica
        gradients go home)."""


class HomePlanner:
    """Every expert computed on its home rank (plain expert parallelism)."""

    def plan(self, tokens_per_expert: torch.Tensor, home: torch.Tensor, training: bool) -> torch.Tensor:
        num_experts, num_ranks = home.numel(), tokens_per_expert.shape[0]
        alloc = torch.zeros(num_experts, num_ranks, dtype=torch.int64)
        alloc[torch.arange(num_experts), home] = tokens_per_expert.sum(0)
        return alloc


class MoonEPPlanner:
    """MoonEP with up to `slots_per_rank` replicas per rank (k3ray.policies.moonep): exact per-micro-batch balance,
    or with `costs` (training, inference) the plan that the cost model prices cheapest."""

    def __init__(self, slots_per_rank: int | None, costs: tuple[ExpertCost, ExpertCost] | None = None):
        self.slots_per_rank, self.costs = slots_per_rank, costs

    @classmethod
    def from_config(cls, policy: MoonEPPolicy, model: ModelConfig) -> "MoonEPPlanner":
        costs = tuple(ExpertCost.from_config(policy, model, training) for training in (True, False))
        return cls(policy.slots_per_rank, costs if policy.cost_model else None)

    def plan(self, tokens_per_expert: torch.Tensor, home: torch.Tensor, training: bool) -> torch.Tensor:
        if tokens_per_expert.shape[0] == 1:
            return HomePlanner().plan(tokens_per_expert, home, training)
        cost = None if self.costs is None else self.costs[0 if training else 1]
        return moonep.plan(tokens_per_expert, self.slots_per_rank, home, cost).alloc.cpu()


class CopiesPlanner:
    """Each expert's tokens over the ranks holding it (its home and its read-only copies), levelling their load."""

    def __init__(self, holders: list[list[int]]):
        self.holders = holders

    def plan(self, tokens_per_expert: torch.Tensor, home: torch.Tensor, training: bool) -> torch.Tensor:
        return copies.copy_alloc(tokens_per_expert, self.holders)


# policy name (a PoliciesConfig field) -> planner from that policy's config section and the model's shape
PLANNERS: dict[str, Callable[..., Planner]] = {
    "moonep": MoonEPPlanner.from_config,
}


def build_planner(policies: PoliciesConfig, model: ModelConfig, holders: list[list[int]] | None = None) -> Planner:
    """holders [E]: the ranks holding each expert, where read-only copies are in place (None: homes only)."""
    if holders is not None and any(len(h) > 1 for h in holders):
        return CopiesPlanner(holders)
    for name, build in PLANNERS.items():
        policy = getattr(policies, name)
        if policy.enabled:
            return build(policy, model)
    return HomePlanner()


def build_gemm_order(policies: PoliciesConfig) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The order a rank runs its expert GEMMs in (rows per group [G] -> permutation), or None for the kernel's own."""
    return scheduling.schedule_order if policies.scheduling.enabled else None
