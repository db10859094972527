"""The prefix cache (k3ray.serve.prefix_cache): block keys chain their parents and a lookup checks the tokens; a hit is
the deepest boundary with both the pages and a KDA state checkpoint; blocks are held while requests use them and
evicted least recently used, page and checkpoint together, within the budget. Through the engine (float64, greedy
and seeded, every released feature on: KDA's short convolution too): a shared system prompt and multi-turn chats
give the reference's tokens with the cache on, starting past the cached prefixes; so do preemption and a lost grid
(which starts cold)."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import RELEASED
from k3ray.config import ServeConfig, load_config
from k3ray.data import encode
from k3ray.model.decoder import build_stage
from k3ray.model.sampling import SamplingParams
from k3ray.parallel.reference import generate_reference
from k3ray.parallel.serving import LocalExecutor, PoolSizes
from k3ray.serve.cache_allocator import RankPool
from k3ray.serve.prefix_cache import ROOT, PrefixCache, PrefixSizes, block_key, prefix_sizes
from k3ray.serve.request_prefixes import row_saves
from k3ray.serve.scheduler import Scheduler

P = 4  # page size of these tests
SYSTEM = "You are terse. Answer in one line.\n"  # 35 bytes: boundaries at 16 and 32


def keys_of(ids: list[int]) -> list[bytes]:
    keys = []
    for i in range(len(ids) // P):
        keys.append(block_key(keys[-1] if keys else ROOT, ids[i * P:(i + 1) * P]))
    return keys


def cache(checkpoints=4, pages=32) -> PrefixCache:
    return PrefixCache(PrefixSizes(every=8, checkpoints=checkpoints, page_bytes=10, checkpoint_bytes=100), P,
                       list(range(pages)))


def offer(c: PrefixCache, ids: list[int], pages: list[int], boundaries=()) -> None:
    keys = keys_of(ids)
    for i, (key, page) in enumerate(zip(keys, pages)):
        c.free_pages.remove(page)
        c.offer_page(key, keys[i - 1] if i else ROOT, ids[i * P:(i + 1) * P], page)
    for b in boundaries:
        c.checkpoints.offer(keys[b // P - 1], c.checkpoints.new())


def test_a_hit_is_the_deepest_boundary_with_pages_and_a_checkpoint_and_leaves_a_token_to_compute():
    c = cache()
    ids = list(range(24))
    offer(c, ids, [0, 1, 2, 3, 4, 5], boundaries=(8, 16, 24))
    assert c.match(keys_of(ids), ids).tokens == 16  # 24 would leave nothing to compute
    longer = ids + [99, 98]
    hit = c.match(keys_of(longer), longer)
    assert (hit.tokens, hit.pages) == (24, (0, 1, 2, 3, 4, 5))
    other = ids[:12] + [7] * 12  # diverges inside block 3: the deepest shared boundary is 8
    assert (c.match(keys_of(other), other).tokens, c.match(keys_of(other), other).shared) == (8, 12)
    assert c.match(keys_of([5] + ids[1:]), [5] + ids[1:]).tokens == 0


def test_a_row_saves_at_its_end_and_inside_only_where_a_prompt_ends_or_parts_from_a_cached_one():
    """Each checkpoint costs every KDA layer's state in memory: a prefill saves at most two inside its row."""
    assert row_saves(63, 1, 64, True, 0) == [64]  # a decode row reaching a boundary
    assert row_saves(62, 1, 64, True, 0) == []
    assert row_saves(0, 300, 64, True, 0) == [256]  # a whole prompt: its deepest boundary (its next turn's)
    assert row_saves(0, 200, 64, False, 0) == []  # a chunk before the prompt's last
    assert row_saves(0, 192, 64, False, 0) == [192]  # ... ending on a boundary (saved after the iteration)
    assert row_saves(0, 1500, 64, True, 1000) == [960, 1472]  # parts at 1000 from a cached prompt
    assert row_saves(960, 540, 64, True, 1000) == [1472]  # a hit at 960: nothing cached past it to part from
    for start, n, shared in [(0, 4000, 1999), (64, 3000, 70), (17, 1000, 900)]:
        inside = [b for b in row_saves(start, n, 64, True, shared) if b < start + n]
        assert len(inside) <= 2 and all(b % 64 == 0 and start < b for b in inside)


def test_a_key_that_collides_is_a_miss_not_another_prefix():
    c = cache()
    ids = list(range(16))
    offer(c, ids, [0, 1, 2, 3], boundaries=(8,))
    forged = [50, 51, 52, 53] + ids[4:] + [1]
    assert c.match(keys_of(ids)[:2], forged).tokens == 0  # ids' keys, other tokens: the tokens are compared


