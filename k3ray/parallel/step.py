"""The math of one training step that the single-process reference and every worker share: the loss of a
micro-batch, router-bias balancing from (globally reduced) statistics, activation statistics, the step report; and
the worker's reduction of the routing statistics over its EP group (`reduce_balance`) and what its report reads."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from k3ray.dtypes import up32

from k3ray.config import ModelConfig
from k3ray.model.balancing import quantile_bias, sign_bias
from k3ray.model.decoder import K3Stage
from k3ray.model.moe import LatentMoE
from k3ray.policies.moonep import maxvio


def lm_loss(logits_BSV: torch.Tensor, tokens_BS1: torch.Tensor, scale: float) -> torch.Tensor:
    """Mean next-byte cross-entropy of one micro-batch times `scale` (1 / micro-batches in the global batch), so
    summing the micro-batches' losses (and gradients) gives the global-batch mean."""
    targets = tokens_BS1[:, 1:]
    return F.cross_entropy(up32(logits_BSV).reshape(-1, logits_BSV.shape[-1]), targets.reshape(-1)) * scale


@torch.no_grad()
def update_router_bias(cfg: ModelConfig, moe: LatentMoE, histogram: torch.Tensor | None,
                       load_E: torch.Tensor) -> None:
    """Set the layer's router bias from the step's global statistics (histogram [E, bins], load [E])."""
    bias = moe.router.bias
    if cfg.balancing == "quantile":
        b_hat = quantile_bias(histogram, bias, cfg.top_k, cfg.quantile_window, cfg.quantile_resolution)
        bias.add_(b_hat - bias, alpha=cfg.quantile_step)
    elif cfg.balancing == "sign":
        bias.copy_(sign_bias(load_E, bias, cfg.sign_update_rate))


def balance_diagnostics(counts, num_experts: int) -> dict[str, float]:
    """A layer's step balance diagnostics from its (globally reduced) RoutingStats.balance [2E + 2] (a tensor or its
    host list): the MaxVio the global batch gets routed with the step's bias and with each micro-batch's own bias
    (whichever was not used is what it would have given), and the share of scores saturated at exactly 1.0 (ties no
    bias can split)."""
    counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
    E = num_experts
    saturated, total = counts[2 * E:]
    return {"maxvio_step_bias": maxvio([counts[:E]]), "maxvio_micro_batch_bias": maxvio([counts[E:2 * E]]),
            "saturated": saturated / max(total, 1)}


def activation_rows(stage: K3Stage) -> tuple[list[int], torch.Tensor | None]:
    """(MoE layers, [L, 3] on the device: per layer the max-abs and RMS of the routed output and the max-abs of the
    residual stream)."""
    layers = [key for key, block in stage.blocks.items() if block.moe is not None]
    if not layers:
        return [], None
    rows = []
    for key in layers:
        block = stage.blocks[key]
        st = block.moe.stats
        rows.append(torch.stack([st.routed_maxabs, st.routed_rms(), block.resid_maxabs]))
    return [int(k) for k in layers], torch.stack(rows)


def activation_dict(layers: list[int], values: list[list[float]]) -> dict[int, dict[str, float]]:
    return {k: {"routed_maxabs": v[0], "routed_rms": v[1], "resid_maxabs": v[2]} for k, v in zip(layers, values)}


def activation_stats(stage: K3Stage) -> dict[int, dict[str, float]]:
    """Per-layer max-abs and RMS of the routed output and max-abs of the residual stream, one host copy."""
    layers, rows = activation_rows(stage)
    return {} if rows is None else activation_dict(layers, rows.cpu().tolist())


