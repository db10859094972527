"""The cost model MoonEP plans with and `k3ray plan` prices placements with: the modelled seconds of one MoE layer's
expert work on R EP ranks, given the rows each rank computes and the expert weights that cross links.

    seconds  = row_s * max_d rows_d  +  passes * max_d link_d
    link_d   = max( copies over NVLink into or out of d * weight_bytes / nvlink_bytes_per_s,
                    copies over InfiniBand into or out of d * weight_bytes / ib_bytes_per_s )

A copy is one expert's weights going from the rank that owns them (its home) to a rank that computes it; in
training its gradient goes back the same way after the expert GEMMs, so passes = 2 (1 without a backward). Both
directions of a link run at once and NVLink runs beside InfiniBand, so a rank's transfer time is that of its busiest
link direction. The weight exchange is a collective the expert GEMMs wait for (the runtime does not overlap it), and
the GEMMs end with the busiest rank: the terms add. Left out: token dispatch and combine, and fixed per-call costs.
Ranks r and q share a node when r // ranks_per_node == q // ranks_per_node.

Shapes in the package notation: copy_src, copy_dst [n] int ranks, one entry per copy (home, computing rank).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3ray.config import ModelConfig, MoonEPPolicy

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}


@dataclass(frozen=True)
class ExpertCost:
    """row_s: seconds for one routed row through one expert (forward, and backward in training), on the whole GPU.
    weight_bytes: one expert's weights (w1 [d_latent, 2I] and w2 [I, d_latent]). passes: times a copy's bytes cross
    its link per step (2 in training: the weights, then their gradient)."""

    row_s: float
    weight_bytes: int
    passes: int
    nvlink_bytes_per_s: float
    ib_bytes_per_s: float
    ranks_per_node: int

    @classmethod
    def from_config(cls, policy: MoonEPPolicy, model: ModelConfig, training: bool = True) -> "ExpertCost":
        """Forward FLOPs per row 6 * d_latent * I (gate+up 4*d_latent*I, down 2*d_latent*I); backward twice that."""
        row_flops = 6 * model.d_latent * model.expert_inner * (3 if training else 1)
        return cls(row_s=row_flops / (policy.expert_tflops * 1e12),
                   weight_bytes=3 * model.d_latent * model.expert_inner * DTYPE_BYTES[model.dtype],
                   passes=2 if training else 1, nvlink_bytes_per_s=policy.nvlink_gb_per_s * 1e9,
                   ib_bytes_per_s=policy.ib_gb_per_s * 1e9, ranks_per_node=policy.ranks_per_node)

    def copy_s(self, same_node: bool) -> float:
        """Seconds one copy alone adds (all passes) over NVLink (same_node) or InfiniBand."""
        return self.passes * self.weight_bytes / (self.nvlink_bytes_per_s if same_node else self.ib_bytes_per_s)

    def cheapest_copy_s(self, num_ranks: int) -> float:
        """The least any plan with a replica pays for its weights on `num_ranks` ranks."""
        links = [True] * (self.ranks_per_node > 1) + [False] * (num_ranks > self.ranks_per_node)
        return min((self.copy_s(same_node) for same_node in links), default=float("inf"))

    def transfer_s(self, copy_src, copy_dst, num_ranks: int) -> float:
        """Seconds of weight traffic for these copies: passes * max over ranks and links of the busier direction."""
        src, dst = np.asarray(copy_src, dtype=np.int64), np.asarray(copy_dst, dtype=np.int64)
        if src.size == 0:
            return 0.0
        same = src // self.ranks_per_node == dst // self.ranks_per_node
        worst = 0.0
        for on_link, bytes_per_s in ((same, self.nvlink_bytes_per_s), (~same, self.ib_bytes_per_s)):
            if on_link.any():
                busiest = max(np.bincount(src[on_link], minlength=num_ranks).max(),
                              np.bincount(dst[on_link], minlength=num_ranks).max())
                worst = max(worst, float(busiest) * self.weight_bytes / bytes_per_s)
        return self.passes * worst

    def layer_s(self, max_rows: int | float, copy_src, copy_dst, num_ranks: int) -> float:
        """Modelled seconds of the layer: the busiest rank's rows plus the weight traffic (module doc)."""
        return self.row_s * float(max_rows) + self.transfer_s(copy_src, copy_dst, num_ranks)
