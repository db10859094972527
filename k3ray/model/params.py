"""Derived totals of a model config, counted from the real modules built on the meta device (no memory)."""
from __future__ import annotations

import torch

from k3ray.config import ModelConfig
from k3ray.model.decoder import build_stage, is_expert_param


def model_totals(cfg: ModelConfig) -> dict[str, float]:
    with torch.device("meta"):
        stage = build_stage(cfg, range(cfg.n_layers), init=False)
    total = routed = 0
    for name, p in stage.named_parameters():
        total += p.numel()
        routed += p.numel() if is_expert_param(name) else 0
    active = total - routed + routed * cfg.top_k // cfg.n_experts
    per_expert = routed // max(len(cfg.moe_layer_ids()) * cfg.n_experts, 1)
    return {
        "total_params": total,
        "active_params": active,
        "routed_expert_params": routed,
        "params_per_expert": per_expert,
        "dispatch_values_per_token": cfg.top_k * cfg.d_latent,
        "dispatch_values_per_token_full_width_top_k_half": (cfg.top_k // 2) * cfg.d_model,
        "layers": cfg.n_layers,
        "dense_layers": cfg.n_layers - len(cfg.moe_layer_ids()),
        "kda_layers": sum(cfg.layer_kind(i) == "kda" for i in range(cfg.n_layers)),
        "mla_layers": sum(cfg.layer_kind(i) == "mla" for i in range(cfg.n_layers)),
    }
