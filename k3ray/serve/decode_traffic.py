"""The decode shapes of a serving engine's latest iterations (`DecodeTraffic`, owned by the ServingGrid): a grid
started after traffic (a recovery, a relaunch, a resize) captures the CUDA graphs of those shapes first, most used
first, and no others ahead of traffic (k3ray.parallel.serving.DecodeGraphs.capture_ahead), so it serves again
sooner than one that captures every likely graph, and the iterations that come first (the requests in flight go on
where they were) replay at once. Only the latest iterations count: the shapes of traffic long gone come last."""
from __future__ import annotations

from collections import Counter, deque

from k3ray.parallel.serving import RankPlan, decode_shape

RECENT = 256  # iterations (per rank) whose shapes count


class DecodeTraffic:
    def __init__(self, recent: int = RECENT):
        self.shapes: deque = deque(maxlen=recent)  # (rows, longest sequence, greedy), powers of two, oldest first

    def record(self, plans: dict[int, RankPlan]) -> None:
        """Each rank's decode shape in one iteration (plans: rank -> RankPlan)."""
        for plan in plans.values():
            if (shape := decode_shape(plan)) is not None:
                self.shapes.append(shape)

    def ranked(self) -> list[tuple[int, int, bool]]:
        """The shapes of the latest iterations, most used first (the newest first among equals)."""
        counts = Counter(reversed(self.shapes))
        return [shape for shape, _ in counts.most_common()]
