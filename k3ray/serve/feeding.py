"""How a running request's known tokens are fed to the model: in chunks, or one token an iteration as a decode row
whose sampled token is dropped until the last one (stepwise: the iteration stays decode-shaped and replays a decode
CUDA graph, a few ms at any batch, instead of running eagerly).

Stepwise are, where `stepwise_max` (serve.stepwise_prefill_max) is > 0 (decode graphs: a GPU grid at ep=1): a prompt
of at most that many tokens (with any output to prefill again), and a run of output a grammar forced (jump-forward:
written at once, none of it sampled) no longer than its rank's rows, in an iteration that decodes only. Fed whole,
such a run would make every row's step eager, about one decode step more for each of them, for fewer steps saved to
its own request; in an iteration that runs eagerly anyway it is fed whole. Pure functions over the scheduler's
requests (k3ray.serve.scheduler_output.Request).
"""
from __future__ import annotations

from k3ray.serve.scheduler_output import Request


def stepwise(req: Request, stepwise_max: int | None) -> bool:
    """Whether `req`'s prompt (and output, after a preemption or a lost grid) is fed one token an iteration."""
    return req.length <= (stepwise_max or 0)


def forced_only(req: Request) -> bool:
    """Whether what `req` has left to run is output that jump-forward wrote (its prompt is scheduled)."""
    return req.planned >= len(req.prompt) and req.length + req.unconfirmed <= req.forced_end


def eager_ranks(running: list[Request], waiting: list[Request], pools, stepwise_max: int | None) -> list[bool]:
    """Per rank (`pools`: the ranks' cache pools, k3ray.serve.cache_allocator), before an iteration is scheduled:
    whether it will run eagerly, as a prompt chunk of several tokens, a new request's first chunk or a forced run
    longer than the rank's rows is expected, rather than replay a decode graph. Without decode graphs (stepwise_max
    0: the CPU, ep > 1) every iteration is eager. `running`: the requests that get a row."""
    rows, eager = [0] * len(pools), [not stepwise_max] * len(pools)
    for req in running:
        rows[req.rank] += 1
    for req in running:
        if req.to_run > 1 and not stepwise(req, stepwise_max) and (not forced_only(req) or req.to_run > rows[req.rank]):
            eager[req.rank] = True
    if waiting and not stepwise(waiting[0], stepwise_max):
        for rank, pool in enumerate(pools):
            eager[rank] = eager[rank] or bool(pool.free_slots)
    return eager
