"""Router selection and load balancing as pure functions (K3_NOTES, "Router and Quantile Balancing").

T tokens, E experts, K top-k, nb histogram bins.

Quantile Balancing sets b_hat_j = -quantile_{1-K/E}(s_:j - alpha) with alpha_i the (K+1)-th largest of s_i + b.
We histogram the margins x_ij = s_ij - alpha_i + b_j instead of s_ij - alpha_i: the two differ by the constant b_j per
expert, so b_hat_j = b_j - quantile(x_:j) exactly, but x is centred on the decision boundary (expert j is picked by
token i iff x_ij > 0) and the quantile is the correction this step makes to b_j.

The bins are log-spaced around the boundary: u = sign(x) log(1 + |x|/r) / log(1 + w/r) maps [-w, w] onto [-1, 1], and
the nb bins split u evenly. A bin at distance |x| from the boundary is about (|x| + r) * 2 log(1 + w/r) / nb wide (2.3 %
of the distance for 1000 bins, w = 2, r = 1e-5), so the quantile is read to a fixed fraction of the correction, however
small it is. Evenly spaced bins cannot: a router whose sigmoid scores saturate (a trained one: many scores near 1)
puts the margins of most tokens near the boundary within 1e-3 of each other, one bin of 1000 over [-0.5, 0.5]; the
interpolated quantile is then off by a large share of the tokens and the bias oscillates (MaxVio 0.6-2.5 on gpu2,
~1 in benchmarks/quantile_balance.py, 0.09 with the log-spaced bins). Margins beyond +-w clamp to the edge bins,
which bounds one update's move to w. Counts are integers: the cross-rank cost is one integer all-reduce.

Where the quantile is taken (model.quantile_bias_from). "previous_step", as released: the bias of step t+1 comes from
step t's global histogram, so it lags the router by one step of training (a different batch, weights before the
optimizer step); measured on real router inputs (benchmarks/quantile_balance.py over a benchmarks/balance_dump.py
dump) that lag, not drift of the ideal bias, saturation or ties, is what leaves MaxVio near 1 at a high learning rate
(and the 0.3 step size of the smoothing doubles it). "micro_batch": each training micro-batch is routed with the bias
from one quantile pass over its own scores, started from the step's bias; the step's bias is still updated from the
global histogram as above and is what evaluation, serving and checkpoints hold, and what the next step starts from.
The micro-batch's bias is a pure function of its scores and the step's bias, so a replay and the distributed run
route exactly as the reference trainer does.

Batches no bias saw (model.quantile_eval_bias_from). Replayed on real router inputs (`quantile_balance.py --heldout`),
no bias made from training batches balances a held-out split well: the step's bias, one computed under the router
after the optimizer step, the last micro-batch's, averages over recent steps (EMA, several steps' inputs under the
new router) all leave about the same MaxVio (within ~10 % of each other), and a bias made from half of the held-out
batches under the same router does no better on the other half. What is left is the sample: a split is other
documents than a step's batch, and a step's tokens are few. "step" (as released) routes evaluation with the step's
bias, as serving always does; "batch" gives an evaluation batch its own bias (`own_bias`, as a training micro-batch
gets it), so evaluation routes as training did.
"""
from __future__ import annotations

import math

import torch

from k3ray.kernels import score_histogram


def select_experts(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of (s + b) picks the experts; the combine weights are s of the picked experts normalised over the k,
    never b. Returns (expert index [T, K] int64, weights [T, K] fp32)."""
    idx_TK = torch.topk(scores_TE + bias_E, top_k, dim=-1, sorted=False).indices
    picked = scores_TE.gather(1, idx_TK)
    return idx_TK, picked / picked.sum(-1, keepdim=True)


def warp_margins(x: torch.Tensor, window: float, resolution: float) -> torch.Tensor:
    """Margins -> the log-spaced bin coordinate u in [-1, 1] (beyond +-window: beyond +-1, clamped by the histogram)."""
    return torch.sign(x) * torch.log1p(x.abs() / resolution) / math.log1p(window / resolution)


def unwarp_margins(u: torch.Tensor, window: float, resolution: float) -> torch.Tensor:
    """The inverse of `warp_margins`."""
    return torch.sign(u) * resolution * torch.expm1(u.abs() * math.log1p(window / resolution))


def quantile_histogram(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, bins: int, window: float,
                       resolution: float) -> torch.Tensor:
    """Per-expert histogram [E, bins] int64 of the margins x = s - alpha + b in log-spaced bins over [-window, window]
    (see module docstring)."""
    biased = scores_TE + bias_E
    alpha_T = torch.topk(biased, top_k + 1, dim=-1).values[:, top_k]
    # a blown-up step (NaN scores) must still finish its collectives so the guards can roll it back
    margins = torch.nan_to_num(biased - alpha_T[:, None], nan=0.0)
    return score_histogram(warp_margins(margins, window, resolution), -1.0, 1.0, bins)


def quantile_bias(counts_Eb: torch.Tensor, bias_E: torch.Tensor, top_k: int, window: float,
                  resolution: float) -> torch.Tensor:
    """New bias from a (globally reduced) histogram: b_hat = b - quantile_{1-K/E}(x), centred to mean zero.

    The quantile is the point with K/E of the column's tokens above it, linearly interpolated inside its bin (in the
    log-spaced coordinate)."""
    num_experts, bins = counts_Eb.shape
    counts = counts_Eb.double()
    total = counts[0].sum()  # an empty histogram keeps the bias (a where, not a host sync: called per micro-batch)
    target = total * top_k / num_experts
    # above[j, i] = tokens of expert j in bins >= i (above[:, bins] = 0)
    above = torch.cat([counts.flip(1).cumsum(1).flip(1), counts.new_zeros(num_experts, 1)], dim=1)
    # the bin holding the quantile: the last i with above[i] >= target (exists: above[0] = total >= target)
    i = ((above[:, :bins] >= target).sum(1) - 1).clamp(0, bins - 1)
    in_bin = counts.gather(1, i[:, None]).squeeze(1)
    need = target - above.gather(1, (i + 1)[:, None]).squeeze(1)  # tokens to take from bin i, from its top
    frac = torch.where(in_bin > 0, need / in_bin.clamp(min=1), torch.zeros_like(need)).clamp(0, 1)
    quantile = unwarp_margins(-1 + (i.double() + 1 - frac) * (2 / bins), window, resolution)
    b_hat = bias_E.double() - quantile
    return torch.where(total > 0, b_hat - b_hat.mean(), bias_E.double()).to(bias_E.dtype)


def own_bias(scores_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, bins: int, window: float, resolution: float,
             passes: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's own bias: `passes` quantile passes over its margins, started from bias_E (a pass moves alpha, the
    (k+1)-th biased score, so one pass is only close; from a step's bias MaxVio ~2 away the third reaches the
    histogram's floor). Returns (the first pass's histogram [E, bins]: the margins under bias_E, which the step's
    update sums over the batch; the bias [E])."""
    first = None
    for _ in range(passes):
        hist = quantile_histogram(scores_TE, bias_E, top_k, bins, window, resolution)
        first = hist if first is None else first
        bias_E = quantile_bias(hist, bias_E, top_k, window, resolution)
    return first, bias_E


def sign_bias(load_E: torch.Tensor, bias_E: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek aux-loss-free baseline: b_j <- b_j + u * sign(mean_load - load_j)."""
    load = load_E.double()
    return bias_E + rate * torch.sign(load.mean() - load).to(bias_E.dtype)
