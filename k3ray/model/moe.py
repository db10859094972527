"""Stable LatentMoE (K3_NOTES):

    y = sum_s Shared_s(x) + W_up . RMSNorm( sum_i p_i * E_i(W_down . x) )

Routed experts run entirely in the latent width d_latent; only the routed path is compressed. Who computes the
routed experts is pluggable: `LocalExperts` (every expert in this process, the reference) or the runtime's
expert-parallel executor; both take (h_lat [T, d_latent], expert index [T, K], weights [T, K]) -> [T, d_latent].
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from k3ray.dtypes import matmul_f32, up32
from torch import nn

from k3ray.config import ModelConfig
from k3ray.kernels import grouped_expert_ffn, outside_compile, permute_rows, unpermute_rows
from k3ray.model.balancing import own_bias, select_experts
from k3ray.model.layers import RMSNorm, SiTUFFN

if TYPE_CHECKING:
    from k3ray.model.cache import IterationCache


class ExpertShard(nn.Module):
    """The routed experts of one MoE layer that one worker holds: a first-class, movable object.

    expert_ids [n] (sorted), w1 [n, d_latent, 2I] (gate | up), w2 [n, I, d_latent]."""

    def __init__(self, expert_ids: list[int], d_latent: int, inner: int, dtype=torch.float32, device=None):
        super().__init__()
        self.expert_ids = sorted(expert_ids)
        self.w1 = nn.Parameter(torch.empty(len(expert_ids), d_latent, 2 * inner, dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(len(expert_ids), inner, d_latent, dtype=dtype, device=device))

    def rows_of(self, expert_ids: list[int]) -> list[int]:
        pos = {e: i for i, e in enumerate(self.expert_ids)}
        return [pos[e] for e in expert_ids]


def route_order(idx_TK: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert-grouped layout of the T*K routes: dest [T, K] (row of each route), rows per group [G], group_ends
    [G] int32. Stable, so the layout is a pure function of the routing."""
    flat = idx_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    dest = torch.empty_like(order)
    dest[order] = torch.arange(flat.numel(), device=flat.device)
    counts = count_routes(flat, num_groups)
    return dest.view_as(idx_TK), counts, counts.cumsum(0).to(torch.int32)


