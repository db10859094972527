"""Read-only expert copies (serving), Ray-free: the copy policy balances Zipf traffic within its slots and budget, the
per-iteration split levels the ranks' load over an expert's holders, the EP exchange moves no weights for a copy, and a
placement move whose fetch fails on a rank drops that rank's new copies only."""
from __future__ import annotations

import asyncio

import pytest
import torch

from k3ray.config import ReplicationPolicy, load_config
from k3ray.serve.placement import ServePlacement
from k3ray.model.moe import ExpertShard
from k3ray.parallel.ep import EPContext, ExpertCopies, ExpertParallelExperts
from k3ray.policies import copies

E, R = 16, 4
HOME = [e // (E // R) for e in range(E)]


def zipf(shift: int, s: float = 1.2) -> torch.Tensor:
    """[E] Zipf(s) load whose hottest expert is `shift`."""
    return torch.tensor([1.0 / (((e - shift) % E) + 1) ** s for e in range(E)], dtype=torch.float64)


def valid(table: list[list[int]], slots: int) -> bool:
    return all(len(c) <= slots and len(set(c)) == len(c) and all(HOME[e] != r for e in c)
               for r, c in enumerate(table))


@pytest.mark.parametrize("shift", [0, 5, 11])
def test_copies_in_e_over_r_slots_balance_zipf_traffic(shift):
    load = zipf(shift)
    table = copies.place_copies(load, HOME, R, E // R)
    assert valid(table, E // R)
    assert copies.balancedness(load, HOME, [[]] * R) < 0.65
    assert copies.balancedness(load, HOME, table) >= 0.95
    assert torch.isclose(copies.rank_loads(load, HOME, table).sum(), load.sum())


def test_the_budget_limits_fetched_copies_and_kept_ones_are_free():
    first = copies.place_copies(zipf(0), HOME, R, 2)
    shifted = copies.place_copies(zipf(7), HOME, R, 2, current=first, moved_budget=2)
    fetched = sum(len(set(new) - set(old)) for new, old in zip(shifted, first))
    assert valid(shifted, 2) and fetched <= 2
    assert copies.balancedness(zipf(7), HOME, shifted) > copies.balancedness(zipf(7), HOME, [[]] * R)
    again = copies.place_copies(zipf(0), HOME, R, 2, current=first, moved_budget=0)
    assert again == first  # the same load: every copy kept, nothing fetched


def test_each_experts_tokens_are_split_over_its_holders_and_conserved():
    table = [[], [0], [0, 1], [0]]
    holders = copies.holders_of(HOME, table)
    assert holders[0] == [0, 1, 2, 3] and holders[1] == [0, 2] and holders[5] == [1]
    tpe = torch.randint(0, 9, (R, E))
    alloc = copies.copy_alloc(tpe, holders)
    assert torch.equal(alloc.sum(1), tpe.sum(0))
    for e in range(E):
        assert set(alloc[e].nonzero().flatten().tolist()) <= set(holders[e])
    assert torch.equal(alloc, copies.copy_alloc(tpe, holders))
    # water-filling: expert 0's 40 tokens level ranks 0, 2 and 3 below rank 1's own 16 (experts 4-7 have no copy)
    counts = torch.zeros(R, E, dtype=torch.int64)
    counts[:, 0], counts[:, 4:8] = 10, 1
    alloc = copies.copy_alloc(counts, copies.holders_of(HOME, [[], [0], [0], [0]]))
    assert alloc.sum(0).tolist() == [14, 16, 13, 13] and alloc[0].tolist() == [14, 0, 13, 13]


def test_the_exchange_moves_no_weights_for_an_expert_a_rank_holds_a_copy_of():
    model = load_config("configs/tiny.yaml").model
    ctx = EPContext(None, 1, R, torch.tensor(HOME), model)
    ctx.set_copies([[], [0, 2], [], []])
    shard = ExpertShard([4, 5, 6, 7], model.d_latent, model.expert_inner)
    layer = ExpertParallelExperts(shard, ctx)
    layer.copies = ExpertCopies([0, 2], torch.zeros(2, 1), torch.zeros(2, 1))
    alloc = torch.zeros(E, R, dtype=torch.int64)
    alloc[0, [0, 1]] = 3  # expert 0 split between its home (rank 0) and rank 1's copy
    alloc[1, 1] = 2  # expert 1 on rank 1 without a copy there: its weights must travel
    alloc[4, 1] = 5
    groups = (alloc[:, 1] > 0).nonzero().flatten()
    routes = layer._weight_routes(groups, alloc)
    assert groups.tolist() == [0, 1, 4]
    assert routes["copy_rows"] == [0, -1, -1] and routes["home_rows"] == [-1, -1, 0]
    assert routes["replica_rows"] == [-1, 0, -1] and routes["w_out_splits"] == [1, 0, 0, 0]


class FakeGrid:
    """A grid whose fetches fail on the EP ranks in `failing`."""

    def __init__(self, failing=()):
        self.ep, self.group, self.failing = R, type("Group", (), {"home": HOME, "generation": 1})(), set(failing)

    def stage_copies(self, fetch):
        return {e: "WorkerError: no room" if e in self.failing else 1000 * len(f) for e, f in enumerate(fetch) if f}


def test_a_fetch_that_fails_on_a_rank_drops_its_new_copies_and_a_rebuilt_grid_discards_the_move_and_copies():
    policy = ReplicationPolicy(enabled=True, spare_slots_per_rank=4, every_n_steps=3)
    placement = ServePlacement(E)

    async def move(grid):
        assert placement.start(grid, policy)
        while (record := placement.ready(grid)) is None:
            await asyncio.sleep(0.01)
        return record

    assert not placement.due(1, policy) and placement.due(3, policy)
    placement.observe([{1: (zipf(0) * 1000).long().tolist()}, {3: [0] * E}], policy)
    grid = FakeGrid(failing={2})
    record = asyncio.run(move(grid))
    planned = copies.place_copies(placement.load, HOME, R, 4)
    assert record["copies"][2] == [] and planned[2]  # rank 2's copies did not arrive: none
    assert [c for r, c in enumerate(record["copies"]) if r != 2] == [c for r, c in enumerate(planned) if r != 2]
    assert record["failed"] == {2: "WorkerError: no room"}
    assert record["bytes_moved"] == 1000 * sum(len(c) for c in record["copies"])
    placement.switched(record, 7)
    view = placement.view(grid)
    assert view["copies"] == record["copies"] and view["balancedness"] > view["balancedness_home_only"]
    assert view["moves"][0]["switched_at_iteration"] == 7
    rebuilt = FakeGrid()
    assert placement.view(rebuilt)["copies"] == [[]] * R  # a new grid: no copies

    async def lost_during_a_move():  # the grid is rebuilt (a worker lost) while a move's copies are on their way
        placement.observe([{1: (zipf(5) * 1000).long().tolist()}], policy)
        assert placement.start(rebuilt, policy)
        again = FakeGrid()
        assert placement.ready(again) is None and placement.move is None  # the half-done move is discarded
        assert placement.view(again)["copies"] == [[]] * R and len(placement.moves) == 1

    asyncio.run(lost_during_a_move())
