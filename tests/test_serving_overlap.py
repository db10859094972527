"""Overlapped iterations (serve.overlap), without Ray: iteration n+1 is scheduled and run before n's tokens reach the
host (its decode rows take them on the device), and outputs are those of strictly sequential iterations, greedy and
seeded, with stop strings, end-of-text, cancellations, a guard trip and a lost grid with two iterations in flight.

The executor runs each plan as it is scheduled (the workers run iterations in order) while the scheduler completes
each one an iteration later, as the engine does with two iterations in flight. float64, as test_serving_engine."""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from k3ray.config import load_config
from k3ray.faults import poison_token
from k3ray.config import ServeConfig
from k3ray.serve.scheduler import Scheduler
from k3ray.data import encode
from k3ray.model.decoder import build_stage
from k3ray.model.sampling import SamplingParams
from k3ray.parallel.reference import generate_reference
from k3ray.parallel.serving import LocalExecutor, PoolSizes
from k3ray.tokenizer import ByteTokenizer
from test_serving_engine import TEXTS


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64"}).model
    return build_stage(cfg, range(cfg.n_layers), seed=3)


class SpaceEnds(ByteTokenizer):
    """Bytes with 'n' as end-of-text: some of the tiny model's outputs then end by end-of-text."""
    eos_id = ord("n")


def engine(model, budget=24, pages=96, page_size=4, slots=8):
    serve = ServeConfig(page_size=page_size, pages_per_rank=pages, slots_per_rank=slots, token_budget=budget,
                        max_waiting=64)
    return (Scheduler(serve, model.cfg.max_seq_len, tokenizer=SpaceEnds()),
            LocalExecutor(model, PoolSizes(pages, page_size, slots)))


def drive(sched, ex, overlap: bool, submit_at=None, cancel_at=None, log=None) -> dict[int, int]:
    """Iterate until idle, with up to two iterations in flight when `overlap`. submit_at[i]: (prompt, params) submitted
    before iteration i; cancel_at[i]: indices (in submission order) cancelled before it. Returns the tokens run per
    request (cache positions written); `log` gets each plan."""
    submit_at, cancel_at, reqs, run_tokens = submit_at or {}, cancel_at or {}, [], Counter()
    ahead, i = None, 0
    while sched.has_work or ahead is not None or any(k >= i for k in submit_at):
        reqs += [sched.submit(p, sp) for p, sp in submit_at.get(i, [])]
        for k in cancel_at.get(i, []):
            sched.table.cancel(reqs[k].id)
        if ahead is not None and not overlap:
            sched.complete(*ahead)
            ahead = None
        plans = sched.schedule()
        if ahead is not None:  # nothing of the plan in flight is reused by the next one
            for rank, batch in plans.ranks.items():
                assert {a.slot for a in batch.plan.admit}.isdisjoint(ahead[0].ranks[rank].plan.slots)
        for batch in plans.ranks.values():
            run_tokens.update({r.id: n for r, n, e in zip(batch.requests, batch.plan.counts, batch.epochs)
                               if e == r.epoch})
        if log is not None:
            log.append(plans)
        outputs = ex.run(plans.plans())
        if ahead is not None:
            sched.complete(*ahead)
        ahead, i = (plans, outputs), i + 1
        if not sched.has_work and ahead is not None:
            sched.complete(*ahead)
            ahead = None
    return run_tokens


def workload():
    params = [SamplingParams(max_tokens=3 + (7 * i) % 22, temperature=0.8 if i % 3 == 1 else 0.0, top_p=0.9,
                             seed=50 + i, stop=("&", "Q") if i % 4 == 0 else ()) for i in range(len(TEXTS))]
    arrivals = {}
    for i, (t, sp) in enumerate(zip(TEXTS, params)):
        arrivals.setdefault(0 if i < 10 else 2 * i, []).append((encode(t), sp))
    return arrivals


