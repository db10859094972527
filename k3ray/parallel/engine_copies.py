"""The expert copies a stage engine holds (k3ray.parallel.engine.StageEngine owns one per stage it builds).

In training, copies of hot experts in spare slots, fetched from their homes at a step boundary and again after each
optimizer step, their gradients returned home before it (`set_trained`; the engine's step calls `return_grads` and
`fetch`; one all-to-all for all the stage's MoE layers each). In serving, read-only copies fetched from the held
weights beside the iterations and switched to between two iterations (`stage_read_only`, `use`). Whatever replaces
the weights or the homes drops them (`drop`)."""
from __future__ import annotations

import torch

from k3ray.model.decoder import K3Stage
from k3ray.parallel import shards
from k3ray.parallel.ep import EPContext, ExpertCopies, all_to_all


class EngineCopies:
    def __init__(self, stage: K3Stage, ctx: EPContext):
        self.stage, self.ctx = stage, ctx  # ctx: this rank (ctx.rank) of ctx.num_ranks, and the EP group
        self.staged: dict[int, dict[int, tuple]] = {}  # layer -> expert -> (w1, w2) fetched, not yet used

    # -- trained expert copies ---------------------------------------------------------------------------------------
    def set_trained(self, table: list[list[int]]) -> int:
        """Training, at a step boundary: hold copies of the experts table[ep_rank] (R lists of expert ids, the same
        on every rank of every stage) in spare slots from now on, fetched from their homes; each step's tokens of an
        expert are split over its holders (k3ray.policies.copies.copy_alloc), the copies' gradients go home before
        the optimizer step and the copies are fetched again after it. Results equal training without copies.
        Returns the bytes fetched."""
        return self.fetch(table)

    @torch.no_grad()
    def fetch(self, table: list[list[int]]) -> int:
        """Every MoE layer's copies of table[ep_rank] from their homes, in one all-to-all over the EP group (every
        rank calls it with the same table); the bytes received."""
        layers = [moe.experts for moe in self.stage.moe_layers().values()]
        nbytes = 0
        if not any(table):
            for layer in layers:
                layer.drop_copies()
        elif layers:
            parts = [layer.copy_rows_to_send(table) for layer in layers]
            routes = layers[0].routes  # the splits depend on the table and the homes only: the same in every layer
            got = all_to_all(torch.cat(parts, dim=1), routes.recv_splits, routes.send_splits, self.ctx.group)
            for layer, part in zip(layers, got.split([p.shape[1] for p in parts], dim=1)):
                layer.hold_copies(sorted(table[self.ctx.rank]), part)
            nbytes = got.numel() * got.element_size()
        self.ctx.set_copies(table)
        return nbytes

    @torch.no_grad()
    def return_grads(self) -> None:
        """After the step's backward: every MoE layer's copy gradients go home and join the shard's, in one
        all-to-all over the EP group (the reverse of `fetch`); nothing while no rank holds a copy."""
        layers = [moe.experts for moe in self.stage.moe_layers().values()]
        if not layers or layers[0].routes is None:
            return
        parts = [layer.copy_grads_to_send() for layer in layers]
        routes = layers[0].routes
        back = all_to_all(torch.cat(parts, dim=1), routes.send_splits, routes.recv_splits, self.ctx.group)
        for layer, part in zip(layers, back.split([p.shape[1] for p in parts], dim=1)):
            layer.add_home_grads(part)

    def drop(self) -> None:
        """Weights or homes replaced (a restore, a re-homing): the copies are gone until the next table."""
        for moe in self.stage.moe_layers().values():
            moe.experts.drop_copies()
        self.ctx.set_copies([[] for _ in range(self.ctx.num_ranks)])

    # -- read-only expert copies (serving) -------------------------------------------------------------------------
    @torch.no_grad()
    def stage_read_only(self, experts: list[int], states: list[dict]) -> int:
        """Fetch copies of `experts` for every MoE layer of the stage from whole-stage states (their expert
        payloads) and hold them aside until `use`; returns the bytes fetched. Safe beside an iteration: the live
        copies are not touched."""
        staged, nbytes = {}, 0
        for i, moe in self.stage.moe_layers().items():
            shard = moe.experts.shard
            w = shards.read_only_copies([s["experts"][i] for s in states], experts, shard.w1.device, shard.w1.dtype)
            staged[i] = dict(zip(experts, zip(w["w1"], w["w2"])))
            nbytes += sum(t.numel() * t.element_size() for t in w.values())
        self.staged = {i: {**self.staged.get(i, {}), **rows} for i, rows in staged.items()}
        return nbytes

    def use(self, table: list[list[int]]) -> None:
        """Switch to the copy table (R lists of expert ids, the same on every rank): this rank keeps the copies it
        holds or staged that the table names, drops the rest, and plans with the table from the next layer on."""
        mine = sorted(table[self.ctx.rank])
        for i, moe in self.stage.moe_layers().items():
            held = {} if moe.experts.copies is None else dict(zip(moe.experts.copies.expert_ids,
                                                                  zip(moe.experts.copies.w1, moe.experts.copies.w2)))
            rows = {**held, **self.staged.get(i, {})}
            missing = [e for e in mine if e not in rows]
            if missing:
                raise ValueError(f"layer {i}: the copy table names experts {missing} this rank never fetched")
            moe.experts.copies = None if not mine else ExpertCopies(
                mine, torch.stack([rows[e][0] for e in mine]), torch.stack([rows[e][1] for e in mine]))
        self.staged = {}
        self.ctx.set_copies(table)