def count_routes(idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Routes per group [G] int64 of any index tensor. bincount would read the largest index back to the host first;
    a scatter-add counts without a host sync (a serving decode step is replayed as a CUDA graph, and a training
    step's device queue never drains on the host's account)."""
    flat = idx.reshape(-1)
    return torch.zeros(num_groups, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


class LocalExperts(nn.Module):
    """Every routed expert of a layer in this process (single-process reference and pp-only runs)."""

    def __init__(self, shard: ExpertShard):
        super().__init__()
        self.shard = shard

    @outside_compile  # data-dependent grouping: eager, between a compiled block's graphs
    def forward(self, h_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
        dest, _, ends = route_order(idx_TK, len(self.shard.expert_ids))
        rows = permute_rows(h_TD, dest, idx_TK.numel())
        return unpermute_rows(grouped_expert_ffn(rows, self.shard.w1, self.shard.w2, ends), dest, weight_TK)


class Router(nn.Module):
    """Sigmoid router on the full-width input; `bias` (a buffer set by balancing) only decides who is picked. The
    scores are fp32: in a bf16 model one tensor-core GEMM with fp32 accumulation and output (`dtypes.matmul_f32`, the
    same products as widening x and W first, without their fp32 copies)."""

    def __init__(self, d_model: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))
        self.register_buffer("bias", torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x_Td: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(matmul_f32(x_Td, self.weight.t()))


def maxabs(t: torch.Tensor) -> torch.Tensor:
    """max |t| as a 0-d tensor; 0 for an empty t (a serving iteration can give a rank no tokens)."""
    return t.abs().amax() if t.numel() else t.new_zeros(())


# A step's statistics keep one tensor across its micro-batches: the first micro-batch's copy, which the later ones
# update in place. A later micro-batch replayed as a CUDA graph (k3ray.parallel.micro_batch_graphs) then adds into
# what the first left, where a new tensor each time would only ever hold the first and the last.
def add_into(total: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new.clone() if total is None else total.add_(new)


def max_into(most: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new.clone() if most is None else torch.maximum(most, new, out=most)


class RoutingStats:
    """Per-step routing statistics of one MoE layer, kept on the device (no host sync per layer)."""
    FIELDS = ("histogram", "balance", "tokens_per_expert", "routed_maxabs", "routed_sumsq", "routed_count")

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.histogram: torch.Tensor | None = None  # [E, bins] int64
        # [2E + 2] int64: routes under the step's bias [E], under each micro-batch's own bias [E], scores exactly
        # 1.0, scores (what the step report's balance diagnostics are made of)
        self.balance: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None  # [E] int64, this rank's routes
        self.routed_maxabs: torch.Tensor | None = None
        self.routed_sumsq: torch.Tensor | None = None
        self.routed_count: torch.Tensor | None = None  # 0-d float64 (a count on the device: a graph replays it)

    def add(self, histogram, balance, tokens_per_expert, routed: torch.Tensor) -> None:
        if histogram is not None:
            self.histogram = add_into(self.histogram, histogram)
            self.balance = add_into(self.balance, balance)
        self.tokens_per_expert = add_into(self.tokens_per_expert, tokens_per_expert)
        r = up32(routed.detach())
        self.routed_maxabs = max_into(self.routed_maxabs, maxabs(r))
        self.routed_sumsq = add_into(self.routed_sumsq, r.square().sum())
        self.routed_count = add_into(self.routed_count, r.new_full((), r.numel(), dtype=torch.float64))

    def routed_rms(self) -> torch.Tensor:
        """The RMS of the routed output over the step (0-d, routed_sumsq's dtype)."""
        return (self.routed_sumsq / self.routed_count.clamp(min=1).to(self.routed_sumsq.dtype)).sqrt()


class LatentMoE(nn.Module):
    """The MoE FFN of one layer. Released K3 has one shared expert of width 2 x 3072 (n_shared 1, shared_inner 6144).

    | k3ray (moe.) | HF (block_sparse_moe.) |
    |---|---|
    | router.weight [E, d] | gate.weight |
    | router.bias [E] (buffer, fp32) | gate.e_score_correction_bias |
    | w_down [d_latent, d] | routed_expert_down_proj |
    | norm [d_latent] | routed_expert_norm |
    | w_up [d, d_latent] | routed_expert_up_proj |
    | shared.0.w_gate / w_up / w_out | shared_experts.gate_proj / up_proj / down_proj |
    | experts.shard.w1[row] [d_latent, 2I] = [gate | up] | experts.<e>.w1 [I, d_latent] (gate), w3 (up): transposed |
    | experts.shard.w2[row] [I, d_latent] | experts.<e>.w2 [d_latent, I]: transposed |
    """

    def __init__(self, cfg: ModelConfig, experts: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.w_down = nn.Linear(cfg.d_model, cfg.d_latent, bias=False)
        self.router = Router(cfg.d_model, cfg.n_experts)
        self.experts = experts
        self.norm = RMSNorm(cfg.d_latent, cfg.norm_eps)
        self.w_up = nn.Linear(cfg.d_latent, cfg.d_model, bias=False)
        self.shared = nn.ModuleList(SiTUFFN(cfg.d_model, cfg.shared_inner) for _ in range(cfg.n_shared))
        self.stats = RoutingStats()
        self.own_bias = own_bias  # set_execution may swap in its compiled form (the same function)

    def forward(self, x_BSd: torch.Tensor, cache: IterationCache | None = None) -> torch.Tensor:
        """x [B, S, d] -> [B, S, d]. With an inference cache the routes are counted into its served load (no
        balancing statistics: the router bias is fixed while serving)."""
        cfg = self.cfg
        x = x_BSd.reshape(-1, cfg.d_model)
        scores = self.router(x)
        # every use of x before the first kernel between a compiled block's graphs (the quantile passes): x's
        # gradient is then summed inside one graph's backward, not by eager adds across the graphs
        x_lat = self.w_down(x)
        shared = [expert(x) for expert in self.shared]
        bias = self.router.bias
        hist = micro_bias = None
        if cache is None and cfg.balancing == "quantile":
            hist, micro_bias = self._quantile(scores)
            training = self.training and torch.is_grad_enabled()
            if (cfg.quantile_bias_from if training else cfg.quantile_eval_bias_from) in ("micro_batch", "batch"):
                bias = micro_bias
        idx, weight = select_experts(scores, bias, cfg.top_k)
        y_lat = self.experts(x_lat, idx, weight)
        if cache is not None:
            cache.note_routes(idx)
        else:
            self._note_stats(scores, idx, y_lat, hist, micro_bias, bias is micro_bias)
        y = self.w_up(self.norm(y_lat))
        for out in shared:
            y = y + out
        return y.view_as(x_BSd)

    @outside_compile  # the histogram kernel and the quantile: eager, between a compiled block's graphs
    @torch.no_grad()
    def _quantile(self, scores_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This batch's margin histogram [E, bins] under the step's bias, and its own bias [E] (balancing.own_bias)."""
        cfg = self.cfg
        return self.own_bias(scores_TE, self.router.bias, cfg.top_k, cfg.quantile_bins, cfg.quantile_window,
                             cfg.quantile_resolution)

    @outside_compile  # fills RoutingStats (host-side bookkeeping); its kernels are few and small
    @torch.no_grad()
    def _note_stats(self, scores: torch.Tensor, idx: torch.Tensor, y_lat: torch.Tensor, hist: torch.Tensor | None,
                    micro_bias: torch.Tensor | None, used_micro: bool) -> None:
        cfg = self.cfg
        routes = count_routes(idx, cfg.n_experts)
        balance = None
        if hist is not None:  # the routes under the bias that was not used, to report what each would give
            other = self.router.bias if used_micro else micro_bias
            other_routes = count_routes(select_experts(scores, other, cfg.top_k)[0], cfg.n_experts)
            step_routes, micro_routes = (other_routes, routes) if used_micro else (routes, other_routes)
            total = torch.full((), scores.numel(), dtype=torch.int64, device=scores.device)  # a fill: no host copy
            balance = torch.cat([step_routes, micro_routes, torch.stack([(scores == 1.0).sum(), total])])
        self.stats.add(hist, balance, routes, y_lat)
