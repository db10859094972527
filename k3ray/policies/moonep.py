"""MoonEP planning: per-micro-batch balance of expert work across the R EP ranks, exact or priced.

Input  tokens_per_expert  [R, E]  token slots source rank r routes to expert e (all-gathered, same on every rank).
Output MoonEPPlan.alloc   [E, R]  token slots of expert e computed on rank d.

Guarantees of `plan` (tests/test_policies.py checks each one):
  * balance:      rank d computes target[d] = S // R + (d < S % R) slots, S = total slots (the lower ranks take the
                  remainder). With S = R*s*K every rank computes exactly s*K.
  * conservation: alloc.sum(1) == tokens_per_expert.sum(0).
  * slot limit:   rank d computes at most `slots_per_rank` non-home experts; the default, the largest number of
                  experts any rank is home to (= ceil(E/R) for even homes), always suffices (see below).
  * determinism:  a function of the counts and homes only; ties go to the lower expert / rank index.

Algorithm (one sink at a time, one donor per sink). Each rank starts with its home experts' tokens. Repeatedly the
most underloaded rank (the sink, deficit D) takes exactly D slots from the most overloaded rank (the donor): the
donor's largest remaining home experts first, the last one split. A donor whose excess is smaller than D goes below
its target and becomes a later sink (a cascade) rather than the sink taking pieces from several donors. Every sink
is filled once and exactly, from one donor, so it holds at most |home(donor)| foreign experts: the slot limit is
ceil(E/R) for even homes whatever the routing. Donors only ever give home experts, so every non-home piece is a
copy of the home expert's weights (one replica). Each step finishes one rank for good: at most R steps.
Replicas: the rank-to-rank flow of any plan links all n ranks that are off target (unless a proper subset of their
imbalances sums to zero), so any plan needs >= n - 1 replicas; on Zipf traces this one meets that bound
(benchmarks/RESULTS.md).

Priced plans (`cost`, k3ray.policies.expert_cost): exact balance is not always worth its weight copies. A ceiling
plan brings every rank above the ceiling down to it (donors give their largest home experts, as above) and fills the
lightest ranks up to it, lightest first, so few sinks take the excess; ceiling = the exact target is exact balance,
ceiling = the busiest rank's load is no replicas. Lowering the ceiling takes rows off the busiest rank and adds
copies: the modelled time is row_s * ceiling plus a traffic term that steps up as the ceiling falls, so the best
ceiling of each traffic level is its lowest. The plan prices no replicas, exact balance and a grid of ceilings
(dense near exact balance), bisects down to the lowest ceiling of the two best grid points' levels, and keeps the
cheapest (ties: fewer rows moved). So a plan is never modelled slower than no replicas or exact balance, and when
even the cheapest copy costs more than all the rows exact balance would take off the busiest rank, there are no
replicas. Slot limit and conservation hold as above (every sink is still filled once, from one donor); balance
becomes: rank d computes target[d], and no rank more than the busiest rank without MoonEP.

The loop runs in Python over per-rank lists (O(R log R + pieces)), the rest in numpy; the counts are moved to the
host once (a sync on CUDA: the all-gathered counts are [R, E] ints, 229 KB at R=64) and the plan is returned on the
input's device.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np
import torch

from k3ray.policies.expert_cost import ExpertCost


def default_home(num_experts: int, num_ranks: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Contiguous home blocks, [E] int64: home[e] = e*R // E (blocks of E/R; sizes differ by at most 1 if uneven)."""
    return torch.arange(num_experts, device=device, dtype=torch.int64) * num_ranks // num_experts


