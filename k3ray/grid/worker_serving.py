"""A Worker's serving calls (k3ray.grid.worker owns one): cache pools beside the stage of the place held (loaded by a
restore), this worker's part of each serving iteration, its routed-token counts, and read-only expert copies fetched
beside the iterations and switched to between two."""
from __future__ import annotations

import traceback

import torch

from k3ray.grid.snapshots import as_state
from k3ray.grid.worker_seat import WorkerSeat


class StepFailed(RuntimeError):
    """A serving iteration failed in this worker (its traceback as text)."""


class WorkerServing:
    def __init__(self, seat: WorkerSeat):
        self.seat = seat
        self.server = None  # the StageServer beside the engine (k3ray.parallel.serving), made by serve_init

    def serve_init(self, pages: int, page_size: int, slots: int, checkpoints: int = 0, graphs_budget_s: float = 0.0,
                   traffic: list | None = None) -> dict[str, float]:
        """Cache pools for serving beside the stage this worker holds (with `checkpoints` prefix-cache KDA state
        checkpoints), and the decode CUDA graphs that
        `graphs_budget_s` seconds capture (GPU): those of `traffic`'s decode shapes (a grid's so far, most used
        first; `DecodeGraphs.capture_ahead`), else the likeliest and then, for as many seconds, the prompt graphs'
        token buckets, smallest first. Returns the captures' seconds and the first one's (a new process's kernels
        load in it)."""
        from k3ray.model.cache import new_pools
        from k3ray.parallel.serving import DEFAULT_TOKEN_BUDGET, StageServer

        e = self.seat.engine
        pools = new_pools(e.cfg.model, e.layers, pages, page_size, slots, e.device, checkpoints)
        rank = e.pp_rank * e.ep + e.ep_rank
        self.server = StageServer(e.stage, pools, e.device, rank - e.ep if e.pp_rank > 0 else None,
                                  rank + e.ep if e.pp_rank < e.pp - 1 else None, e.groups,
                                  token_budget=e.cfg.serve.token_budget or DEFAULT_TOKEN_BUDGET)
        graphs, prompt_graphs = self.server.graphs, self.server.prompt_graphs
        if graphs_budget_s <= 0 or graphs is None:
            return {"seconds": 0.0, "first": 0.0}
        graphs.capture_ahead(graphs_budget_s, traffic)
        seconds = graphs.capture_seconds
        # a grid that replaces one (traffic known) serves again sooner capturing each bucket on its first use
        if prompt_graphs is not None and traffic is None:
            prompt_graphs.capture_ahead(graphs_budget_s)
            seconds += prompt_graphs.capture_seconds
        return {"seconds": seconds, "first": graphs.first_capture_seconds}

    def serve_pages_that_fit(self, page_size: int, slots: int, fraction: float, checkpoints: int = 0) -> int:
        """Latent pages of this worker's stage that `fraction` of its device's free memory holds beside `slots`
        sequences' state and `checkpoints` state checkpoints (k3ray.model.cache.pages_that_fit)."""
        from k3ray.model.cache import pages_that_fit

        e = self.seat.engine
        free, _ = torch.cuda.mem_get_info(e.device)
        return pages_that_fit(e.cfg.model, e.layers, page_size, slots, fraction * free, checkpoints)

    def serve_step(self, plan):
        """This worker's part of a serving iteration: its rank's plan (k3ray.parallel.serving.RankPlan) in, a
        StageOutput out. A failure is raised again as StepFailed, its traceback as text and without its frames: their
        locals (the step's tensors, the grid's process groups) go before the text is made, which reads every frame's
        source file (seconds on a loaded host, the first time)."""
        try:
            return self.server.step(plan)
        except Exception as err:  # noqa: BLE001 - raised again below, outside this block, so that its frames go
            traceback.clear_frames(err.__traceback__)
            failed = "".join(traceback.format_exception(err))
        raise StepFailed(failed.rstrip())

    def expert_load(self) -> dict[int, list[int]]:
        return self.server.expert_load()

    def stage_copies(self, experts: list[int], *states) -> int:
        """Fetch read-only copies of `experts` from the held weights (object refs, resolved by Ray before this runs)
        beside the iterations; the bytes fetched."""
        return self.seat.engine.copies.stage_read_only(experts, [as_state(s) for s in states])

    def use_copies(self, table: list[list[int]]) -> bool:
        """Switch to a copy table between two iterations (k3ray.parallel.engine_copies.EngineCopies.use)."""
        self.seat.engine.copies.use(table)
        return True

    def leave(self) -> None:
        """The grid was left: its cache pools go with the engine."""
        self.server = None
