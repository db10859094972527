"""K3 model blocks in plain PyTorch (no Ray)."""
from k3ray.model.decoder import K3Stage, build_stage, is_expert_param
from k3ray.model.moe import ExpertShard, LatentMoE, LocalExperts

__all__ = ["K3Stage", "build_stage", "is_expert_param", "ExpertShard", "LatentMoE", "LocalExperts"]
