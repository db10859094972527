"""Expert-parallel routed experts over one stage's EP group: dispatch, expert compute, combine.

Notation: R EP ranks, E experts, K top-k, T local tokens, D = d_latent. Per micro-batch and MoE layer:
  1. all-gather tokens_per_expert [R, E] (every rank then holds the same counts);
  2. plan alloc [E, R] with the worker's Planner (k3ray.policies.planner: MoonEP when enabled, else every expert on
     its home rank), and this rank's slices of the send matrix: what it sends [E, R] and receives [R, E];
  3. replica weights travel home -> computing rank (all-to-all; autograd returns their gradients home), unless the
     computing rank holds a copy of the expert (`ExpertCopies`, placed by k3ray.policies.copies: read-only in
     serving; in training fetched from home at a step boundary and after each optimizer step, their gradients
     summed over the step's micro-batches and returned home once before the optimizer step);
  4. routes are scattered straight into the send buffer (ordered by destination rank, then expert), all-to-all,
     regrouped by expert, the grouped expert FFN, then the reverse path and a weighted sum per token.
Every rank derives the same plan from the same counts, so splits agree without further negotiation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from k3ray.config import ModelConfig, PoliciesConfig
from k3ray.kernels import grouped_expert_ffn, outside_compile, permute_rows, unpermute_rows
from k3ray.model.moe import ExpertShard, add_into, route_order
from k3ray.policies import copies as copies_policy
from k3ray.policies import moonep
from k3ray.policies.planner import Planner, build_gemm_order, build_planner


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """all_to_all_single with variable first-dim splits (not differentiable: the layer's backward is explicit)."""
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


@dataclass
class Exchange:
    """Everything one layer's dispatch/compute/combine needs, derived from the plan (same on every rank)."""
    in_splits: list[int]  # rows I send to each rank
    out_splits: list[int]  # rows I receive from each rank
    to_group: torch.Tensor  # received row i -> its row in the expert-grouped buffer
    from_group: torch.Tensor  # inverse permutation
    group_ends: torch.Tensor  # [G] int32
    group_order: torch.Tensor | None  # order the expert GEMMs run in (scheduling policy), None = kernel default
    home_rows: list[int]  # per computed expert: row in my shard, or -1 for a received replica
    replica_rows: list[int]  # per computed expert: row in the received-weights buffer, or -1
    copy_rows: list[int]  # per computed expert: row in my read-only copies, or -1
    any_replicas: bool  # some rank computes a replica (then every rank joins the weight exchange)
    w_send_rows: list[int]  # my shard rows to send, destination-major
    w_in_splits: list[int]
    w_out_splits: list[int]
    copies: "ExpertCopies | None" = None  # this rank's read-only copies of the layer (no gradient)


@dataclass(frozen=True)
class ExpertCopies:
    """Copies of some non-home experts of one MoE layer on one rank: expert_ids [n] sorted, w1 [n, d_latent, 2I],
    w2 [n, I, d_latent] (the shard's layout). Read-only in serving; in training w1 and w2 are leaves that gather
    the gradients of the rows computed with them (sent home once per step, k3ray.parallel.engine_copies)."""
    expert_ids: list[int]
    w1: torch.Tensor
    w2: torch.Tensor


@dataclass(frozen=True)
class CopyRoutes:
    """Where one rank's copies of a layer come from: a copy table (R lists of expert ids, the same on every rank)
    seen from rank `me`. Weights go home -> holder with send_rows (my shard rows, destination-major, experts
    ascending) and send_splits; they arrive ordered by home rank, then expert id (arrival [n] expert ids,
    recv_splits per home rank). Gradients take the reverse path."""
    send_rows: list[int]
    send_splits: list[int]
    arrival: list[int]
    recv_splits: list[int]

    @classmethod
    def of(cls, table: list[list[int]], home: list[int], me: int, shard_ids: list[int]) -> "CopyRoutes":
        row = {e: i for i, e in enumerate(shard_ids)}
        to = [sorted(e for e in held if home[e] == me) for held in table]
        arrival = sorted(table[me], key=lambda e: (home[e], e))
        return cls([row[e] for experts in to for e in experts], [len(x) for x in to], arrival,
                   [sum(home[e] == r for e in arrival) for r in range(len(table))])


class _ExpertExchange(torch.autograd.Function):
    """send_buf [N, D] (routes in send order) -> rows back from the experts [N, D], in send order.

    Forward: dispatch all-to-all, replica-weight all-to-all, grouped expert FFN, combine all-to-all. Backward issues
    the reverse exchanges explicitly, always in the same order on every rank (combine, dispatch, weights), and
    differentiates the local expert compute with autograd.grad, so no collective ever depends on the autograd
    engine's node order or on whether a rank happened to use a received tensor."""

    @staticmethod
    def forward(ctx, send_buf, w1, w2, c1, c2, ex: Exchange, group, build_graph: bool, timer):
        ctx.ex, ctx.group, ctx.timer = ex, group, timer
        recv = timer(all_to_all, send_buf, ex.out_splits, ex.in_splits, group)
        shape1, shape2 = w1.shape[1:], w2.shape[1:]
        received = None
        if ex.any_replicas:
            w_flat = torch.cat([w1.flatten(1), w2.flatten(1)], dim=1)
            received = timer(all_to_all, w_flat[ex.w_send_rows], ex.w_out_splits, ex.w_in_splits, group)
        with torch.enable_grad() if build_graph else torch.no_grad():
            leaves = [t.detach().requires_grad_(build_graph) for t in (recv, w1, w2)]
            recv_l, w1_l, w2_l = leaves
            if received is not None:  # every rank joins the weight exchange once any rank computes a replica
                received_l = received.detach().requires_grad_(build_graph)
                leaves.append(received_l)
            if c1 is not None:  # copies held here (training: their gradients are gathered, then sent home)
                c1_l, c2_l = (t.detach().requires_grad_(build_graph and t.requires_grad) for t in (c1, c2))
                if c1_l.requires_grad:
                    leaves += [c1_l, c2_l]
            if any(r >= 0 for r in ex.replica_rows + ex.copy_rows):  # weights from shard + copies + received
                # One gather per weight, so each is contiguous: the expert GEMMs then read it through TMA, the
                # same compiled kernels as without replicas.
                n1, n_copies = shape1.numel(), 0 if ex.copies is None else len(ex.copies.expert_ids)
                rows = [h if h >= 0 else w1.shape[0] + c if c >= 0 else w1.shape[0] + n_copies + r
                        for h, c, r in zip(ex.home_rows, ex.copy_rows, ex.replica_rows)]
                parts1, parts2 = [w1_l.flatten(1)], [w2_l.flatten(1)]
                if n_copies:
                    parts1.append(c1_l.flatten(1))
                    parts2.append(c2_l.flatten(1))
                if received is not None:
                    parts1.append(received_l[:, :n1])
                    parts2.append(received_l[:, n1:])
                gw1 = torch.cat(parts1)[rows].view(-1, *shape1)
                gw2 = torch.cat(parts2)[rows].view(-1, *shape2)
            elif ex.home_rows == list(range(w1.shape[0])):  # the whole shard, in order: no copy
                gw1, gw2 = w1_l, w2_l
            else:
                gw1, gw2 = w1_l[ex.home_rows], w2_l[ex.home_rows]
            y = grouped_expert_ffn(recv_l.index_select(0, ex.from_group), gw1, gw2, ex.group_ends,
                                   group_order=ex.group_order)
            y_recv = y.index_select(0, ex.to_group)
        ctx.graph = (y_recv, leaves) if build_graph else None
        ctx.copies_grad = c1 is not None and c1_l.requires_grad
        return timer(all_to_all, y_recv.detach(), ex.in_splits, ex.out_splits, group)

    @staticmethod
    def backward(ctx, grad_back):
        ex, group, timer = ctx.ex, ctx.group, ctx.timer
        y_recv, leaves = ctx.graph
        grad_y = timer(all_to_all, grad_back, ex.out_splits, ex.in_splits, group)
        grads = torch.autograd.grad(y_recv, leaves, grad_y, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
        grad_send = timer(all_to_all, grads[0], ex.in_splits, ex.out_splits, group)
        grad_w1, grad_w2 = grads[1], grads[2]
        grad_c1, grad_c2 = (grads[-2], grads[-1]) if ctx.copies_grad else (None, None)
        if ex.any_replicas:
            back = timer(all_to_all, grads[3], ex.w_in_splits, ex.w_out_splits, group)
            n1 = grad_w1[0].numel()
            rows = torch.tensor(ex.w_send_rows, dtype=torch.long, device=back.device)
            grad_w1 = grad_w1.index_add(0, rows, back[:, :n1].view(-1, *grad_w1.shape[1:]))
            grad_w2 = grad_w2.index_add(0, rows, back[:, n1:].view(-1, *grad_w2.shape[1:]))
        ctx.graph = None
        return grad_send, grad_w1, grad_w2, grad_c1, grad_c2, None, None, None, None


class EPContext:
    """What the EP executors of one worker share: the group, this rank, expert homes and the live data-path policies
    (the placement planner and the expert-GEMM order, rebuilt from the policies config when they change; the model's
    shape prices MoonEP's weight copies)."""

    def __init__(self, group, rank: int, num_ranks: int, home: torch.Tensor, model: ModelConfig,
                 policies: PoliciesConfig | None = None):
        self.group, self.rank, self.num_ranks = group, rank, num_ranks
        self.home = home  # [E] int64 home rank of every expert (the placement table's view for this stage)
        self.model = model
        self.copies: list[list[int]] = [[] for _ in range(num_ranks)]  # experts each rank holds read-only copies of
        self.copy_held = torch.zeros(num_ranks, home.numel(), dtype=torch.bool)  # [R, E] the same as a mask
        self.set_policies(policies or PoliciesConfig())
        self.comm_seconds = 0.0  # time inside dispatch/combine collectives since the last reset

    def set_policies(self, policies: PoliciesConfig) -> None:
        self.policies = policies
        holders = copies_policy.holders_of(self.home.tolist(), self.copies) if any(self.copies) else None
        self.planner: Planner = build_planner(policies, self.model, holders)
        self.gemm_order = build_gemm_order(policies)  # rows per group [G] -> GEMM order; None: the kernel's own

    def set_copies(self, copies: list[list[int]]) -> None:
        """The copy table from now on (the same on every rank of the group; each layer's `ExpertCopies` set with
        it): R lists of expert ids."""
        self.copies = [sorted(c) for c in copies]
        self.copy_held = torch.zeros(self.num_ranks, self.home.numel(), dtype=torch.bool)
        for r, experts in enumerate(self.copies):
            self.copy_held[r, experts] = True
        self.set_policies(self.policies)


def _positions(counts_ED: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix offsets of a block layout ordered (D-major, then E): [E, D] -> start row of block (e, d)."""
    flat = counts_ED.t().reshape(-1)
    return (flat.cumsum(0) - flat).view(counts_ED.shape[1], counts_ED.shape[0]).t()


class ExpertParallelExperts(nn.Module):
    STEP_FIELDS = ("rank_load", "tokens_per_rank_expert")  # what a training step accumulates (`reset` clears)

    def __init__(self, shard: ExpertShard, ctx: EPContext):
        super().__init__()
        self.shard, self.ctx = shard, ctx
        self.copies: ExpertCopies | None = None  # copies held here (EPContext.copies[rank] names them)
        self.routes: CopyRoutes | None = None  # training: where the copies came from (None: no copies in the group)
        self.rank_load: torch.Tensor | None = None  # [R] rows computed per rank, summed over the step
        self.tokens_per_rank_expert: torch.Tensor | None = None  # [R, E] summed over the step

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.ctx.comm_seconds += time.perf_counter() - t0
        return out

    @outside_compile  # host-planned exchange and collectives: eager, between a compiled block's graphs
    def forward(self, h_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
        ctx, me = self.ctx, self.ctx.rank
        R, E = ctx.num_ranks, ctx.home.numel()
        if R == 1:
            return self._local(h_TD, idx_TK, weight_TK)
        local = torch.bincount(idx_TK.reshape(-1), minlength=E)
        gathered = [torch.empty_like(local) for _ in range(R)]
        self._timed(dist.all_gather, gathered, local, ctx.group)
        tpe_RE = torch.stack(gathered).cpu()  # the one host sync of the layer: splits live on the host
        alloc = ctx.planner.plan(tpe_RE, ctx.home, torch.is_grad_enabled())  # [E, R]
        mine = moonep.send_matrix(tpe_RE, alloc, src=me)  # [E, R_dst] what I send
        recv_counts = moonep.received_by(tpe_RE, alloc, me)  # [R_src, E] what I receive
        self._account(tpe_RE, alloc)

        # -- where each of my routes goes: destination rank, then its row in the send buffer (d-major, e-minor).
        # Per-route work stays on the device; only [E, R]-sized tables come from the host.
        dev = h_TD.device
        edges = mine.cumsum(1)  # [E, R] end of each destination's share inside expert e's block
        flat = idx_TK.reshape(-1)
        order = torch.argsort(flat, stable=True)
        sorted_e = flat[order]
        local_start = (local.cumsum(0) - local)
        within = torch.arange(flat.numel(), device=dev) - local_start[sorted_e]  # rank inside e's block
        edges_d, block_start_d = edges.to(dev), (_positions(mine) - (edges - mine)).to(dev)
        d = torch.searchsorted(edges_d[sorted_e], within[:, None], right=True).squeeze(1)
        dest = torch.empty_like(flat)
        dest[order] = block_start_d[sorted_e, d] + within
        dest = dest.view_as(idx_TK)
        in_splits, out_splits = mine.sum(0).tolist(), recv_counts.sum(1).tolist()
        # -- received rows come source-major, expert-minor; the expert FFN wants them grouped by expert
        computed, homed = alloc[:, me] > 0, ctx.home == me
        if not (computed & ~homed).any():  # no replicas here: run every home expert (empty groups cost nothing),
            computed = homed  # so the expert GEMMs read the shard in place instead of a gathered copy
        groups = computed.nonzero().flatten()  # experts this rank computes, ascending
        rows_per_group = alloc[groups, me]
        group_start = torch.zeros(E, dtype=torch.int64)
        group_start[groups] = rows_per_group.cumsum(0) - rows_per_group
        blk_len = recv_counts.reshape(-1)
        blk_dst = (group_start[None, :] + recv_counts.cumsum(0) - recv_counts).reshape(-1)
        blk_src = blk_len.cumsum(0) - blk_len
        n_recv = int(blk_len.sum())
        to_group = torch.repeat_interleave((blk_dst - blk_src).to(dev), blk_len.to(dev), output_size=n_recv) \
            + torch.arange(n_recv, device=dev)
        from_group = torch.empty_like(to_group)
        from_group[to_group] = torch.arange(n_recv, device=dev)
        ex = Exchange(in_splits=in_splits, out_splits=out_splits, to_group=to_group, from_group=from_group,
                      group_ends=rows_per_group.cumsum(0).to(device=dev, dtype=torch.int32),
                      group_order=None if ctx.gemm_order is None else ctx.gemm_order(rows_per_group).to(dev),
                      copies=self.copies, **self._weight_routes(groups, alloc))
        send_buf = permute_rows(h_TD, dest, flat.numel())
        c1, c2 = (None, None) if self.copies is None else (self.copies.w1, self.copies.w2)
        back = _ExpertExchange.apply(send_buf, self.shard.w1, self.shard.w2, c1, c2, ex, ctx.group,
                                     torch.is_grad_enabled(), self._timed)
        return unpermute_rows(back, dest, weight_TK)

    def _local(self, h_TD: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
        """One EP rank holds every expert: no exchange and no plan, so no host sync (a serving decode step can be
        a CUDA graph). The layout is the exchange's at R = 1 (routes grouped by expert, stable)."""
        dest, counts, ends = route_order(idx_TK, self.ctx.home.numel())
        if torch.is_grad_enabled():  # the step report's accounting (training)
            self._account(counts[None], counts[:, None])
        rows = permute_rows(h_TD, dest, idx_TK.numel())
        y = grouped_expert_ffn(rows, self.shard.w1, self.shard.w2, ends,
                               group_order=None if self.ctx.gemm_order is None else self.ctx.gemm_order(counts))
        return unpermute_rows(y, dest, weight_TK)

    def _weight_routes(self, groups: torch.Tensor, alloc: torch.Tensor) -> dict:
        """Where the weights of each computed expert come from (my shard or the replica exchange), and which of
        my shard's rows go to which rank. Received replicas arrive ordered by home rank, then expert id."""
        ctx, me = self.ctx, self.ctx.rank
        R, E = ctx.num_ranks, ctx.home.numel()
        ranks = torch.arange(R)[:, None]
        replica = (alloc.t() > 0) & (ctx.home[None, :] != ranks) & ~ctx.copy_held  # [R_dst, E] weights to move
        shard_row = {e: i for i, e in enumerate(self.shard.expert_ids)}
        mine_to = [(replica[d] & (ctx.home == me)).nonzero().flatten().tolist() for d in range(R)]
        my_replicas = replica[me].nonzero().flatten()
        from_home = ctx.home[my_replicas]
        recv_order = my_replicas[torch.argsort(from_home * E + my_replicas)].tolist()
        recv_row = {e: i for i, e in enumerate(recv_order)}
        g = groups.tolist()
        copy_row = {} if self.copies is None else {e: i for i, e in enumerate(self.copies.expert_ids)}
        return {
            "home_rows": [shard_row.get(e, -1) for e in g],
            "copy_rows": [copy_row.get(e, -1) if e not in shard_row else -1 for e in g],
            "replica_rows": [recv_row.get(e, -1) for e in g],
            "any_replicas": bool(replica.any()),
            "w_send_rows": [shard_row[e] for d in range(R) for e in mine_to[d]],
            "w_in_splits": [len(x) for x in mine_to],
            "w_out_splits": torch.bincount(from_home, minlength=R).tolist(),
        }

    # -- trained copies: fetched from home, gradients returned home --------------------------------------------------
    # The stage engine runs one all-to-all for all its MoE layers (k3ray.parallel.engine_copies): each layer gives
    # its rows to send and takes its part of what arrived; rows are [n, w1 + w2 values] in the routes' order.
    @torch.no_grad()
    def copy_rows_to_send(self, table: list[list[int]]) -> torch.Tensor:
        """Training: this layer's routes for copy table `table`; returns my shard's rows the holders get [n, W]."""
        self.routes = CopyRoutes.of(table, self.ctx.home.tolist(), self.ctx.rank, self.shard.expert_ids)
        w1, w2 = self.shard.w1, self.shard.w2
        return torch.cat([w1.flatten(1), w2.flatten(1)], dim=1)[self.routes.send_rows]

    @torch.no_grad()
    def hold_copies(self, experts: list[int], arrived: torch.Tensor) -> None:
        """Hold copies of `experts` (this rank's entry of the table) from the rows that arrived [n, W] (arrival
        order), as leaves that gather the gradients of the rows computed with them."""
        if not experts:
            self.copies = None
            return
        got = arrived[[self.routes.arrival.index(e) for e in experts]]  # arrival order -> expert order
        w1, w2 = self.shard.w1, self.shard.w2
        n1 = w1[0].numel()
        self.copies = ExpertCopies(experts, got[:, :n1].reshape(-1, *w1.shape[1:]).requires_grad_(True),
                                   got[:, n1:].reshape(-1, *w2.shape[1:]).requires_grad_(True))

    @torch.no_grad()
    def copy_grads_to_send(self) -> torch.Tensor:
        """After the step's backward: the copies' gradients (summed over the micro-batches) in arrival order [n, W],
        to go home; the copies' own are cleared."""
        w1, w2 = self.shard.w1, self.shard.w2
        if self.copies is None:
            return w1.new_zeros(0, w1[0].numel() + w2[0].numel())
        grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in (self.copies.w1, self.copies.w2)]
        flat = torch.cat([grads[0].flatten(1), grads[1].flatten(1)], dim=1)
        self.copies.w1.grad = self.copies.w2.grad = None
        return flat[[self.copies.expert_ids.index(e) for e in self.routes.arrival]]

    @torch.no_grad()
    def add_home_grads(self, back: torch.Tensor) -> None:
        """Add the gradients of my experts' copies that came home [n, W] (send order) to the shard's."""
        w1, w2 = self.shard.w1, self.shard.w2
        n1 = w1[0].numel()
        rows = torch.tensor(self.routes.send_rows, dtype=torch.long, device=back.device)
        for w, part in ((w1, back[:, :n1]), (w2, back[:, n1:])):
            if w.grad is None:
                w.grad = torch.zeros_like(w)
            w.grad.index_add_(0, rows, part.reshape(-1, *w.shape[1:]))

    def drop_copies(self) -> None:
        self.copies, self.routes = None, None

    def _account(self, tpe_RE: torch.Tensor, alloc: torch.Tensor) -> None:
        self.rank_load = add_into(self.rank_load, alloc.sum(0))
        self.tokens_per_rank_expert = add_into(self.tokens_per_rank_expert, tpe_RE)

    def reset(self) -> None:
        for name in self.STEP_FIELDS:
            setattr(self, name, None)
