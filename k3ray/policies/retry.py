"""How long a bounded handler waits before trying again: a doubling backoff, capped. A pure function of the attempt
count, used by training's recoveries and launches and by serving's recoveries."""
from __future__ import annotations

MAX_BACKOFF_S = 30.0


def backoff_s(attempt: int, base_s: float, cap_s: float = MAX_BACKOFF_S) -> float:
    """The wait after attempt `attempt` (1-based) failed: base_s before the second attempt, twice as long before each
    next, at most cap_s; none before the first attempt or with no base."""
    if attempt < 1 or base_s <= 0:
        return 0.0
    return min(cap_s, base_s * 2 ** (attempt - 1))
