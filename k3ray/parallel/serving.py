"""One worker's part of a serving iteration, as plain library code (no Ray): its pipeline stage, its cache pools and
the pipeline hand-off of hidden states.

Worker (p, e) holds stage p and the caches of the requests that the engine placed on data-parallel rank e (each
request lives on one rank: its latent pages and KDA slot are there, on every stage). Every iteration, every worker
runs `StageServer.step` with its rank's `RankPlan`, also when that plan is empty: the MoE layers' expert-parallel
exchanges span the stage's EP group, so every EP rank joins them, with zero tokens if need be. Stage p receives the
hidden states from (p-1, e) and sends its own to (p+1, e); the last stage returns the logits. Every stage also
returns each sequence's largest activation, so that a sequence that blew up can be stopped alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from k3ray.model.cache import CachePools, IterationCache, SeqChunk, new_pools
from k3ray.model.decoder import K3Stage, boundary_shape


@dataclass
class RankPlan:
    """One data-parallel rank's iteration: the new tokens of its sequences, packed in sequence order."""
    tokens: list[int] = field(default_factory=list)
    seqs: list[SeqChunk] = field(default_factory=list)


@dataclass
class StageOutput:
    """A stage's answer to an iteration: the logits [N, V] (last stage; None elsewhere) and each sequence's largest
    |activation| in the stage [N] (inf where anything, the logits included, is not finite)."""
    logits: torch.Tensor | None
    maxabs: torch.Tensor

    @staticmethod
    def merge(stages: list[StageOutput]) -> StageOutput:
        """One data-parallel rank's answer from its stages' (in pipeline order)."""
        return StageOutput(stages[-1].logits, torch.stack([s.maxabs for s in stages]).amax(0))


@dataclass
class PoolSizes:
    """Cache pools of every worker: latent pages of page_size tokens, and KDA state slots (one per running
    request of the rank)."""
    pages: int
    page_size: int
    slots: int


class StageServer:
    def __init__(self, stage: K3Stage, pools: CachePools, device, prev_rank: int | None = None,
                 next_rank: int | None = None, world=None):
        self.stage, self.pools, self.device = stage, pools, torch.device(device)
        self.prev_rank, self.next_rank = prev_rank, next_rank  # world ranks of the neighbouring stages (same e)
        self.world = world  # the grid's world group (StageEngine.world)
        self.dtype = next(stage.parameters()).dtype

    @torch.no_grad()
    def step(self, plan: RankPlan) -> StageOutput:
        """Run this stage on the plan: logits [N, V] (on the host) on the last stage, and every stage's max-abs."""
        cache = IterationCache(self.pools, plan.seqs, self.device)
        T = len(plan.tokens)
        if self.stage.is_first:
            x = torch.tensor(plan.tokens, dtype=torch.int64, device=self.device)[None]
        else:
            # the hidden state (and, with Block AttnRes, the block summaries: per token, so nothing is kept)
            x = torch.empty(boundary_shape(self.stage.cfg, self.stage.layers.start, 1, T), dtype=self.dtype,
                            device=self.device)
            if T:
                dist.recv(x, self.prev_rank, group=self.world)
        out = self.stage(x, cache)
        if not self.stage.is_last:
            if T:
                dist.send(out.contiguous(), self.next_rank, group=self.world)
            return StageOutput(None, cache.maxabs.cpu())
        logits = out.cpu()
        return StageOutput(logits, torch.where(torch.isfinite(logits).all(-1), cache.maxabs.cpu(), torch.inf))

    def expert_load(self) -> dict[int, list[int]]:
        """layer -> routes this worker's tokens sent to each expert since the last call (then reset)."""
        load = {}
        for layer, moe in self.stage.moe_layers().items():
            tpe = moe.stats.tokens_per_expert
            load[layer] = [0] * self.stage.cfg.n_experts if tpe is None else tpe.tolist()
        self.stage.reset_stats()
        return load


class LocalExecutor:
    """The whole model in this process (pp = 1, ep = 1, one data-parallel rank): the engine without Ray."""

    def __init__(self, model: K3Stage, sizes: PoolSizes, device="cpu"):
        pools = new_pools(model.cfg, model.layers, sizes.pages, sizes.page_size, sizes.slots, device)
        self.server = StageServer(model, pools, device)

    def run(self, plans: dict[int, RankPlan]) -> dict[int, StageOutput]:
        return {0: self.server.step(plans[0])}
