"""The decode shapes a serving engine's iterations had, counted (`DecodeTraffic`, owned by the ServingGrid): a grid
started after traffic (a recovery, a relaunch, a resize) captures the CUDA graphs of those shapes first, most used
first, and no others ahead of traffic (k3ray.parallel.serving.DecodeGraphs.capture_ahead), so it serves again
sooner than one that captures every likely graph, and the iterations that come first replay at once."""
from __future__ import annotations

from collections import Counter

from k3ray.parallel.serving import RankPlan, decode_shape


class DecodeTraffic:
    def __init__(self):
        self.counts: Counter = Counter()  # (rows, longest sequence, greedy), powers of two -> iterations per rank

    def record(self, plans: dict[int, RankPlan]) -> None:
        """Count each rank's decode shape in one iteration (plans: rank -> RankPlan)."""
        for plan in plans.values():
            if (shape := decode_shape(plan)) is not None:
                self.counts[shape] += 1

    def ranked(self) -> list[tuple[int, int, bool]]:
        """The shapes seen, most used first."""
        return [shape for shape, _ in self.counts.most_common()]