def test_held_blocks_stay_evictable_ones_go_least_recently_used_leaves_first():
    c = cache(checkpoints=2)
    a, b = list(range(9)), list(range(100, 109))
    offer(c, a[:8], [0, 1], boundaries=(8,))  # its request holds them
    c.release([0, 1])  # it ended: evictable, kept while the pool has free pages
    assert c.usage()["cached_pages"] == 2 and c.usage()["checkpoints"] == 1
    offer(c, b[:8], [2, 3], boundaries=(8,))  # every checkpoint taken
    held = c.match(keys_of(b), b)
    c.take(held, len(b))
    assert c.usage()["hit_tokens"] == 8 and c.usage()["lookup_tokens"] == 9
    assert c.checkpoints.new() >= 0  # taken from a's block: its pages stay cached, a hit no longer
    assert c.match(keys_of(a), a).tokens == 0 and c.usage()["cached_pages"] == 4
    assert c.match(keys_of(b), b).tokens == 8  # held: never evicted
    assert c.checkpoints.new() == -1  # no evictable block has one: that boundary is not checkpointed
    c.release(list(held.pages))
    c.release(list(held.pages))  # both of b's holders ended
    assert c.evict_one() and 1 in c.free_pages  # a's last block first: the least recently used leaf
    assert c.evict_one() and c.evict_one() and c.evict_one() and not c.evict_one()
    assert sorted(c.free_pages) == list(range(32))


def test_the_books_agree_after_random_requests():
    """Random prompts sharing prefixes, checkpoints at random boundaries, releases and evictions: the blocks nobody
    holds that hold a checkpoint are the checkpoints' evictable ones, each block counts the checkpoints under it,
    and every checkpoint is free or held by one block."""
    rng = random.Random(3)
    c = cache(checkpoints=6, pages=40)
    held = []
    for _ in range(300):
        if held and (rng.random() < 0.4 or len(c.free_pages) < 8):
            pages, shared = held.pop(rng.randrange(len(held)))
            c.release(pages, shared)
        else:
            ids = [rng.randrange(3) for _ in range(rng.choice([4, 8, 12, 16, 20]))]
            keys, hit = keys_of(ids), c.match(keys_of(ids), ids + [0])
            c.take(hit, len(ids) + 1)
            pages, shared = list(hit.pages), {}
            for i in range(len(hit.pages), len(keys)):
                while not c.free_pages and c.evict_one():
                    pass
                pages.append(c.free_pages.pop())
                if c.offer_page(keys[i], keys[i - 1] if i else ROOT, ids[i * P:(i + 1) * P], pages[i]) == "shared":
                    shared[i] = keys[i]
                if (i + 1) * P % 8 == 0 and rng.random() < 0.7 and not c.checkpoints.held_at(keys[i]):
                    if (ckpt := c.checkpoints.new()) >= 0:
                        c.checkpoints.offer(keys[i], ckpt)
            held.append((pages, shared))
        evictable = {k for k, b in c.evictable.items() if b.checkpoint >= 0}
        assert set(c.checkpoints.evictable) == evictable
        assert all((b.refs == 0) == (k in c.evictable) for k, b in c.blocks.items())
        for b in c.blocks.values():
            under = [d for d in c.blocks.values() if d.checkpoint >= 0 and _ancestor(c, b.key, d)]
            assert b.below == len(under)
        owned = [b.checkpoint for b in c.blocks.values() if b.checkpoint >= 0]
        assert sorted(owned + c.checkpoints.free) == list(range(6))


def _ancestor(c: PrefixCache, key: bytes, block) -> bool:
    parent = c.blocks.get(block.parent)
    while parent is not None:
        if parent.key == key:
            return True
        parent = c.blocks.get(parent.parent)
    return False


def test_evictable_pages_stay_until_the_free_pages_run_out():
    c = cache(pages=6)
    ids = list(range(17))
    offer(c, ids[:16], [0, 1, 2, 3], boundaries=(8, 16))
    c.release([0, 1, 2, 3])
    assert c.usage()["cached_pages"] == 4 and c.match(keys_of(ids), ids).tokens == 16
    pool = RankPool(6, 1, P, None)
    pool.prefix, c.free_pages = c, pool.free_pages  # the rank's free list is the cache's
    pool.free_pages[:] = [4, 5]
    assert pool.available_pages() == 6 and sorted(pool.take_pages(4)) == [2, 3, 4, 5]  # blocks 3 and 2 evicted
    assert c.match(keys_of(ids), ids).tokens == 8  # the shallow ones stay


