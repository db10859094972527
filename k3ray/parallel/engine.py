"""StageEngine: everything one worker does for one step, as plain library code (the Worker actor only holds it).

Worker (p, e) runs pipeline stage p on its own micro-batches (dp rank e) and holds expert shard e of every MoE
layer of stage p. World rank = p * ep + e. Process groups: the world (pipeline send/recv, loss and grad-norm
reductions) and one EP group per stage (MoE all-to-alls, dense-gradient and balancing-statistics all-reduces).

Why the schedule is our own 1F1B loop (`k3ray.parallel.pipeline`) rather than torch.distributed.pipelining's
Schedule1F1B:
- every EP rank of a stage must issue the MoE all-to-alls of a micro-batch (counts all-gather, MoonEP-planned
  dispatch, replica weights, combine) in the same order relative to the pipeline's sends and receives. This loop
  fixes that order (the same op list on every EP rank, a blocking receive before each op); pipelining batches its
  P2P operations and decides itself when to wait on them, so their order against EP-group collectives would be a
  detail of torch's implementation, and on gloo a collective queued behind an unfinished P2P is a hang;
- the float64 equivalence tests pin the summation order of the loss and gradients to the single-process reference
  (each micro-batch's loss scaled by 1/(ep * M) before backward, one flat dense-gradient all-reduce); pipelining
  accumulates unscaled gradients and divides by the micro-batch count afterwards;
- its stage is a module whose forward is a function of the received tensor only; ours also gathers routing
  statistics and timings for the step report.
The schedule itself stays a pure function (`one_f_one_b`) that tests can read.

The engine owns its parts: the grid generation's process groups (k3ray.parallel.grid_groups), the batches its EP
rank runs (k3ray.parallel.batches) and, once the stage is built, its expert copies (k3ray.parallel.engine_copies).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from k3ray.config import JobConfig
from k3ray.dtypes import up32
from k3ray.kernels import adding_into_grads
from k3ray.model.decoder import boundary_shape, build_stage, is_expert_param, set_execution
from k3ray.optim import AdamW, clip_coefficient, lr_at, sum_of_squares
from k3ray.parallel import shards
from k3ray.parallel.batches import StageBatches
from k3ray.parallel.device_timer import DeviceTimer
from k3ray.parallel.engine_copies import EngineCopies
from k3ray.parallel.ep import EPContext, ExpertParallelExperts
from k3ray.parallel.grid_groups import GridGroups, LeftGroup
from k3ray.parallel.micro_batch_graphs import MicroBatchGraphs, hooked
from k3ray.parallel.pipeline import one_f_one_b
from k3ray.parallel.step import HostCopy, lm_loss, reduce_balance


@dataclass
class StepAhead:
    """The next step's micro-batches (forward, loss, backward), queued behind this step's optimizer before its
    report was read: while the report travels to the controller and the next call comes back, the device already
    works on them. Used by that call when it asks for the same step and batch, with the same parameters."""
    step: int
    batch_index: int
    key: tuple
    loss_sum: torch.Tensor
    compute_s: float
    boundary: torch.cuda.Event | None  # recorded before it: the state of the boundary is complete there (CUDA)


class StageEngine:
    """ep_size is the live number of EP ranks, which differs from cfg.parallel.ep while the job runs shrunk after a
    worker loss (then homes may be uneven: 16 experts on 3 ranks); the batches keep the configured data-parallel
    width (k3ray.parallel.batches)."""

    def __init__(self, cfg: JobConfig, pp_rank: int, ep_rank: int, home: list[int], ep_size: int,
                 device: str = "cpu", init_weights: bool = True):
        self.cfg, self.pp_rank, self.ep_rank = cfg, pp_rank, ep_rank
        self.pp, self.ep = cfg.parallel.pp, ep_size
        self.device = torch.device(device)
        self.device_timer = DeviceTimer(self.device)  # the step's phases on the device (the previous step's)
        self.home = torch.tensor(home, dtype=torch.int64)
        self.layers = cfg.model.stage_layers(self.pp, pp_rank)
        # world ranks of this EP rank in the stages before and after (pipeline sends and receives)
        self.prev_rank, self.next_rank = (pp_rank - 1) * ep_size + ep_rank, (pp_rank + 1) * ep_size + ep_rank
        self.batches = StageBatches(cfg, ep_rank, ep_size, self.device)
        self.opt = AdamW(cfg.optimizer)
        self.lr_scale = 1.0
        self.steps_trained = 0  # by this engine: until one, the device's free memory does not yet show a step's
        self.groups = GridGroups()  # the grid generation's process groups (joined in init_process_groups)
        self.ctx: EPContext | None = None
        self.copies: EngineCopies | None = None  # the stage's expert copies (made with the stage)
        self.graphs: MicroBatchGraphs | None = None  # micro-batches as CUDA graphs, where they can be (made with the stage)
        self.init_weights = init_weights  # False when a restore follows: initialising would be wasted time
        # CUDA events of copies still reading the live state (a snapshot's device-to-host transfer): whatever writes
        # the state next (the optimizer, a restore, a reshard) waits for them on the device, not on the host
        self.state_reads: list = []
        self.ahead: StepAhead | None = None

    # -- setup ---------------------------------------------------------------------------------------------------
    def init_process_groups(self, init_method: str, backend: str, generation: int = 0) -> None:
        """Join grid `generation`'s process groups (the world and this stage's EP group) and build the stage."""
        self.groups.join(init_method, backend, generation, self.pp_rank, self.ep_rank, self.pp, self.ep,
                         self.cfg.parallel.collective_timeout_s)
        self.ctx = EPContext(self.groups.ep_group, self.ep_rank, self.ep, self.home, self.cfg.model, self.cfg.policies)
        self._build_stage()

    def leave_process_groups(self) -> None:
        """Leave this grid's process groups (before the worker joins another grid): from now on every collective of
        this engine, the EP context's too, raises LeftGrid."""
        if self.ctx is not None:
            self.ctx.group = LeftGroup(self.groups.generation)
        self.groups.leave(self.device.type == "cuda")

    def _build_stage(self) -> None:
        mine = (self.home == self.ep_rank).nonzero().flatten().tolist()
        self.stage = build_stage(self.cfg.model, self.layers, mine, seed=self.cfg.train.seed,
                                 experts_factory=lambda layer, shard: ExpertParallelExperts(shard, self.ctx),
                                 device=self.device, init=self.init_weights)
        self.stage.train()
        set_execution(self.stage, self.cfg.execution, self.device.type)
        self.copies = EngineCopies(self.stage, self.ctx)
        self._refresh_params()
        self.set_graphs()

    def set_graphs(self) -> None:
        """Decide from the config whether the stage's micro-batches replay as CUDA graphs: where one micro-batch can
        be one graph (one stage; one EP rank: an exchange takes its splits from the host; documents unmasked)."""
        self.graphs = MicroBatchGraphs(lambda: step_state_slots(self.stage, self.params.values())) \
            if self._whole_model() and self.cfg.execution.graphs_micro_batches(self.device.type) else None

    def _refresh_params(self) -> None:
        self.params = dict(self.stage.named_parameters())
        self.dense = {n: p for n, p in self.params.items() if not is_expert_param(n)}
        self.experts = {n: p for n, p in self.params.items() if is_expert_param(n)}

    # -- one step ------------------------------------------------------------------------------------------------
    def train_step(self, step: int, batch_index: int, next_batch: int | None = None) -> dict:
        """Step `step` on batch `batch_index` -> its report. `next_batch`: the batch the next step will most likely
        run (the controller's data order, no step of its own in between): where the stage holds the whole model,
        that step's micro-batches are queued behind this step's optimizer before this report is read
        (`StepAhead`), and the next call that asks for it finds them done or under way."""
        cfg, stage = self.cfg, self.stage
        M = cfg.parallel.micro_batches
        dp = self.batches.dp_ranks
        # a micro-batch of k DP ranks' rows is the mean over all of them: times k, it counts as k micro-batches
        scale = len(dp) / (cfg.parallel.ep * M)
        # run_ahead: the host seconds of this step's micro-batches queued in the call before (0: none ran ahead)
        timings = {"compute": 0.0, "pipeline_wait": 0.0, "run_ahead": 0.0}
        self.ctx.comm_seconds = 0.0
        t_step = time.perf_counter()
        whole = self._whole_model()
        key = (scale, *[(p.data_ptr(), p.dtype) for p in self.params.values()]) if whole else None
        hooks = hooked(stage)  # a drill's: the step runs eagerly, never ahead
        ahead, self.ahead = self.ahead, None
        if ahead is not None and (ahead.step, ahead.batch_index, ahead.key) == (step, batch_index, key) and not hooks:
            loss_sum, timings["compute"], timings["run_ahead"] = ahead.loss_sum, ahead.compute_s, ahead.compute_s
        else:
            _clear_step_state(stage, self.params.values())
            self.device_timer.mark("start")
            if whole:
                t0 = time.perf_counter()
                loss_sum = self._micro_batches(batch_index, scale, key)
                timings["compute"] += time.perf_counter() - t0
            else:
                loss_sum = self._pipeline_micro_batches(batch_index, scale, timings)
        self.device_timer.mark("backward_done")
        t_opt = time.perf_counter()
        balance, host_copy, lr = self._finish_step(step, loss_sum, timings)
        timings["optimizer"] = time.perf_counter() - t_opt
        timings["dispatch_combine"] = self.ctx.comm_seconds
        timings["compute"] -= self.ctx.comm_seconds
        self.device_timer.mark("end")
        device_seconds = self.device_timer.finish()
        if next_batch is not None and whole and cfg.execution.steps_ahead(self.device.type) and not hooks \
                and (self.graphs is None or self.graphs.ready(key)):  # no capture inside a step ahead
            self.ahead = self._step_ahead(step + 1, next_batch, scale, key)
        *routing, (sq, loss) = host_copy.values()  # the step's one host wait
        # the step's own host seconds: its part run ahead in the call before counted, the next step's not
        timings["total"] = time.perf_counter() - t_step + timings["run_ahead"] - \
            (self.ahead.compute_s if self.ahead is not None else 0.0)
        report = {"step": step, "loss": loss, "grad_norm": sq ** 0.5, "lr": lr, **balance.report(routing)}
        report["timings"] = {**timings, **device_seconds}
        report["batch_index"] = batch_index
        self.steps_trained += 1
        return report

    def discard_ahead(self) -> None:
        """Forget the step ahead (a call that may change what a step reads or writes: its work is redone)."""
        self.ahead = None

    def _whole_model(self) -> bool:
        """Whether a micro-batch is one forward and backward of this stage alone (one stage, one EP rank, documents
        unmasked): what CUDA graphs replay and what may run a step ahead."""
        return self.pp == 1 and self.ep == 1 and not self.cfg.data.document_masking

    def boundary_event(self) -> torch.cuda.Event | None:
        """Where on the device the state of the step boundary is complete, when work of the next step already
        follows it (a step ahead: a snapshot's copies need not wait for that); None: the stream's current point."""
        return None if self.ahead is None else self.ahead.boundary

    def _step_ahead(self, step: int, batch_index: int, scale: float, key: tuple) -> StepAhead:
        boundary = None
        if self.device.type == "cuda":
            boundary = torch.cuda.Event()
            boundary.record()
        t0 = time.perf_counter()
        _clear_step_state(self.stage, self.params.values())
        self.device_timer.mark("start")
        loss_sum = self._micro_batches(batch_index, scale, key)
        return StepAhead(step, batch_index, key, loss_sum, time.perf_counter() - t0, boundary)

    def _micro_batches(self, batch_index: int, scale: float, key: tuple) -> torch.Tensor:
        """The step's micro-batches on a stage holding the whole model, replayed as CUDA graphs where they can be,
        else eagerly -> the summed loss (0-d, float64, on the device)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        graphed = self.graphs is not None and self.graphs.usable(self.stage)
        for m in range(self.cfg.parallel.micro_batches):
            tokens = self.batches.micro_batch(batch_index, m)
            loss_sum += self.graphs.run(m, tokens, (tuple(tokens.shape), *key), lambda t: self._micro_batch(t, scale)) \
                if graphed else self._micro_batch(tokens, scale)
        return loss_sum

    def _pipeline_micro_batches(self, batch_index: int, scale: float, timings: dict[str, float]) -> torch.Tensor:
        """The step's micro-batches through the 1F1B schedule of the pipeline and its EP exchanges -> the summed loss
        (0-d, float64, on the device; zero on stages before the last)."""
        cfg, stage = self.cfg, self.stage
        M = cfg.parallel.micro_batches
        dp = self.batches.dp_ranks
        # what the previous stage sends: the hidden state (and, with Block AttnRes, the block summaries)
        shape = boundary_shape(cfg.model, self.layers.start, len(dp) * cfg.data.micro_batch_size, cfg.data.seq_len)
        out_shape = boundary_shape(cfg.model, self.layers.stop, len(dp) * cfg.data.micro_batch_size, cfg.data.seq_len)
        dtype = getattr(torch, cfg.model.dtype)
        saved: dict[int, tuple] = {}
        pending = []
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for op, m in one_f_one_b(M, self.pp_rank, self.pp):
            if op == "F":
                tokens = self.batches.micro_batch(batch_index, m)
                if stage.is_first:
                    x = tokens[:, :-1]
                else:
                    x = _receive(shape, dtype, self.device, self.prev_rank, m, self.groups.world, timings)
                    x.requires_grad_(True)
                t0 = time.perf_counter()
                out = stage(x, documents=self.batches.documents(tokens))
                if stage.is_last:
                    out = lm_loss(out, tokens, scale)
                    loss_sum += out.detach()
                else:
                    pending.append(dist.isend(out.detach().contiguous(), self.next_rank, tag=m,
                                              group=self.groups.world))
                timings["compute"] += time.perf_counter() - t0
                saved[m] = (x, out)
            else:
                x, out = saved.pop(m)
                grad = None if stage.is_last else _receive(out_shape, dtype, self.device, self.next_rank, M + m,
                                                           self.groups.world, timings)
                t0 = time.perf_counter()
                with adding_into_grads():  # the experts' weight gradients of micro-batches after the first
                    out.backward(grad)
                timings["compute"] += time.perf_counter() - t0
                if not stage.is_first:
                    pending.append(dist.isend(x.grad.contiguous(), self.prev_rank, tag=M + m,
                                              group=self.groups.world))
        for work in pending:
            work.wait()
        return loss_sum

    def _micro_batch(self, tokens: torch.Tensor, scale: float) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch on a stage holding the whole model (the graphs' body: what
        the 1F1B loop does at pp = 1 for a micro-batch without document masking) -> its loss."""
        loss = lm_loss(self.stage(tokens[:, :-1]), tokens, scale)
        with adding_into_grads():
            loss.backward()
        return loss.detach()

    def _finish_step(self, step: int, loss_sum: torch.Tensor, timings: dict[str, float]) -> tuple:
        """Gradients reduced and clipped, the optimizer and the router biases queued -> (the balance reads, their
        `HostCopy` with the squared gradient norm and loss last, the step's learning rate)."""
        cfg = self.cfg
        self.copies.return_grads()  # copies' gradients join their home's (where the optimizer state is)
        # dense gradients: sum over the stage's EP group (one flat all-reduce)
        grads = [p.grad for p in self.dense.values() if p.grad is not None]
        if self.ep > 1 and grads:
            flat = torch.cat([up32(g.reshape(-1)) for g in grads])
            dist.all_reduce(flat, group=self.groups.ep_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        # global grad norm and loss: dense counted once per stage (EP rank 0), experts on their holder
        # (no gradients: a zero made on the device, not copied there from the host, which would wait for the device)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        expert_grads = [p.grad for p in self.experts.values() if p.grad is not None]
        dense_sq = sum_of_squares(grads) if self.ep_rank == 0 and grads else zero
        expert_sq = sum_of_squares(expert_grads) if expert_grads else zero
        totals = torch.stack([dense_sq.double() + expert_sq.double(), loss_sum.double()])
        dist.all_reduce(totals, group=self.groups.world)
        lr = lr_at(cfg.optimizer, step, cfg.train.steps, self.lr_scale)
        timings["snapshot_wait"] = self.wait_state_reads()  # a snapshot's part read live holds the optimizer
        self.device_timer.mark("optimizer_start")
        # the clip coefficient stays on the device: the optimizer is queued without waiting for the backward
        self.opt.step(self.params, lr, clip_coefficient(totals[0], cfg.optimizer.grad_clip))
        self.device_timer.mark("optimizer_done")
        if any(self.ctx.copies):
            self.copies.fetch(self.ctx.copies)  # the copies take the home's new weights
        balance = reduce_balance(cfg.model, self.stage, self.groups.ep_group, self.ep)
        return balance, HostCopy(balance.tensors + [totals]), lr

    # -- evaluation ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over eval_batches, pipelined forward-only; EP rank e takes batches e, e+ep, ..."""
        cfg, stage = self.cfg, self.stage
        n = cfg.train.eval_batches
        shape = boundary_shape(cfg.model, self.layers.start, cfg.data.micro_batch_size, cfg.data.seq_len)
        total = torch.zeros((), dtype=torch.float64)
        rounds = -(-n // self.ep)
        for r in range(rounds):
            i = r * self.ep + self.ep_rank
            tokens = self.batches.validation(i % n)
            if stage.is_first:
                x = tokens[:, :-1]
            else:
                x = torch.empty(shape, dtype=getattr(torch, cfg.model.dtype), device=self.device)
                dist.recv(x, self.prev_rank, tag=r, group=self.groups.world)
            out = stage(x, documents=self.batches.documents(tokens))
            if stage.is_last:
                if i < n:
                    total += float(lm_loss(out, tokens, 1.0))
            else:
                dist.send(out.contiguous(), self.next_rank, tag=r, group=self.groups.world)
        stage.reset_stats()
        for moe in stage.moe_layers().values():
            moe.experts.reset()
        t = total.to(self.device)
        dist.all_reduce(t, group=self.groups.world)
        return float(t) / n

    # -- expert shards -------------------------------------------------------------------------------------------
    def export_shard(self, expert_ids: list[int] | None = None) -> dict[int, dict]:
        """layer -> payload for the given experts (default: all this worker holds) of every MoE layer."""
        out = {}
        for layer, shard in self.stage.expert_shards().items():
            ids = shard.expert_ids if expert_ids is None else expert_ids
            out[layer] = shards.export_experts(shard, self.opt, shards.shard_prefix(layer), ids)
        return out

    def set_placement(self, home: list[int], imports: dict[int, list[dict]] | None = None) -> None:
        """Adopt a new home table: drop experts no longer homed here, add imported ones (layer -> payloads). Any
        copies are dropped."""
        self.wait_state_reads()
        self.copies.drop()
        self.home.copy_(torch.tensor(home, dtype=torch.int64))
        mine = set((self.home == self.ep_rank).nonzero().flatten().tolist())
        for layer, shard in self.stage.expert_shards().items():
            keep = [e for e in shard.expert_ids if e in mine]
            payloads = (imports or {}).get(layer, [])
            shards.set_experts(shard, self.opt, shards.shard_prefix(layer), payloads, keep)
            if set(shard.expert_ids) != mine:
                raise ValueError(f"layer {layer}: rank {self.ep_rank} holds {shard.expert_ids}, placement says "
                                 f"{sorted(mine)}")
        self._refresh_params()

    # -- whole-worker state (snapshots, checkpoints, restore onto another topology) ------------------------------
    def load_weights_only(self, write, opt_steps: int = 0, lr_scale: float = 1.0) -> None:
        """Restore weights without optimizer state (serving's): write() fills every parameter and router bias of the
        stage in place (the experts homed here, in their shard's order); the optimizer's state is dropped."""
        self.wait_state_reads()
        self.opt.state.clear()
        self.opt.steps, self.lr_scale = opt_steps, lr_scale
        self.copies.drop()
        write()
        self._refresh_params()

    def wait_state_reads(self) -> float:
        """Order the next write of the live state after the copies still reading it: on the device (a CUDA event),
        or on the host (a threading.Event: the chunks of a snapshot that the device had no room to stage, streamed
        to the store from the live tensors). Returns the seconds waited on the host."""
        t0 = time.perf_counter()
        for event in self.state_reads:
            if isinstance(event, threading.Event):
                event.wait()
            else:
                torch.cuda.current_stream(self.device).wait_event(event)
        self.state_reads = []
        return time.perf_counter() - t0

    def state_tensors(self, dense: bool = True, rounded_params: bool = True) -> dict:
        """Everything this worker's training depends on, as the live tensors (no copies): dense parameters and
        their optimizer state (left out with dense=False: every EP rank of a stage holds the same), expert shards
        (with theirs), router biases, optimizer step count, learning-rate scale. Snapshots copy it aside;
        `state_dict` copies it to the host. The optimizer state is complete from the start (zero moments before the
        first step), so every snapshot of a job has the same size. rounded_params=False leaves out the parameters
        an fp32 master stands for (bf16 training: each is its master's rounding, and a restore rounds it again):
        a seventh of a bf16 state, which snapshots need not copy."""
        self.opt.init_state(self.params)
        kept = {n: p.detach() for n, p in self.dense.items()
                if rounded_params or "master" not in self.opt.state[n]} if dense else {}
        return {
            "stage": self.pp_rank, "layers": list(self.layers),
            "dense": kept,
            "opt_dense": {n: dict(st) for n, st in self.opt.state.items() if dense and not is_expert_param(n)},
            "experts": {layer: shards.live_payload(shard, self.opt, shards.shard_prefix(layer), rounded_params)
                        for layer, shard in self.stage.expert_shards().items()},
            "router_bias": {i: moe.router.bias.detach() for i, moe in self.stage.moe_layers().items()},
            "opt_steps": self.opt.steps,
            "lr_scale": self.lr_scale,
        }

    def state_dict(self, dense: bool = True) -> dict:
        """`state_tensors` copied to the host (checkpoints)."""
        return tree_map_only(torch.Tensor, lambda t: t.cpu().clone(), self.state_tensors(dense))

    @torch.no_grad()
    def load_state(self, dense_state: dict, expert_payloads: dict[int, list[dict]]) -> None:
        """Restore from a stage's dense state (any EP rank's: they are identical) and the expert payloads of the
        stage's layers (from any number of old shards; only the experts homed here are kept)."""
        self.wait_state_reads()
        for n in list(self.opt.state):
            if not is_expert_param(n):
                del self.opt.state[n]
        for n, st in dense_state["opt_dense"].items():
            self.opt.state[n] = self.opt.adopt({k: v.to(self.device).clone() for k, v in st.items()})
        self.opt.steps = dense_state["opt_steps"]
        self.lr_scale = dense_state["lr_scale"]
        mine = set((self.home == self.ep_rank).nonzero().flatten().tolist())
        self.copies.drop()
        shards.load_weights(self.stage, self.opt, dense_state, expert_payloads, mine)
        self._refresh_params()


def step_state_slots(stage, params) -> list[tuple[object, str]]:
    """Where a training step accumulates over its micro-batches: the routing statistics, the residual stream's
    max-abs, the experts' accounting and the gradients, as (object, attribute)."""
    slots = [(block, "resid_maxabs") for block in stage.blocks.values()]
    for moe in stage.moe_layers().values():
        slots += [(moe.stats, name) for name in moe.stats.FIELDS]
        slots += [(moe.experts, name) for name in moe.experts.STEP_FIELDS]
    return slots + [(p, "grad") for p in params]


def _clear_step_state(stage, params) -> None:
    """A step starts with no routing statistics, expert-copy state or gradients left from the one before."""
    for obj, name in step_state_slots(stage, params):
        setattr(obj, name, None)


def _receive(shape, dtype, device, src: int, tag: int, group, timings: dict[str, float]) -> torch.Tensor:
    """A tensor of `shape` received from pipeline neighbour `src` (blocking), the wait counted as pipeline_wait."""
    x = torch.empty(shape, dtype=dtype, device=device)
    t0 = time.perf_counter()
    dist.recv(x, src, tag=tag, group=group)
    timings["pipeline_wait"] += time.perf_counter() - t0
    return x