def outcomes(sched):
    return [(r.out, r.finish) for r in sorted(sched.table.requests.values(), key=lambda r: r.id)]


def test_overlapped_iterations_equal_sequential_ones(model):
    """17 requests, mixed max_tokens, greedy and seeded, stop strings and end-of-text, arriving over time; three
    cancelled mid-stream. Every output and finish reason equals the sequential run's (cancelled ones: the same
    prefix); rows really took their token from the device; a request that ends by its length never runs a token
    past it, one ended by a stop runs at most the one dropped token; pages and slots all come back."""
    cancels = {5: [2], 10: [6], 36: [15]}
    seq, ex = engine(model)
    drive(seq, ex, overlap=False, submit_at=workload())
    want = outcomes(seq)
    seq_cancelled, ex = engine(model)
    drive(seq_cancelled, ex, overlap=False, submit_at=workload(), cancel_at=cancels)
    sched, ex = engine(model)
    log = []
    ran = drive(sched, ex, overlap=True, submit_at=workload(), log=log)
    assert outcomes(sched) == want
    finishes = Counter(f for _, f in want)
    eos = [out for out, f in want if f == "stop" and out[-1] == SpaceEnds.eos_id]
    assert len(want) >= 16 and finishes["length"] and finishes["stop"] > len(eos) > 0  # EOS and stop strings
    assert sum(sum(b.plan.from_device) for plans in log for b in plans.ranks.values()) > 50
    for r in sched.table.requests.values():
        extra = ran[r.id] - (r.length - 1)
        assert extra == 0 if r.finish == "length" else extra in (0, 1), f"request {r.id} ({r.finish})"
    assert sched.usage()["pages_used"] == sched.usage()["slots_used"] == 0

    sched, ex = engine(model)
    drive(sched, ex, overlap=True, submit_at=workload(), cancel_at=cancels)
    got, cancelled = outcomes(sched), {2, 6, 15}
    assert [g for i, g in enumerate(got) if i not in cancelled] == \
        [w for i, w in enumerate(outcomes(seq_cancelled)) if i not in cancelled] == \
        [w for i, w in enumerate(want) if i not in cancelled]
    for i in cancelled:
        assert got[i][1] == "cancelled" and want[i][0][:len(got[i][0])] == got[i][0]
    assert sched.usage()["pages_used"] == sched.usage()["slots_used"] == 0


def test_a_guard_trip_fails_one_request_alone_with_iterations_overlapped(model):
    """The poisoned request fails alone; the others, which reuse its slot and pages once the iteration in flight
    that still held them completed, end as the reference."""
    poison = ord("~")
    texts = [t for t in TEXTS if "~" not in t][:8]
    params = SamplingParams(max_tokens=10)
    want = [generate_reference(model, encode(t), params)[0] for t in texts]
    sched, ex = engine(model, budget=16, pages=24, slots=2)
    sched.tokenizer = ByteTokenizer()
    handle = poison_token(model, poison)
    try:
        bad_prompt = encode("x = 1\n" * 4 + "~ = 2\n")
        arrivals = [(encode(t), params) for t in texts[:2]] + [(bad_prompt, params)]
        drive(sched, ex, overlap=True, submit_at={0: arrivals + [(encode(t), params) for t in texts[2:]]})
    finally:
        handle.remove()
    reqs = sorted(sched.table.requests.values(), key=lambda r: r.id)
    bad = reqs.pop(2)
    assert bad.finish == "error" and bad.trip.detail == "not finite" and bad.out == []
    assert [r.out for r in reqs] == want
    assert sched.usage()["pages_used"] == 0