@dataclass(frozen=True)
class MoonEPPlan:
    """A MoonEP plan. Shapes use the package notation (E experts, R ranks).

    alloc         [E, R] int64  token slots of expert e computed on rank d (home column included)
    home          [E]    int64  home rank of each expert
    replica_mask  [R, E] bool   rank d computes expert e and is not its home (needs a copy of e's weights)
    target        [R]    int64  slots each rank computes (= rank_loads(alloc))
    """

    alloc: torch.Tensor
    home: torch.Tensor
    replica_mask: torch.Tensor
    target: torch.Tensor

    @property
    def num_replicas(self) -> int:
        """Weight copies this plan needs (non-home (expert, rank) pairs)."""
        return int(self.replica_mask.sum())

    @property
    def replicas_per_rank(self) -> torch.Tensor:
        """[R] int64: non-home experts each rank computes."""
        return self.replica_mask.sum(1)

    def replicas(self, rank: int) -> torch.Tensor:
        """Non-home experts rank `rank` computes, ascending expert index ([n] int64)."""
        return self.replica_mask[rank].nonzero().flatten()

    def copies(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(src, dst) [n] int64: home rank and computing rank of every replica (the weight copies this plan moves)."""
        dst, expert = self.replica_mask.nonzero(as_tuple=True)
        return self.home[expert], dst

    def modelled_s(self, cost: ExpertCost) -> float:
        """Modelled seconds of the layer under this plan (k3ray.policies.expert_cost)."""
        src, dst = (t.cpu() for t in self.copies())
        return cost.layer_s(int(self.target.max()), src, dst, self.target.numel())

    def send(self, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """send [R_src, E, R_dst] (see `send_matrix`)."""
        return send_matrix(tokens_per_expert, self.alloc)

    def send_from(self, tokens_per_expert: torch.Tensor, src: int) -> torch.Tensor:
        """send[src] as [E, R_dst]: what one source rank sends; O(E*R) memory instead of O(R*E*R)."""
        return send_matrix(tokens_per_expert, self.alloc, src=src)


def plan(tokens_per_expert: torch.Tensor, slots_per_rank: int | None = None,
         home: torch.Tensor | None = None, cost: ExpertCost | None = None) -> MoonEPPlan:
    """Plan one layer and micro-batch: exact balance, or with `cost` the cheapest priced plan (module doc).

    tokens_per_expert [R, E] integer counts; slots_per_rank caps the non-home experts a rank computes (default: the
    most experts any rank is home to, which always suffices); home [E] int64 home rank per expert (default
    `default_home`; arbitrary homes are allowed, e.g. after a worker loss). Raises ValueError if a smaller
    `slots_per_rank` cannot be met by this algorithm (priced plans skip the candidates it cannot meet).
    """
    num_ranks, num_experts = tokens_per_expert.shape
    device = tokens_per_expert.device
    # Host-side work runs in numpy: single-threaded, so a busy neighbour core cannot stall an OpenMP barrier.
    home_np = (default_home(num_experts, num_ranks) if home is None else home.to("cpu", torch.int64)).numpy()
    totals = tokens_per_expert.detach().to("cpu", torch.int64).numpy().sum(0)           # [E]
    if slots_per_rank is None:
        home_count = np.bincount(home_np, minlength=num_ranks)
        slots_per_rank = max(math.ceil(num_experts / num_ranks), int(home_count.max()))

    home_load = np.zeros(num_ranks, dtype=np.int64)
    np.add.at(home_load, home_np, totals)
    base, extra = divmod(int(totals.sum()), num_ranks)
    target = np.full(num_ranks, base, dtype=np.int64)
    target[:extra] += 1

    # Home experts of every rank, largest first, ties by expert index (lexsort: no stability question).
    order = np.lexsort((np.arange(num_experts), -totals, home_np)).tolist()
    totals_l = totals.tolist()
    items: list[list[list[int]]] = [[] for _ in range(num_ranks)]              # per rank: [[load, expert], ...]
    for e, r in zip(order, home_np[order].tolist()):
        items[r].append([totals_l[e], e])

    if cost is None:
        moves = _fill(home_load.tolist(), target.tolist(), items, slots_per_rank)
    else:
        target, moves = _cheapest(home_load, target, items, slots_per_rank, home_np, cost)
    alloc = np.zeros((num_experts, num_ranks), dtype=np.int64)
    alloc[np.arange(num_experts), home_np] = totals
    replica_mask = np.zeros((num_ranks, num_experts), dtype=bool)
    if moves:   # every move goes from the expert's home to another rank, at most once per (expert, rank)
        e_idx, d_idx, amount = (np.array(c, dtype=np.int64) for c in zip(*moves))
        alloc[e_idx, d_idx] = amount
        np.subtract.at(alloc, (e_idx, home_np[e_idx]), amount)
        replica_mask[d_idx, e_idx] = True
    return MoonEPPlan(alloc=torch.from_numpy(alloc).to(device), home=torch.from_numpy(home_np).to(device),
                      replica_mask=torch.from_numpy(replica_mask).to(device),
                      target=torch.from_numpy(target).to(device))


def _cheapest(load: np.ndarray, exact: np.ndarray, items: list[list[list[int]]], slots: int, home: np.ndarray,
              cost: ExpertCost, grid_points: int = 12, refine: int = 2) -> tuple[np.ndarray, list]:
    """(target [R], moves [(expert, dst rank, slots)]) of the cheapest plan found (module doc); ties: fewer rows
    moved."""
    num_ranks = len(load)
    floor, top = int(exact.max()), int(load.max())
    copy_s = cost.cheapest_copy_s(num_ranks)
    if cost.row_s * (top - floor) <= copy_s:
        return load.copy(), []

    def price(target: np.ndarray):
        """(seconds, rows moved, target, moves), or None when the slot limit cannot be met."""
        gives = (load > target).tolist()         # only donors give: copy just their item lists
        try:
            moves = _fill(load.tolist(), target.tolist(),
                          [[list(it) for it in r] if g else r for r, g in zip(items, gives)], slots)
        except ValueError:
            return None
        seconds = cost.layer_s(target.max(), home[[e for e, _, _ in moves]], [d for _, d, _ in moves], num_ranks)
        return seconds, sum(n for _, _, n in moves), target, moves

    found = [(cost.layer_s(top, [], [], num_ranks), 0, load.copy(), []), price(exact)]
    at: dict[int, tuple | None] = {}

    def traffic(ceiling: int) -> float:
        if ceiling not in at:
            at[ceiling] = price(_ceiling_target(load, ceiling))
            found.append(at[ceiling])
        plan = at[ceiling]
        return math.inf if plan is None else plan[0] - cost.row_s * ceiling

    # The modelled time is rows * row_s (falling with the ceiling) plus traffic, a step function rising as the ceiling
    # falls; the best ceiling of each traffic level is its lowest. Price a grid of ceilings, dense near exact balance
    # (gaps of (top - floor) / 2^k), then bisect down to the lowest ceiling of the best grid points' levels.
    # Ceilings closer than 1/16 of a copy's rows count as one.
    step = max(1, int(copy_s / cost.row_s / 16))
    grid = sorted({floor + (top - floor) // 2**k for k in range(grid_points)} - {floor, top})
    grid = [c for c in grid if c - floor >= step]
    for ceiling in grid:
        traffic(ceiling)
    ranked = sorted((c for c in grid if at[c] is not None), key=lambda c: (cost.row_s * c + traffic(c), -c))
    for ceiling in ranked[:refine]:
        below = [c for c in grid if c < ceiling]
        lo, keeps, level = (below[-1] if below else floor), ceiling, traffic(ceiling)
        while keeps - lo > step:
            mid = (lo + keeps) // 2
            lo, keeps = (lo, mid) if traffic(mid) <= level else (mid, keeps)
    return min((f for f in found if f is not None), key=lambda f: f[:2])[2:]


def _ceiling_target(load: np.ndarray, ceiling: int) -> np.ndarray:
    """[R] ranks above `ceiling` down to it; their excess fills the lightest ranks up to it (ties: lower rank)."""
    target = np.minimum(load, ceiling)
    excess = int(load.sum() - target.sum())
    order = np.lexsort((np.arange(len(load)), load))
    room = ceiling - target[order]
    target[order] += np.clip(excess - (np.cumsum(room) - room), 0, room)
    return target


def _fill(load: list[int], target: list[int], items: list[list[list[int]]],
          slots: int) -> list[tuple[int, int, int]]:
    """The sink/donor loop over Python lists; returns moves (expert, dst rank, slots) out of the expert's home."""
    sinks = [(load[r] - target[r], r) for r in range(len(load)) if load[r] < target[r]]  # (-deficit, rank)
    donors = [(target[r] - load[r], r) for r in range(len(load)) if load[r] > target[r]]  # (-excess, rank)
    heapq.heapify(sinks)
    heapq.heapify(donors)
    moves: list[tuple[int, int, int]] = []
    while sinks:
        neg_deficit, sink = heapq.heappop(sinks)
        need = -neg_deficit
        while True:   # drop stale donor entries (a donor's excess changes after every gift)
            neg_excess, donor = donors[0]
            if load[donor] - target[donor] == -neg_excess:
                break
            heapq.heappop(donors)
        if _pieces_needed(items[donor], need) > slots:
            donor = _fewest_pieces_donor(load, target, items, need, slots)
        moves.extend(_give(items[donor], need, sink))
        load[donor] -= need
        load[sink] += need
        excess = load[donor] - target[donor]
        if excess > 0:
            heapq.heappush(donors, (-excess, donor))
        elif excess < 0:
            heapq.heappush(sinks, (excess, donor))
    return moves


def _pieces_needed(donor_items: list[list[int]], need: int) -> int:
    acc = 0
    for n, (size, _) in enumerate(donor_items, 1):
        acc += size
        if acc >= need:
            return n
    return len(donor_items) + 1   # unreachable for a donor (its load >= any sink's deficit)


def _fewest_pieces_donor(load, target, items, need: int, slots: int) -> int:
    best = min((_pieces_needed(items[r], need), r) for r in range(len(load)) if load[r] > target[r])
    if best[0] > slots:
        raise ValueError(f"MoonEP: slots_per_rank={slots} is too small for this load (a rank needs {best[0]} "
                         f"foreign experts); use at least the most experts any rank is home to")
    return best[1]


def _give(donor_items: list[list[int]], need: int, sink: int) -> list[tuple[int, int, int]]:
    """Take `need` slots from the donor's largest home experts (list kept sorted: load desc, expert asc)."""
    out = []
    while need:
        item = donor_items[0]
        take = min(item[0], need)
        out.append((item[1], sink, take))
        need -= take
        item[0] -= take
        if item[0] == 0:
            donor_items.pop(0)
        else:   # the split expert moves back to its place in the sorted list
            donor_items.pop(0)
            pos = 0
            while pos < len(donor_items) and (donor_items[pos][0], -donor_items[pos][1]) > (item[0], -item[1]):
                pos += 1
            donor_items.insert(pos, item)
    return out


def send_matrix(tokens_per_expert: torch.Tensor, alloc: torch.Tensor, src: int | None = None) -> torch.Tensor:
    """send [R_src, E, R_dst]: slots of source rank r's expert-e tokens that go to rank d.

    Rule: for each expert, the source ranks' tokens are concatenated in rank order and cut into consecutive pieces
    for the destinations in ascending rank order, of sizes alloc[e, :] (overlap of two cumsum intervals). So
    send.sum(2) == tokens_per_expert and send.sum(0) == alloc. With `src`, returns only send[src] ([E, R_dst]).
    Memory O(R*E*R) for the full matrix (470 MB at R=256, E=896): use `src` on a rank.
    """
    counts = tokens_per_expert.to(torch.int64)
    zero = counts.new_zeros(1, counts.shape[1])
    src_edges = torch.cat([zero, counts.cumsum(0)])                                 # [R+1, E]
    dst_edges = torch.cat([zero, alloc.to(torch.int64).T.cumsum(0)])                # [R+1, E]
    rows = slice(None) if src is None else slice(src, src + 1)
    lo = torch.maximum(src_edges[:-1][rows, :, None], dst_edges[:-1].T[None])       # [r, E, R_dst]
    hi = torch.minimum(src_edges[1:][rows, :, None], dst_edges[1:].T[None])
    send = (hi - lo).clamp_(min=0)
    return send if src is None else send[0]


def received_by(tokens_per_expert: torch.Tensor, alloc: torch.Tensor, dst: int) -> torch.Tensor:
    """send[:, :, dst] as [R_src, E]: what one destination rank receives from every source; O(R*E) memory."""
    counts = tokens_per_expert.to(torch.int64)
    zero = counts.new_zeros(1, counts.shape[1])
    src_edges = torch.cat([zero, counts.cumsum(0)])                                 # [R+1, E]
    dst_edges = torch.cat([zero, alloc.to(torch.int64).T.cumsum(0)])                # [R+1, E]
    lo = torch.maximum(src_edges[:-1], dst_edges[dst][None])                        # [R_src, E]
    hi = torch.minimum(src_edges[1:], dst_edges[dst + 1][None])
    return (hi - lo).clamp_(min=0)


def rank_loads(alloc: torch.Tensor) -> torch.Tensor:
    """[R] token slots each rank computes under alloc [E, R]."""
    return alloc.sum(0)


def home_loads(tokens_per_expert: torch.Tensor, home: torch.Tensor | None = None) -> torch.Tensor:
    """[R] slots each rank computes without MoonEP (every expert on its home rank)."""
    num_ranks, num_experts = tokens_per_expert.shape
    if home is None:
        home = default_home(num_experts, num_ranks, tokens_per_expert.device)
    out = torch.zeros(num_ranks, dtype=torch.int64, device=tokens_per_expert.device)
    return out.index_add_(0, home.to(out.device), tokens_per_expert.to(torch.int64).sum(0))


def imbalance(loads: torch.Tensor) -> float:
    """max rank load / mean rank load (1.0 = perfect); loads [R]."""
    mean = loads.double().mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def maxvio(tokens_per_expert) -> float:
    """MaxVio per expert: max_e(T_e / T_mean) - 1, T_e the expert's global count; accepts [R, E] or [E] (tensors or
    nested lists). The one definition: step reports, metrics and the simulator use it."""
    per_expert = torch.as_tensor(tokens_per_expert).double()
    if per_expert.dim() == 2:
        per_expert = per_expert.sum(0)
    mean = per_expert.mean()
    return float(per_expert.max() / mean - 1) if mean > 0 else 0.0
