"""The 1F1B micro-batch schedule of one pipeline stage.

Stage p of P with M micro-batches runs min(P - p - 1, M) warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards. Every EP rank of a stage runs the same sequence, so the MoE
all-to-alls inside a forward or backward line up across the stage's EP group.
"""
from __future__ import annotations


def one_f_one_b(num_micro: int, stage: int, num_stages: int) -> list[tuple[str, int]]:
    """[("F", m) | ("B", m)] in execution order for this stage."""
    warmup = min(num_stages - stage - 1, num_micro)
    ops = [("F", m) for m in range(warmup)]
    for i in range(num_micro - warmup):
        ops += [("F", warmup + i), ("B", i)]
    ops += [("B", m) for m in range(num_micro - warmup, num_micro)]
    return ops