def test_a_grid_lost_with_two_iterations_in_flight_discards_both(model):
    """The caches are lost while n and n+1 are in flight: neither is completed, every unfinished request is requeued
    with its confirmed output only, and ends as the reference (nothing lost, nothing repeated)."""
    params = [SamplingParams(max_tokens=12, seed=40 + i, temperature=0.8 if i % 2 else 0.0) for i in range(9)]
    prompts = [encode(t) for t in TEXTS[:9]]
    want = [generate_reference(model, p, sp)[0] for p, sp in zip(prompts, params)]
    sched, ex = engine(model, slots=6)
    sched.tokenizer = ByteTokenizer()
    reqs = [sched.submit(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(5):
        sched.step(ex)
    before = {r.id: list(r.out) for r in reqs}
    n = sched.schedule()
    ex.run(n.plans())
    n1 = sched.schedule()  # n+1 before n's tokens are back
    assert any(n1.ranks[0].plan.from_device) and any(r.unconfirmed == 2 for r in sched.table.running.values())
    requeued = sched.reset(dp=1)
    assert len(requeued) >= 4 and all(r.planned == r.unconfirmed == r.in_flight == 0 for r in requeued)
    assert {r.id: r.out for r in reqs} == before and sched.usage()["pages_used"] == 0
    _, fresh = engine(model, slots=6)
    drive(sched, fresh, overlap=True)
    assert [r.out for r in reqs] == want


def test_the_engine_recovers_a_lost_worker_with_two_iterations_in_flight(model):
    """The engine loop with serve.overlap on a fake grid that loses its worker at the 5th iteration (the 4th still
    uncompleted): every request ends as the reference."""
    from fakes.serving import SERVE, FakeGrid, collect, reference, sizes

    from k3ray.serve.engine import Engine

    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64", "parallel.pp": 1, "parallel.ep": 1,
                                            **{f"serve.{k}": v for k, v in SERVE.items()}, "serve.overlap": True})
    grid = FakeGrid(model, sizes(cfg), lose_at={5})

    async def main():
        eng = Engine(cfg, 0, grid)
        return eng, await asyncio.gather(*(collect(eng, i) for i in range(4)))

    eng, streams = asyncio.run(main())
    assert eng.cfg.serve.overlap and grid.calls == ["recover"] and eng.incidents[0]["kind"] == "worker_lost"
    for i, items in enumerate(streams):
        assert [t for item in items for t in item.get("tokens", [])] == reference(model, i)


@pytest.mark.parametrize("bucket", [3, 4])
def test_the_decode_graph_body_takes_the_tokens_in_flight_on_the_device(model, bucket):
    """What a decode CUDA graph holds (`StageServer.decode_step`, run eagerly here on CPU): rows flagged from_device
    read the slot's last sampled token, and give the tokens (and, unpadded, the max-abs) of the eager step fed those
    tokens from the host."""
    from k3ray.parallel.serving import RankPlan, pack_decode
    from k3ray.model.cache import SeqAdmit

    sizes = PoolSizes(pages=24, page_size=4, slots=4)
    prompts = [encode(t) for t in TEXTS[:3]]
    prefill = RankPlan(slots=[0, 1, 2], starts=[0, 0, 0], counts=[len(p) for p in prompts],
                       tokens=[t for p in prompts for t in p], counters=[0, 0, 0],
                       admit=[SeqAdmit(i, list(range(8 * i, 8 * i + 8)), 0.7 * (i == 1), 1.0, 9 + i) for i in range(3)])
    eager, graph_body = LocalExecutor(model, sizes), LocalExecutor(model, sizes)
    first = eager.server.step(prefill).tokens
    assert graph_body.server.step(prefill).tokens == first
    decode = RankPlan(slots=[0, 1, 2], starts=[len(p) for p in prompts], counts=[1, 1, 1], tokens=first,
                      counters=[1, 1, 1])
    want = eager.server.step(decode)
    decode.tokens, decode.from_device = [0, first[1], 0], [True, False, True]
    server = graph_body.server
    packed = pack_decode(decode, bucket, server.pools.scratch_slot, True)
    with torch.no_grad():
        _, tokens, maxabs = server.decode_step(packed, None, server.pools.context_bucket(max(decode.starts) + 1),
                                               greedy=False)
    assert tokens[:3].tolist() == want.tokens
    if bucket == 3:  # with a padding row the last real row's max-abs differs a little, from_device rows or none
        assert torch.allclose(maxabs[:3], torch.tensor(want.maxabs, dtype=maxabs.dtype))
    assert server.pools.last_token[:3].tolist() == want.tokens


