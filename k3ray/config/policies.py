"""The live policies' sections (changed while a job runs: `k3ray policy set NAME.FIELD=VALUE`)."""
from __future__ import annotations

from pydantic import Field

from k3ray.config.base import Section


class MoonEPPolicy(Section):
    """Per-micro-batch balance of expert work (k3ray.policies.moonep). With `cost_model`, a replica is made only where
    it shortens the modelled layer (k3ray.policies.expert_cost): rows taken off the busiest rank against the weight
    copy and, in training, its gradient going home. The figures are an H200's (benchmarks/RESULTS.md, K3_NOTES)."""
    enabled: bool = True
    slots_per_rank: int | None = Field(None, gt=0, description="replica slots per rank; default E/R")
    cost_model: bool = Field(True, description="replicas only where the modelled layer gets shorter; false: exact "
                                               "balance whatever the weight traffic")
    expert_tflops: float = Field(400.0, gt=0, description="expert FFN forward+backward TFLOP/s per GPU: Triton "
                                                          "grouped FFN at the K3 latent expert on an H200, 380-410")
    nvlink_gb_per_s: float = Field(330.0, gt=0, description="GB/s a rank sends (and receives) inside a node: NCCL "
                                                            "all_to_all between two H200s, measured")
    ib_gb_per_s: float = Field(50.0, gt=0, description="GB/s a rank sends (and receives) across nodes: one 400 Gb/s "
                                                       "NDR NIC per GPU, line rate (not measured here)")
    ranks_per_node: int = Field(8, gt=0, description="consecutive EP ranks that share a node's NVLink")


class ReplicationPolicy(Section):
    enabled: bool = False
    every_n_steps: int = Field(50, gt=0)
    spare_slots_per_rank: int = Field(1, ge=0)
    moved_budget: int | None = Field(None, ge=0)
    history_decay: float = Field(0.9, ge=0, le=1)


class SchedulingPolicy(Section):
    """Order of the local expert GEMMs: largest first (LPT), so the SM groups of the persistent kernel finish close
    together (k3ray.policies.scheduling)."""
    enabled: bool = True


class GuardPolicy(Section):
    enabled: bool = True
    max_abs_activation: float = Field(1e4, gt=0)
    loss_spike_ratio: float = Field(10.0, gt=1, description="loss over this many times the largest seen trips")
    loss_zscore: float = Field(6.0, gt=0)
    grad_norm_spike_ratio: float = Field(20.0, gt=1)
    warmup_steps: int = Field(10, ge=0, description="steps before spike rules arm")


class PoliciesConfig(Section):
    moonep: MoonEPPolicy = Field(default_factory=MoonEPPolicy)
    replication: ReplicationPolicy = Field(default_factory=ReplicationPolicy)
    scheduling: SchedulingPolicy = Field(default_factory=SchedulingPolicy)
    guards: GuardPolicy = Field(default_factory=GuardPolicy)


POLICY_NAMES: tuple[str, ...] = tuple(PoliciesConfig.model_fields)  # the live policies, in one place
