"""Moving expert shards: export rows of a worker's ExpertShard (weights and their optimizer moments) and import
them elsewhere. A payload is plain CPU tensors, so it travels through Ray's object store or a checkpoint file."""
from __future__ import annotations

import torch
from torch import nn

from k3ray.model.decoder import K3Stage, is_expert_param
from k3ray.model.moe import ExpertShard
from k3ray.optim import AdamW, fresh_state

WEIGHTS = ("w1", "w2")


def live_payload(shard: ExpertShard, opt: AdamW, prefix: str, rounded_params: bool = True) -> dict:
    """The whole shard in payload form, as its live tensors (no copies): what snapshots stage. rounded_params=False
    leaves out (None) the weights an fp32 master in their optimizer state stands for (`weights`)."""
    opt_state = {w: opt.state.get(f"{prefix}.{w}") for w in WEIGHTS}
    return {"expert_ids": list(shard.expert_ids),
            **{w: None if not rounded_params and "master" in (opt_state[w] or {}) else getattr(shard, w).detach()
               for w in WEIGHTS},
            "opt": opt_state}


def weights(payload: dict, w: str) -> torch.Tensor:
    """Weight `w` of a payload: its own, or its fp32 master where the payload left the weight out (the caller rounds
    it to the parameter's dtype, as the optimizer does after every step)."""
    return payload[w] if payload[w] is not None else payload["opt"][w]["master"]


def export_experts(shard: ExpertShard, opt: AdamW, prefix: str, expert_ids: list[int]) -> dict:
    """{'expert_ids', 'w1', 'w2', 'opt': {'w1': {'m', 'v'[, 'master']} | None, ...}} for the given experts of this
    shard, as CPU copies."""
    rows = shard.rows_of(expert_ids)
    return {
        "expert_ids": list(expert_ids),
        **{w: getattr(shard, w).detach()[rows].cpu().clone() for w in WEIGHTS},
        "opt": {w: _cpu(opt.take_rows(f"{prefix}.{w}", rows)) for w in WEIGHTS},
    }


def _cpu(state):
    return None if state is None else {k: v.cpu() for k, v in state.items()}


def select_experts(payload: dict, keep: set[int]) -> dict:
    """The part of a payload holding only the experts in `keep`."""
    rows = [i for i, e in enumerate(payload["expert_ids"]) if e in keep]
    return {
        "expert_ids": [payload["expert_ids"][i] for i in rows],
        **{w: None if payload[w] is None else payload[w][rows] for w in WEIGHTS},
        "opt": {w: None if st is None else {k: v[rows] for k, v in st.items()} for w, st in payload["opt"].items()},
    }


def set_experts(shard: ExpertShard, opt: AdamW, prefix: str, payloads: list[dict], keep: list[int]) -> None:
    """Rebuild the shard to hold `keep` (ids it has now) plus every payload's experts, sorted by expert id."""
    device, dtype = shard.w1.device, shard.w1.dtype
    current = export_experts(shard, opt, prefix, keep)
    parts = [current] + payloads
    ids = [e for p in parts for e in p["expert_ids"]]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{prefix}: duplicate experts in import: {sorted(ids)}")
    order = sorted(range(len(ids)), key=ids.__getitem__)
    for w in WEIGHTS:
        stacked = _stacked(parts, w, order, device, dtype)
        setattr(shard, w, nn.Parameter(stacked))
        states = [p["opt"][w] for p in parts]
        if any(s is not None for s in states):  # experts that arrive without state start fresh (zero moments)
            filled = [s if s is not None else fresh_state(weights(p, w).to(dtype), opt.moments)
                      for s, p in zip(states, parts)]
            opt.set_state(f"{prefix}.{w}", {k: torch.cat([f[k] for f in filled])[order].to(device)
                                            for k in filled[0]})
        else:
            opt.set_state(f"{prefix}.{w}", None)
    shard.expert_ids = sorted(ids)


def _stacked(parts: list[dict], w: str, order: list[int], device, dtype, rows_at_once: int = 64) -> torch.Tensor:
    """Weight `w` of every part, rows concatenated then taken in `order`, on `device` in `dtype`. A weight that
    comes as its fp32 master is moved as it is and rounded there, a few rows at a time (the host would round it
    many times slower, and the whole of it in fp32 would double the device memory a restore needs)."""
    total = sum(len(p["expert_ids"]) for p in parts)
    if all(p[w] is not None for p in parts):
        return torch.cat([p[w] for p in parts])[order].to(device=device, dtype=dtype)
    where = torch.empty(total, dtype=torch.long)
    where[torch.tensor(order, dtype=torch.long)] = torch.arange(total)  # row j of the concatenation goes to where[j]
    first = weights(parts[0], w)
    out = torch.empty((total, *first.shape[1:]), dtype=dtype, device=device)
    start = 0
    for p in parts:
        rows = weights(p, w)
        for i in range(0, len(rows), rows_at_once):
            block = rows[i:i + rows_at_once]
            out[where[start + i:start + i + len(block)].to(device)] = block.to(device).to(dtype)
        start += len(rows)
    return out


def shard_prefix(layer: int) -> str:
    """The optimizer-state name of a layer's expert shard."""
    return f"blocks.{layer}.moe.experts.shard"


@torch.no_grad()
def load_weights(stage: K3Stage, opt: AdamW, dense_state: dict, expert_payloads: dict[int, list[dict]],
                 mine: set[int]) -> None:
    """Set a stage's dense parameters and router biases from a stage state (any that holds its layers' names), and
    its expert shards to the experts in `mine`, taken from payloads of any number of old shards."""
    for n, p in stage.named_parameters():
        if not is_expert_param(n):  # left out of the state: the rounding of its master, restored before this
            p.copy_(dense_state["dense"][n].to(p.device) if n in dense_state["dense"] else opt.state[n]["master"])
    for i, moe in stage.moe_layers().items():
        moe.router.bias.copy_(dense_state["router_bias"][i].to(moe.router.bias.device))
    for layer, shard in stage.expert_shards().items():
        parts = [select_experts(p, mine) for p in expert_payloads[layer]]
        set_experts(shard, opt, shard_prefix(layer), [p for p in parts if p["expert_ids"]], [])
        if set(shard.expert_ids) != mine:
            raise ValueError(f"layer {layer}: restore gave experts {shard.expert_ids}, placement says "
                             f"{sorted(mine)}")



def read_only_copies(payloads: list[dict], expert_ids: list[int], device, dtype) -> dict[str, torch.Tensor]:
    """{'w1', 'w2'}: the weights of `expert_ids` (non-empty, in that order) from payloads of any shards of one
    layer, on `device` in `dtype` (no optimizer state: serving's read-only copies)."""
    found = {e: (p, i) for p in payloads for i, e in enumerate(p["expert_ids"])}
    missing = [e for e in expert_ids if e not in found]
    if missing:
        raise ValueError(f"no weights for experts {missing} in the payloads")
    return {w: torch.stack([weights(found[e][0], w)[found[e][1]] for e in expert_ids]).to(device=device, dtype=dtype)
            for w in WEIGHTS}