def test_overlapped_iterations_with_stepwise_prefill_equal_sequential_ones(model):
    """Short prompts fed as decode rows (stepwise prefill) while two iterations are in flight: a prompt's last row
    samples, and the next iteration's row for it takes that token on the device. Outputs as without either."""
    seq, ex = engine(model)
    drive(seq, ex, overlap=False, submit_at=workload())
    sched, ex = engine(model)
    sched.serve = sched.serve.model_copy(update={"stepwise_prefill_max": 16})
    log = []
    drive(sched, ex, overlap=True, submit_at=workload(), log=log)
    assert outcomes(sched) == outcomes(seq)
    rows = [(r.length, c) for plans in log for b in plans.ranks.values() for r, c in zip(b.requests, b.plan.counts)]
    assert sum(length <= 16 for length, _ in rows) > 30 and all(c == 1 for length, c in rows if length <= 16)
    assert sched.usage()["pages_used"] == sched.usage()["slots_used"] == 0


def test_stepwise_prefill_defaults_on_where_decode_iterations_are_graphs():
    def stepwise_prefill_max(cfg):
        return cfg.serve.resolved(cfg.parallel.device, cfg.parallel.ep).stepwise_prefill_max

    assert stepwise_prefill_max(load_config("configs/tiny.yaml", {})) == 0  # CPU: every iteration eager
    gpu = {"parallel.device": "cuda", "parallel.ep": 1}
    assert stepwise_prefill_max(load_config("configs/tiny.yaml", gpu)) == 64
    assert stepwise_prefill_max(load_config("configs/tiny.yaml", {**gpu, "parallel.ep": 2})) == 0
    assert stepwise_prefill_max(load_config("configs/tiny.yaml", {**gpu, "serve.stepwise_prefill_max": 8})) == 8
    with pytest.raises(Exception, match="stepwise_prefill_max"):
        load_config("configs/tiny.yaml", {"serve.stepwise_prefill_max": -1})


def test_overlap_defaults_on_for_one_stage_and_is_refused_with_more():
    from k3ray.serve.engine import overlap

    assert overlap(load_config("configs/tiny.yaml", {"parallel.pp": 1}))
    assert not overlap(load_config("configs/tiny.yaml", {"parallel.pp": 2}))
    assert not overlap(load_config("configs/tiny.yaml", {"parallel.pp": 1, "serve.overlap": False}))
    with pytest.raises(Exception, match=r"serve.overlap=true needs parallel.pp=1 \(got 2\)"):
        load_config("configs/tiny.yaml", {"parallel.pp": 2, "serve.overlap": True})


def test_whoever_waits_between_iterations_gets_in_with_nothing_in_flight(model):
    """A resize takes `between_iterations`: an overlapped stretch drains and lets it in with no iteration in flight,
    and serving goes on after it, every request ending as the reference."""
    from fakes.serving import SERVE, FakeGrid, collect, reference, sizes

    from k3ray.serve.engine import Engine

    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64", "parallel.pp": 1, "parallel.ep": 1,
                                            **{f"serve.{k}": v for k, v in SERVE.items()}})
    grid = FakeGrid(model, sizes(cfg))
    seen = []

    async def between(eng):
        while eng.counts.iterations < 4:
            await asyncio.sleep(0.001)
        for _ in range(3):
            async with eng.between_iterations:
                seen.append(sum(r.in_flight for r in eng.sched.table.running.values()))
            await asyncio.sleep(0.005)

    async def main():
        eng = Engine(cfg, 0, grid)
        streams = asyncio.gather(*(collect(eng, i) for i in range(3)))
        await between(eng)
        return await streams

    streams = asyncio.run(main())
    assert seen == [0, 0, 0]
    for i, items in enumerate(streams):
        assert [t for item in items for t in item.get("tokens", [])] == reference(model, i)