class HostCopy:
    """Many small tensors' values on their way to the host: one copy per device, issued at once (into pinned memory,
    behind the work already queued on a GPU), waited for in `values()`: work queued in between (a step ahead) does
    not delay the values, nor change them."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.shapes = [(t.shape, t.is_floating_point()) for t in tensors]
        self.parts: list[tuple[list[int], torch.Tensor, object]] = []  # (indices, host values, CUDA event)
        by_device: dict[torch.device, list[int]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device, []).append(i)
        for device, indices in by_device.items():
            flat = torch.cat([tensors[i].detach().reshape(-1).to(torch.float64) for i in indices])
            event = None
            if device.type == "cuda":
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                flat = host
            self.parts.append((indices, flat, event))

    def values(self) -> list:
        """The tensors' values as (nested) lists; integer tensors give ints (float64 carries them exactly below
        2^53). Waits for the copies (the one host wait for all of them)."""
        out: list = [None] * len(self.shapes)
        for indices, flat, event in self.parts:
            if event is not None:
                event.synchronize()
            for i, part in zip(indices, flat.split([self.shapes[i][0].numel() for i in indices])):
                shape, floating = self.shapes[i]
                out[i] = (part if floating else part.long()).view(shape).tolist()
        return out


@dataclass
class StepReport:
    step: int
    batch_index: int
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    # layer -> [R][E] routes each EP rank sent to each expert this step
    tokens_per_expert: dict[int, list[list[int]]] = field(default_factory=dict)
    maxvio: dict[int, float] = field(default_factory=dict)  # layer -> MaxVio, derived from tokens_per_expert
    activations: dict[int, dict[str, float]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # seconds by phase
    rank_load: dict[int, list[int]] = field(default_factory=dict)  # layer -> tokens computed per EP rank
    balance: dict[int, dict[str, float]] = field(default_factory=dict)  # layer -> balance_diagnostics

    def __post_init__(self) -> None:
        self.maxvio = {layer: maxvio(rows) for layer, rows in self.tokens_per_expert.items()}

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def mean_maxvio(self) -> float:
        return sum(self.maxvio.values()) / max(len(self.maxvio), 1)


@dataclass
class BalanceReads:
    """What a worker's step report reads of the routing statistics (`tensors`, on the device), and how the host
    values become the report's routing fields (`report`); read with the step's other values in one copy."""
    moe_layers: list[int]
    balance_layers: list[int]
    activation_layers: list[int]
    num_experts: int
    tensors: list[torch.Tensor]

    def report(self, host: list) -> dict:
        """The routing fields from the host values of `tensors`, in their order."""
        if not self.moe_layers:
            return {}
        host = iter(host)
        tpe, rank_load = {}, {}
        for layer in self.moe_layers:
            tpe[layer], rank_load[layer] = next(host), next(host)
        balance = {layer: balance_diagnostics(next(host), self.num_experts) for layer in self.balance_layers}
        return {"tokens_per_expert": tpe, "rank_load": rank_load, "balance": balance,
                "activations": activation_dict(self.activation_layers, next(host)) if self.activation_layers else {}}


def reduce_balance(cfg: ModelConfig, stage: K3Stage, ep_group, ep: int) -> BalanceReads:
    """All-reduce the step's routing statistics over the stage's EP group of `ep` ranks (one integer all-reduce for
    every MoE layer of the stage) and set each layer's router bias; what the step report reads of them."""
    moes = stage.moe_layers()
    E = cfg.n_experts
    if not moes:
        return BalanceReads([], [], [], E, [])
    parts = []
    for moe in moes.values():
        st = moe.stats
        parts.append(st.tokens_per_expert.reshape(-1))
        if st.histogram is not None:
            parts += [st.histogram.reshape(-1), st.balance]
    flat = torch.cat(parts)
    if ep > 1:
        dist.all_reduce(flat, group=ep_group)
    offset, balance_counts = 0, {}
    for layer, moe in moes.items():
        load = flat[offset:offset + E]
        offset += E
        hist = None
        if moe.stats.histogram is not None:
            n = moe.stats.histogram.numel()
            hist = flat[offset:offset + n].view_as(moe.stats.histogram)
            offset += n
            balance_counts[layer] = flat[offset:offset + 2 * E + 2]
            offset += 2 * E + 2
        update_router_bias(cfg, moe, hist, load)
    act_layers, act_rows = activation_rows(stage)
    reads = [t for moe in moes.values() for t in (moe.experts.tokens_per_rank_expert, moe.experts.rank_load)]
    reads += list(balance_counts.values()) + ([] if act_rows is None else [act_rows])
    return BalanceReads(list(moes), list(balance_counts), act_layers, E, reads)