def test_a_block_stays_while_its_children_are_cached_and_one_computed_again_is_shared():
    """Two prompts open with the same block (a chat template's first tokens). The second request computes that
    block too, finds it cached, and holds it beside its own copy; eviction takes the least recently used leaves,
    never a block under a cached one, so the second prompt still hits (its deepest block went)."""
    c = cache(checkpoints=4)
    a = list(range(8)) + [1]
    b = list(range(4)) + list(range(50, 62)) + [1]  # block 0 is a's
    offer(c, a[:8], [0, 1], boundaries=(8,))
    c.release([0, 1])  # a's blocks: evictable
    kb, shared = keys_of(b[:16]), {}
    for i, page in enumerate([2, 3, 4, 5]):
        c.free_pages.remove(page)
        if c.offer_page(kb[i], kb[i - 1] if i else ROOT, b[i * P:(i + 1) * P], page) == "shared":
            shared[i] = kb[i]
    assert shared == {0: kb[0]} and kb[0] not in c.evictable  # held by b's request now
    for boundary in (8, 16):
        c.checkpoints.offer(kb[boundary // P - 1], c.checkpoints.new())
    c.release([2, 3, 4, 5], shared)  # its own copy of block 0 is freed
    assert 2 in c.free_pages and len(c.evictable) == 5
    assert c.evict_one() and c.evict_one()
    assert {1, 5} <= set(c.free_pages)  # a's block 1, then b's block 3: leaves; a's block 0 has b's under it
    assert c.match(keys_of(b), b).tokens == 8 and c.match(keys_of(a), a).tokens == 0
    c.free_pages.remove(9)
    assert c.offer_page(keys_of(a)[1], kb[0], a[4:8], 9) == "cached"  # under a cached parent
    assert c.offer_page(block_key(b"x", [1, 2, 3, 4]), b"x", [1, 2, 3, 4], 10) == "refused"  # no parent cached


def test_a_finished_chat_keeps_its_deepest_state_longest():
    """Checkpoints are the budget: one taken from the evictable blocks comes from a state with a deeper one cached
    under it (a chat's intermediate boundaries) before any chat's deepest, where its next turn resumes."""
    c = cache(checkpoints=4)
    chat, other = list(range(25)), list(range(100, 117))
    offer(c, chat[:24], [0, 1, 2, 3, 4, 5], boundaries=(8, 16, 24))
    c.release([0, 1, 2, 3, 4, 5])
    offer(c, other[:16], [6, 7, 8, 9], boundaries=(8, 16))  # the last free checkpoint, then the chat's state at 16
    kc, ko = keys_of(chat), keys_of(other)
    assert not c.checkpoints.held_at(kc[3]) and c.checkpoints.held_at(kc[1]) and c.checkpoints.held_at(kc[5])
    assert c.match(kc, chat).tokens == 24  # its next turn resumes from its end
    c.release([6, 7, 8, 9])
    assert c.checkpoints.new() >= 0 and not c.checkpoints.held_at(kc[1])  # the chat's state at 8: under it, 24's
    assert c.checkpoints.new() >= 0 and not c.checkpoints.held_at(ko[1])  # then other's at 8: under it, its 16
    assert c.match(kc, chat).tokens == 24 and c.match(ko, other).tokens == 16
    assert c.checkpoints.new() >= 0 and c.match(kc, chat).tokens == 0  # none intermediate left: the oldest goes


def test_sizes_come_from_the_budget_and_the_switch_turns_the_cache_off():
    model = load_config("configs/tiny.yaml", {"model.dtype": "float64", **RELEASED}).model
    serve = ServeConfig(page_size=P).resolved("cpu")
    sizes = prefix_sizes(serve, model)
    assert sizes.every == 16 and sizes.checkpoints == serve.slots_per_rank  # the default budget
    assert sizes.checkpoint_bytes == 2 * (4 * 16 * 16 * 8 + 3 * 3 * 4 * 16 * 8)  # 2 KDA layers: state + conv tail
    assert sizes.state_bytes_per_token == sizes.checkpoint_bytes / 16
    interval = sizes.checkpoint_bytes + 4 * sizes.page_bytes
    assert prefix_sizes(serve.model_copy(update={"prefix_cache_bytes": 3 * interval}), model).checkpoints == 3
    assert prefix_sizes(serve.model_copy(update={"prefix_cache": False}), model) is None
    with pytest.raises(ValueError, match="multiple of serve.page_size"):
        ServeConfig(page_size=P, prefix_state_every=10).resolved("cpu")


# -- through the engine ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64", **RELEASED}).model
    return build_stage(cfg, range(cfg.n_layers), seed=5)


def engine(model, on=True, pages=64, slots=4, budget=24, cache_bytes=None):
    serve = ServeConfig(page_size=P, pages_per_rank=pages, slots_per_rank=slots, token_budget=budget,
                        prefix_cache=on, prefix_cache_bytes=cache_bytes).resolved("cpu")
    prefix = prefix_sizes(serve, model.cfg)
    sched = Scheduler(serve, model.cfg.max_seq_len, prefix=prefix)
    return sched, LocalExecutor(model, PoolSizes(pages, P, slots, 0 if prefix is None else prefix.checkpoints))


def run(sched, ex, batches: list[list[tuple[list[int], SamplingParams]]]) -> list:
    """Each batch submitted once the one before has finished; the requests in order."""
    reqs = []
    for batch in batches:
        reqs += [sched.submit(p, sp) for p, sp in batch]
        while sched.has_work:
            sched.step(ex)
    return reqs


def params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=5 + i % 3, temperature=0.7 if i % 3 == 2 else 0.0, seed=i)


def test_a_shared_system_prompt_hits_and_changes_no_token(model):
    """Two requests at once, then four more sharing the system prompt: they start at its deepest
    boundary (32 of 35 bytes), their tokens the reference's; preemption on a small page pool changes nothing."""
    users = ["hi", "What is 2+2?", "name a colour", "bye now", "ok", "list three fruits"]
    prompts = [encode(SYSTEM + "### user\n" + u + "\n### assistant\n") for u in users]
    want = [generate_reference(model, p, params(i))[0] for i, p in enumerate(prompts)]
    work = [[(prompts[0], params(0)), (prompts[1], params(1))], [(p, params(i + 2)) for i, p in enumerate(prompts[2:])]]
    for pages in (64, 24):  # 24 pages: requests preempted and prefilled again
        sched, ex = engine(model, pages=pages)
        reqs = run(sched, ex, work)
        assert [r.out for r in reqs] == want, pages
        assert [r.cached_prompt for r in reqs[2:]] == [32] * 4  # the second saved the state where it parts
        u = sched.usage()
        assert u["pages_used"] == 0 and u["slots_used"] == 0
        assert reqs[0].cached_prompt == 0  # the second of the first two is admitted once the first's prefill ran
        assert u["prefix_cache"]["hit_tokens"] == sum(r.cached_prompt for r in reqs)
        assert 0 < u["prefix_cache"]["hit_rate"] < 1
    assert sched.table.preemptions > 0
    off, ex = engine(model, on=False)
    assert [r.out for r in run(off, ex, work)] == want and "prefix_cache" not in off.usage()


def test_multi_turn_chats_resume_from_the_turn_before_and_change_no_token(model):
    """Two chats of four turns, each turn resending the conversation with the model's reply: every turn after the
    first starts past the boundaries of what the turn before prefilled and generated (decode rows checkpoint too)."""
    chats = [["hello there", "and then?", "why", "thanks"], ["2+2", "times 3", "minus 1", "ok"]]
    convo = [encode("S: be brief\n") for _ in chats]  # short turns: four fit the tiny model's 128-token context
    sched, ex = engine(model, cache_bytes=2_000_000)  # ~57 checkpoints: none evicted
    for turn in range(4):
        batch = []
        for c, chat in enumerate(chats):
            convo[c] = convo[c] + encode(f"\nU: {chat[turn]}\nA: ")
            batch.append((convo[c], params(turn + c)))
        reqs = run(sched, ex, [batch])
        for c, (r, (prompt, sp)) in enumerate(zip(reqs, batch)):
            assert r.out == generate_reference(model, prompt, sp)[0], (turn, c)
            if turn:  # the turn before's prompt and reply but its last token (never cached), to a boundary
                assert r.cached_prompt == (before[c] - 1) // 16 * 16 > 0, (turn, c)
            convo[c] = convo[c] + r.out  # the reply as generated (a chat template would render its text)
        before = [len(p) for p in convo]
    assert sched.usage()["prefix_cache"]["hit_rate"] > 0.5


def test_a_lost_grid_starts_cold_and_its_requests_end_as_undisturbed(model):
    prompts = [encode(SYSTEM + "### user\n" + u) for u in ("one", "two", "three")]
    want = [generate_reference(model, p, params(0))[0] for p in prompts]
    sched, ex = engine(model)
    run(sched, ex, [[(prompts[0], params(0))]])
    reqs = [sched.submit(p, params(0)) for p in prompts[1:]]
    sched.step(ex)
    assert all(r.cached_prompt == 32 for r in reqs)
    assert sched.usage()["prefix_cache"]["cached_pages"] > 0
    sched.reset(1)  # the grid was lost: its caches with it
    ex = LocalExecutor(model, PoolSizes(64, P, 4, sched.prefix.checkpoints))
    assert sched.usage()["prefix_cache"]["cached_pages"] == 0
    while sched.has_work:
        sched.step(ex)
    assert [r.out for r in reqs] == want[1:]
