"""Calibrate the scheduling policy's cost model time(rows) = overhead + per_row * rows for one expert's GEMMs on a
GPU (K3 latent expert: K = d_latent = 3584, I = 2048, bf16, the Triton grouped FFN with one group), then check
the LPT schedule's predicted makespan against the measured time of a skewed 112-expert call.

    python benchmarks/calibrate_schedule.py        (CUDA required)
"""
from __future__ import annotations

import torch
import triton.testing

from k3ray.kernels import grouped_expert_ffn
from k3ray.policies.scheduling import CostModel, calibrate, schedule

K, I = 3584, 2048


def time_us(rows_per_group: list[int]) -> float:
    g = len(rows_per_group)
    x = torch.randn(sum(rows_per_group), K, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(g, K, 2 * I, device="cuda", dtype=torch.bfloat16) * K ** -0.5
    w2 = torch.randn(g, I, K, device="cuda", dtype=torch.bfloat16) * I ** -0.5
    ends = torch.tensor(rows_per_group, device="cuda").cumsum(0).to(torch.int32)
    return 1e3 * triton.testing.do_bench(lambda: grouped_expert_ffn(x, w1, w2, ends), warmup=50, rep=200,
                                         return_mode="median")


def main() -> None:
    """Single-expert calls are host-bound (launch and setup ~0.6-0.9 ms whatever the rows), so calibrate from
    whole-chip calls: the slope over total rows (112 balanced experts) is the chip's per-row cost, the slope over
    the number of experts at fixed rows the per-expert overhead. For `lanes` SM groups each lane is `lanes` times
    slower: CostModel(overhead = c * lanes, per_row = b * lanes)."""
    per = [32, 64, 128, 256, 512]
    t_rows = [time_us([r] * 112) for r in per]
    fit_rows = calibrate(torch.tensor([112 * r for r in per]), torch.tensor(t_rows))
    groups = [14, 28, 56, 112]
    t_groups = [time_us([32768 // g] * g) for g in groups]
    fit_groups = calibrate(torch.tensor(groups), torch.tensor(t_groups))
    b, c = fit_rows.per_row_us, fit_groups.per_row_us  # per row (chip), per expert (chip)
    host = fit_rows.overhead_us - 112 * c
    print("rows/expert x 112 experts:", ", ".join(f"{r}: {t:.0f} us" for r, t in zip(per, t_rows)))
    print("experts at 32768 rows:    ", ", ".join(f"{g}: {t:.0f} us" for g, t in zip(groups, t_groups)))
    print(f"chip model: {host:.0f} us fixed + {c:.2f} us/expert + {b:.4f} us/row")

    gen = torch.Generator().manual_seed(0)
    p = 1.0 / torch.arange(1, 113, dtype=torch.float64) ** 1.2
    counts = torch.multinomial(p / p.sum(), 32768, replacement=True, generator=gen).bincount(minlength=112)
    measured = time_us(counts.tolist())
    for lanes in (4, 8, 16):
        model = CostModel(overhead_us=c * lanes, per_row_us=b * lanes)
        pred = host + schedule(counts, lanes, model).makespan_us
        print(f"112 experts Zipf 1.2 (largest {int(counts.max())} rows), 32768 rows: measured {measured:.0f} us; "
              f"predicted with {lanes} lanes {pred:.0f} us (measured/predicted {measured / pred:.2f})")
    print(f"per-lane CostModel for 8 lanes: overhead_us={c * 8:.2f}, per_row_us={b * 8:.5f}")


if __name__ == "__main__":
    main()
