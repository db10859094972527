"""How many steps apart in-memory snapshots are taken when `fault_tolerance.snapshot_every` is "auto".

A lost worker costs a replay of the steps since the last snapshot, so the closer snapshots are, the shorter a
recovery. Each snapshot costs training its staging stall at the boundary and the optimizer's wait for the part of
the state read live (k3ray.grid.snapshot_stager), and it must have arrived in the object store before the next one is
due (one still arriving is skipped, not waited for). The interval is the smallest that keeps that cost within
`budget` of the training time between two snapshots and lets each arrive before the next.

Where the object store holds one snapshot at a time, the one before is gone while the next arrives, and a worker
lost then goes back to the base (the job's start point or its newest durable checkpoint): snapshots are then spaced
so that they arrive in at most WINDOW_SHARE of the steps, and a loss at a random step goes back to the last snapshot
nine times in ten."""
from __future__ import annotations

import math

MOST_STEPS = 100  # never further apart (but for the window below): a recovery replays at most this many steps
WINDOW_SHARE = 0.1  # one snapshot at a time: the share of steps during which one arrives, at most


def snapshot_interval(cost_s: float, step_s: float, arrival_steps: int, budget: float, most: int = MOST_STEPS,
                      one_at_a_time: bool = False) -> int:
    """Steps between snapshots. cost_s: what one snapshot costs training (stall + optimizer wait); step_s: one step
    without a snapshot; arrival_steps: the steps that ended before a snapshot was found arrived, counting the one
    it was taken before (1: it arrived during that step); budget: the share of training time snapshots may cost
    (0.02: 2 %); one_at_a_time: the store holds one snapshot (the window above)."""
    window = math.ceil(arrival_steps / WINDOW_SHARE) if one_at_a_time and arrival_steps > 1 else 1
    if step_s <= 0:
        return max(most, window)
    by_cost = math.ceil(cost_s / (budget * step_s))
    return max(1, min(most, max(by_cost, arrival_steps)), window)