def test_serving_sizes_default_by_device_and_gpu_pools_fit_the_free_memory():
    """Unset sizes take the device's defaults (a GPU: 8,192 tokens per iteration and 256 slots, as vLLM / SGLang on
    an H200; pages measured at start); a set value stands. The pages that fit grow with the free memory, up to every
    slot's whole context."""
    from k3ray.config import ServeConfig
    from k3ray.model.cache import pages_that_fit

    cpu, gpu = ServeConfig().resolved("cpu"), ServeConfig().resolved("cuda")
    assert (cpu.token_budget, cpu.slots_per_rank, cpu.pages_per_rank) == (128, 16, 256)
    assert (gpu.token_budget, gpu.slots_per_rank, gpu.pages_per_rank) == (8192, 256, None)
    assert ServeConfig(token_budget=512).resolved("cuda").token_budget == 512
    cfg = load_config("configs/tiny.yaml", {}).model
    layers = range(cfg.n_layers)
    few, more, all_ = (pages_that_fit(cfg, layers, 16, 8, b) for b in (2**17, 2**18, 2**40))
    assert 0 < few < more < all_ == 8 * (-(-cfg.max_seq_len // 16))


def test_a_grid_started_after_traffic_captures_the_graphs_of_the_shapes_it_used_most_used_first(model):
    """Decode shapes are counted per iteration and rank (powers of two: rows, longest sequence with its new token,
    greedy; none for a prompt chunk), and map to the graphs that replay them on a grid's pools: most used first,
    each once, none for batches past the pools' slots (those iterations run eagerly)."""
    from k3ray.parallel.serving import RankPlan, decode_shape, graph_keys
    from k3ray.serve.decode_traffic import DecodeTraffic

    assert decode_shape(RankPlan()) is None
    assert decode_shape(RankPlan(slots=[0, 1], starts=[3, 9], counts=[1, 4])) is None  # a prompt chunk
    assert decode_shape(RankPlan(slots=[0, 1, 2], starts=[3, 15, 2], counts=[1, 1, 1], greedy=True)) == (4, 16, True)
    assert decode_shape(RankPlan(slots=[5], starts=[16], counts=[1])) == (1, 32, False)
    traffic = DecodeTraffic()
    sampled = RankPlan(slots=[5], starts=[16], counts=[1])
    greedy = RankPlan(slots=[0, 1, 2], starts=[3, 15, 2], counts=[1, 1, 1], greedy=True)
    for plans in [{0: greedy, 1: sampled}, {0: sampled}, {0: RankPlan(slots=[0], starts=[0], counts=[7])},
                  {0: RankPlan(slots=list(range(9)), starts=[1] * 9, counts=[1] * 9, greedy=True)}]:
        traffic.record(plans)
    assert traffic.ranked() == [(1, 32, False), (16, 2, True), (4, 16, True)]  # equals: the newest first
    recent = DecodeTraffic(recent=3)
    for plans in [{0: greedy}] * 5 + [{0: sampled}] * 2:
        recent.record(plans)
    assert recent.ranked() == [(1, 32, False), (4, 16, True)]  # only the latest 3 iterations count
    pools = LocalExecutor(model, PoolSizes(pages=64, page_size=4, slots=8)).server.pools
    # rows 1 -> bucket 1, longest 32 -> 8 pages of 4; rows 4 -> bucket 4, 16 -> 4 pages; 16 rows > 8 slots: none
    assert graph_keys(traffic.ranked(), pools) == [(1, 32, False), (4, 16, True)]
    assert graph_keys([(1, 30, False), (1, 32, False)], pools) == [(1, 32, False)]  # one graph, listed once
