"""The serving engine without Ray: continuous batching with chunked prefill over paged latent KV and KDA state slots
reproduces the single-process reference generation (a plain full forward per token, no cache) token for token;
seeded sampling gives the same text whatever shares the batch; pages and slots come back on finish and cancel.

float64 so that batching (other summation orders) cannot flip an argmax."""
from __future__ import annotations

import statistics

import pytest
import torch

from conftest import RELEASED
from k3ray.config import load_config
from k3ray.faults import poison_token
from k3ray.config import ServeConfig
from k3ray.serve.pacing import IterationPacer
from k3ray.serve.scheduler import Overloaded, Scheduler
from k3ray.data import chat_prompt, decode, encode
from k3ray.model.decoder import build_stage
from k3ray.model.sampling import SamplingParams, visible_ids
from k3ray.parallel.reference import generate_reference
from k3ray.parallel.serving import LocalExecutor, PoolSizes

TEXTS = ["def ", "import os\n", "class Foo(object):\n    def __init__(self", "x", "for i in range(10):\n",
         "# Copyright 2001 Python Software Foundation\n\"\"\"Utilities for ", "return ", "if __name__ == '__main__':\n",
         "    while True:\n        line = f.readline()\n        if not line:\n            break\n", "@property\n",
         "try:\n    import _thread\nexcept ImportError:\n", "s", "def f(a, b=1, *args, **kw):\n    \"\"\"",
         "with open(path) as f:\n", "print(", "lambda x: x + 1\n", chat_prompt([("user", "hi")])]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)  # tiny tensors: more threads only contend on a shared CPU
    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64"}).model
    return build_stage(cfg, range(cfg.n_layers), seed=3)


def engine(model, budget=24, pages=48, page_size=4, slots=8, max_waiting=64):
    serve = ServeConfig(page_size=page_size, pages_per_rank=pages, slots_per_rank=slots, token_budget=budget,
                        max_waiting=max_waiting)
    return Scheduler(serve, model.cfg.max_seq_len), LocalExecutor(model, PoolSizes(pages, page_size, slots))


def run(sched, executor, submit_at: dict[int, list] | None = None) -> int:
    """Iterate until idle; submit_at[i] = [(prompt, params), ...] submitted before iteration i. Returns iterations."""
    submit_at, i, reqs = submit_at or {}, 0, []
    while sched.has_work or any(k >= i for k in submit_at):
        for prompt, params in submit_at.get(i, []):
            reqs.append(sched.submit(prompt, params))
        sched.step(executor)
        i += 1
    return i


def test_batched_engine_equals_reference_greedy(model):
    """17 requests of 1..73 prompt bytes and 3..24 new tokens, arriving over time, 24-token budget (prompts are
    prefilled in chunks beside other requests' decode steps), 4-token pages."""
    params = [SamplingParams(max_tokens=3 + (7 * i) % 22, stop=("\n\n",) if i % 5 == 0 else ()) for i in
              range(len(TEXTS))]
    prompts = [encode(t) for t in TEXTS]
    want = [generate_reference(model, p, sp) for p, sp in zip(prompts, params)]
    sched, ex = engine(model)
    arrivals = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        arrivals.setdefault(0 if i < 10 else 2 * i, []).append((p, sp))
    iterations = run(sched, ex, arrivals)
    reqs = sorted(sched.table.requests.values(), key=lambda r: r.id)
    assert len(reqs) == len(TEXTS) >= 16
    for r, (ids, reason) in zip(reqs, want):
        assert (r.out, r.finish) == (ids, reason), f"request {r.id} ({TEXTS[r.id]!r})"
    assert any(w[1] == "length" for w in want)
    assert max(len(p) for p in prompts) > 24  # some prompt needed more than one chunk
    assert iterations < sum(len(w[0]) for w in want)  # requests really shared iterations
    assert sched.usage()["pages_used"] == 0 and sched.usage()["slots_used"] == 0


def test_prompts_that_arrive_while_others_decode_start_at_once_together(model):
    """No hold: prompts that arrive while a request decodes are all prefilled in the next iteration beside its
    decode row (several prompts share an iteration, oldest first); a prompt longer than what the budget leaves gets
    a partial chunk. Outputs are the reference's."""
    prompts = [encode(t) for t in TEXTS[:6]]
    params = [SamplingParams(max_tokens=20 if i == 0 else 8) for i in range(len(prompts))]
    want = [generate_reference(model, p, sp)[0] for p, sp in zip(prompts, params)]
    sched, ex = engine(model, budget=100, pages=96)
    first = sched.submit(prompts[0], params[0])
    sched.step(ex)
    late = [sched.submit(p, sp) for p, sp in zip(prompts[1:], params[1:])]
    plans = sched.schedule()
    counts = plans.ranks[0].plan.counts
    assert counts[0] == 1 and len(counts) == 6 and plans.total_tokens == sum(counts) <= 100
    assert counts[1:-1] == [len(p) for p in prompts[1:-1]] and 0 < counts[-1] < len(prompts[-1])
    sched.complete(plans, ex.run(plans.plans()))
    while sched.has_work:
        sched.step(ex)
    assert [r.out for r in [first, *late]] == want


class PromptPricedExecutor:
    """LocalExecutor whose steps report the seconds of a device where an iteration costs 1 ms plus 0.1 ms per prompt
    token (the tokens of chunks longer than one)."""

    def __init__(self, inner: LocalExecutor):
        self.inner, self.prompt_tokens = inner, []

    def run(self, plans):
        outs = self.inner.run(plans)
        tokens = sum(n for n in plans[0].counts if n > 1)
        self.prompt_tokens.append(tokens)
        outs[0].seconds = 1e-3 + 1e-4 * tokens
        return outs


def test_an_iteration_target_paces_prompt_chunks_and_changes_no_output(model):
    """serve.iteration_target_ms: from the step seconds of the iterations before, an iteration holds only the prompt
    tokens that keep it near the target (5 ms here: 40 prompt tokens at 1 ms + 0.1 ms per token), however much of
    the token budget is left; long prompts are cut into more chunks, and every output is still the reference's."""
    prompts = [encode((t * 30)[:100]) for t in TEXTS[:8]]
    params = [SamplingParams(max_tokens=6) for _ in prompts]
    want = [generate_reference(model, p, sp)[0] for p, sp in zip(prompts, params)]
    serve = ServeConfig(page_size=4, pages_per_rank=256, slots_per_rank=8, token_budget=200, iteration_target_ms=5.0)
    sched = Scheduler(serve, model.cfg.max_seq_len)
    sched.pacer = IterationPacer(5e-3, serve.token_budget, floor=8)  # the default floor (256) exceeds this budget
    ex = PromptPricedExecutor(LocalExecutor(model, PoolSizes(256, 4, 8)))
    reqs = [sched.submit(p, sp) for p, sp in zip(prompts, params)]
    while sched.has_work:
        sched.step(ex)
    assert [r.out for r in reqs] == want
    assert ex.prompt_tokens[0] == 200  # nothing measured yet: the budget
    # then 5 ms / (21 ms / 200 tokens) = 47 after the first, converging to (5 - 1) / 0.1 = 40
    assert max(ex.prompt_tokens[1:]) <= 47
    assert 36 <= statistics.median(t for t in ex.prompt_tokens[1:] if t > 0) <= 44
    assert sum(t > 0 for t in ex.prompt_tokens) >= 1 + (sum(len(p) for p in prompts) - 200) // 47


def test_the_pacer_fits_a_fixed_and_a_per_token_cost_and_gives_up_on_a_target_out_of_reach():
    assert IterationPacer(None, 128, 8).prompt_allowance() == 128  # no target: the budget
    pacer = IterationPacer(0.02, 8192, 256)
    assert pacer.prompt_allowance() == 8192  # nothing measured yet
    pacer.observe(0, 0.003)  # decode rows alone (graph replays): not part of the fit
    for n in (2048, 1024, 512):  # 4 ms fixed, 6 us per prompt token
        pacer.observe(n, 0.004 + n * 6e-6)
    assert abs(pacer.prompt_allowance() - 0.016 / 6e-6) <= 1
    slow = IterationPacer(0.02, 8192, 256)
    for n in (2048, 1024, 512, 300):  # 25 ms fixed: past the target whatever the prompt tokens
        slow.observe(n, 0.025 + n * 6e-6)
    assert slow.prompt_allowance() == 8192


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlapped"])
def test_pages_are_allocated_on_demand_and_preemption_recomputes_without_changing_outputs(model, overlap):
    """Pools too small for every request's whole length: pages are taken as requests grow (admission needs only
    the first chunk's), and where they run out the newest requests give theirs back and are prefilled again from
    prompt + output. Greedy and seeded outputs equal the reference (no token lost or repeated), the preempted
    requests' streams included; every page comes back."""
    from test_serving_overlap import drive

    params = [SamplingParams(max_tokens=16 + i % 5, temperature=0.8 if i % 3 == 1 else 0.0, seed=30 + i)
              for i in range(10)]
    prompts = [encode(t) for t in TEXTS[:10]]
    want = [generate_reference(model, p, sp)[0] for p, sp in zip(prompts, params)]
    sched, ex = engine(model, budget=32, pages=32, page_size=4, slots=8)
    log = []
    drive(sched, ex, overlap, submit_at={0: list(zip(prompts, params))}, log=log)
    reqs = sorted(sched.table.requests.values(), key=lambda r: r.id)
    assert [r.out for r in reqs] == want
    preempted = {rid for plans in log for rid in plans.preempted}
    assert sched.table.preemptions >= 2 and len(preempted) >= 2
    assert sum(len(b.plan.grow) for plans in log for b in plans.ranks.values()) > 10
    assert sum(-(-(len(p) + sp.max_tokens) // 4) for p, sp in zip(prompts[:8], params)) > 32  # 8 slots: no fit
    usage = sched.usage()
    assert (usage["pages_used"], usage["slots_used"]) == (0, 0) and not sched.table.caches.held


def test_stepwise_prefill_feeds_short_prompts_as_decode_rows_and_changes_no_output(model):
    """Prompts of at most stepwise_prefill_max tokens take one row per iteration (decode-shaped: a CUDA graph on a
    GPU), longer ones chunks as before; greedy and seeded outputs equal the reference, also for requests arriving
    while others decode and for a request prefilled again after its caches were lost."""
    limit = 12
    params = [SamplingParams(max_tokens=4 + i % 5, temperature=0.8 if i % 3 == 1 else 0.0, seed=i)
              for i in range(len(TEXTS))]
    prompts = [encode(t) for t in TEXTS]
    want = [generate_reference(model, p, sp)[0] for p, sp in zip(prompts, params)]
    sched, ex = engine(model)
    sched.serve = sched.serve.model_copy(update={"stepwise_prefill_max": limit})
    rows = []  # (tokens to prefill when the row was planned, its count)

    def iteration():
        plans = sched.schedule()
        rows.extend((r.length, c) for b in plans.ranks.values() for r, c in zip(b.requests, b.plan.counts))
        sched.complete(plans, ex.run(plans.plans()))

    reqs = [sched.submit(p, sp) for p, sp in zip(prompts[:4], params[:4])]
    for _ in range(3):
        iteration()
    sched.reset(1)  # the caches lost: every unfinished request prefilled again (stepwise where short enough)
    reqs += [sched.submit(p, sp) for p, sp in zip(prompts[4:], params[4:])]
    while sched.has_work:
        iteration()
    assert [r.out for r in reqs] == want
    assert all(c == 1 for length, c in rows if length <= limit)  # short prompts: rows of one token
    assert any(c > 1 for length, c in rows if length > limit)  # longer ones: chunks
    assert sum(len(p) <= limit for p in prompts) >= 6


@pytest.mark.parametrize("rope", [False, True], ids=["no_rope_absorbed", "rope"])
def test_batched_engine_equals_reference_with_the_released_features(rope):
    """Every released feature on (conftest.RELEASED): each request's KDA convolution state (its last 3 inputs of q,
    k, v) is carried across chunked prefill and decode beside the KDA state and reset for a fresh sequence in a
    reused slot; MLA caches [c | k_p]; Block AttnRes needs nothing per request. Greedy and seeded tokens equal the
    plain full forward's. Without RoPE the cache attends over the latents with the up-projection absorbed; with it
    (K2's layout) keys are recomputed from them."""
    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64", **RELEASED, "model.mla_rope": rope}).model
    released = build_stage(cfg, range(cfg.n_layers), seed=5)
    params = [SamplingParams(max_tokens=3 + (2 * i) % 5, temperature=0.7 if i % 3 == 2 else 0.0, seed=i)
              for i in range(5)]
    prompts = [encode(t) for t in (TEXTS[0], TEXTS[2], TEXTS[4], TEXTS[7], TEXTS[12])]
    want = [generate_reference(released, p, sp)[0] for p, sp in zip(prompts, params)]
    sched, ex = engine(released, budget=16, slots=3)  # fewer slots than requests: slots are reused
    run(sched, ex, {0: list(zip(prompts[:3], params[:3])), 2: list(zip(prompts[3:], params[3:]))})
    got = [r.out for r in sorted(sched.table.requests.values(), key=lambda r: r.id)]
    assert got == want


def test_seeded_sampling_is_the_same_in_any_batch(model):
    """Same seed, same tokens: alone, among other requests, with another token budget; and as the reference."""
    sp = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i) for i in range(3)]
    prompts = [encode(TEXTS[i]) for i in (0, 5, 9)]
    want = [generate_reference(model, p, s)[0] for p, s in zip(prompts, sp)]
    others = [(encode(t), SamplingParams(max_tokens=8, temperature=1.0, seed=7)) for t in TEXTS[10:16]]
    for budget, extra in ((64, []), (8, others), (17, others[:3])):
        sched, ex = engine(model, budget=budget)
        run(sched, ex, {0: extra[:2] + list(zip(prompts, sp)) + extra[2:]})
        got = {tuple(r.prompt): r.out for r in sched.table.requests.values() if r.params in sp}
        assert [got[tuple(p)] for p in prompts] == want, f"budget {budget}, {len(extra)} other requests"
    assert len({tuple(w) for w in want}) == 3
    unseeded = SamplingParams(max_tokens=12, temperature=0.9, seed=101)
    assert generate_reference(model, prompts[0], unseeded)[0] != want[0]  # the seed matters


def test_cancel_frees_pages_and_slots_and_spares_the_others(model):
    sched, ex = engine(model)
    keep = sched.submit(encode(TEXTS[2]), SamplingParams(max_tokens=10))
    gone = [sched.submit(encode(t), SamplingParams(max_tokens=40)) for t in TEXTS[3:6]]
    queued = sched.submit(encode("y"), SamplingParams(max_tokens=5))
    sched.step(ex)
    sched.step(ex)
    assert gone[0].out
    plans = sched.schedule()  # cancel one request while its iteration is in flight: freed when it completes
    used = sched.usage()["pages_used"]  # (scheduling takes the pages the rows grow into)
    assert used > 0
    sched.table.cancel(gone[0].id)
    assert sched.usage()["pages_used"] == used
    sched.complete(plans, ex.run(plans.plans()))
    sched.table.cancel(gone[1].id)  # between iterations: freed at once
    sched.table.cancel(queued.id)  # still waiting
    sched.table.cancel(gone[2].id)
    assert gone[0].finish == gone[1].finish == queued.finish == "cancelled"
    assert sched.usage()["slots_used"] == 1
    while sched.has_work:
        sched.step(ex)
    assert keep.out == generate_reference(model, keep.prompt, keep.params)[0]
    usage = sched.usage()
    assert (usage["waiting"], usage["running"], usage["pages_used"], usage["slots_used"]) == (0, 0, 0, 0)


def test_requests_whose_caches_were_lost_are_prefilled_again_and_end_as_undisturbed(model):
    """Mid-generation the caches are lost (a new executor: empty pools) and the data-parallel width changes: every
    unfinished request is requeued and prefilled again from prompt + output so far; greedy and seeded outputs equal
    the reference, and the tokens before the loss stand (none lost, none repeated)."""
    params = [SamplingParams(max_tokens=14, seed=40 + i, temperature=0.8 if i % 2 else 0.0) for i in range(9)]
    prompts = [encode(t) for t in TEXTS[:9]]
    want = [generate_reference(model, p, sp)[0] for p, sp in zip(prompts, params)]
    sched, ex = engine(model, slots=6)  # 6 slots: 3 requests wait, and after the loss 3 wait again
    reqs = [sched.submit(p, sp) for p, sp in zip(prompts, params)]
    for _ in range(6):
        sched.step(ex)
    before = {r.id: list(r.out) for r in reqs}
    assert sum(1 for r in reqs if r.out and not r.done) >= 4
    plans = sched.schedule()  # lost with the iteration in flight: its plans are never completed
    cancelled = plans.ranks[0].requests[0]
    sched.table.cancel(cancelled.id)
    admitted = [r for r in sched.table.running.values() if r is not cancelled]
    requeued = sched.reset(dp=1)
    assert sched.table.waiting[:len(requeued)] == requeued == sorted(admitted, key=lambda r: r.arrival)
    assert len(requeued) >= 4 and len(sched.table.waiting) > len(requeued)
    assert all(r.cached == 0 and r.slot == -1 for r in requeued) and sched.usage()["pages_used"] == 0
    _, fresh = engine(model, slots=6)
    while sched.has_work:
        sched.step(fresh)
    for r, w in zip(reqs, want):
        if r is not cancelled:
            assert r.out == w, f"request {r.id}"
            assert r.out[:len(before[r.id])] == before[r.id]
    assert cancelled.finish == "cancelled"
    assert sched.usage()["slots_used"] == 0


def test_a_request_that_blows_up_fails_alone(model):
    """The embedding of one byte becomes NaN (a drill's hook): the one request whose prompt holds it, prefilled in
    chunks beside the others, fails with an error naming the guard; every other request ends as the reference, also
    those that reuse the pages and slot it held."""
    poison = ord("~")
    texts = [t for t in TEXTS if "~" not in t][:8]
    params = SamplingParams(max_tokens=10)
    want = [generate_reference(model, encode(t), params)[0] for t in texts]
    assert all(poison not in w for w in want)
    sched, ex = engine(model, budget=16, pages=24, slots=2)  # few: the others reuse the failed one's slot and pages
    handle = poison_token(model, poison)
    held: dict[int, set[int]] = {}  # request -> pages it held
    try:
        reqs = [sched.submit(encode(t), params) for t in texts[:2]]
        bad = sched.submit(encode("x = 1\n" * 4 + "~ = 2\n"), params)
        reqs += [sched.submit(encode(t), params) for t in texts[2:]]
        while sched.has_work:
            sched.step(ex)
            for r in sched.table.running.values():
                held.setdefault(r.id, set()).update(r.pages)
    finally:
        handle.remove()
    assert bad.finish == "error" and bad.trip.rule == "activation" and bad.trip.detail == "not finite"
    assert "blew up" in bad.error and bad.out == []
    assert [r.out for r in reqs] == want
    assert any(held[r.id] & held[bad.id] for r in reqs if r.id > bad.id)
    assert sched.usage()["pages_used"] == 0


def test_limits_and_overload(model):
    sched, _ = engine(model, pages=8, slots=1, max_waiting=2)  # 1 admitted at the next iteration + 2 queued
    with pytest.raises(ValueError, match="prompt"):
        sched.submit(encode("x" * model.cfg.max_seq_len), SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        sched.submit(encode("x"), SamplingParams(max_tokens=1000))
    sched.submit(encode("a"), SamplingParams())
    sched.submit(encode("b"), SamplingParams())
    sched.submit(encode("c"), SamplingParams())
    with pytest.raises(Overloaded):
        sched.submit(encode("d"), SamplingParams())


def test_stop_strings_and_tokenizer():
    sp = SamplingParams(stop=("\n#",))
    out = encode("x = 1\n# next")
    assert decode(visible_ids(out, sp, 0)) == "x = 1"
    assert decode(visible_ids(encode("ab") + [0], SamplingParams(), 0)) == "ab"
    assert decode(encode("héllo")[:2]) == "h\ufffd"
    want = "### system\nbe brief\n### user\nhi\n### assistant\n"
    assert chat_prompt([("system", "be brief"), ("user", "hi")]) == want


def test_serve_cli_refuses_a_directory_without_a_checkpoint(tmp_path, capsys):
    from k3ray.control.cli import main

    assert main(["serve", "--checkpoint", str(tmp_path)]) == 2
    assert "no verified checkpoint" in capsys.readouterr().err


def test_decode_iterations_do_no_work_that_grows_with_the_context(model, monkeypatch):
    """Once a request is prefilled, each decode iteration's plan holds one token and the slot, start and counter
    of each sequence (page tables and sampling parameters went to the worker once, at admission), whatever the
    context length; the engine never rebuilds a request's whole token list (prompt + output) to schedule it, sample
    it or check its stop strings."""
    import pickle

    from k3ray.serve.scheduler import Request

    sizes = {}
    for prompt_len in (8, 96):
        sched, ex = engine(model, budget=512, pages=128, page_size=4, slots=4)
        reqs = [sched.submit(encode("x" * prompt_len), SamplingParams(max_tokens=12, stop=("never",)))
                for _ in range(3)]
        sched.step(ex)  # the prompts, whole, and the first tokens
        assert all(len(r.out) == 1 for r in reqs)
        built = []
        monkeypatch.setattr(Request, "ids", property(lambda r: built.append(r.id) or r.prompt + r.out))
        plans = sched.schedule()
        plan = plans.ranks[0].plan
        assert plan.counts == [1, 1, 1] and len(plan.tokens) == 3 and plan.admit == []
        sizes[prompt_len] = len(pickle.dumps(plan))
        sched.complete(plans, ex.run({0: plan}))
        while sched.has_work:
            sched.step(ex)
        assert built == [] and all(len(r.out) == 12 for r in reqs)
        monkeypatch.undo()
    assert sizes[8] == sizes[96]


def test_init_writes_the_seeded_weights_as_a_servable_checkpoint(tmp_path, capsys):
    """`k3ray init`: the model's initial weights (a function of the seed and the config) as a checkpoint that serving
    loads, equal to the model built from the seed; a directory that is not empty is refused in one line."""
    from k3ray.control.cli import main
    from k3ray.formats.serving_weights import serving_weights

    out = tmp_path / "seeded"
    assert main(["init", "--config", "configs/tiny.yaml", "--out", str(out), "--set", "train.seed=7"]) == 0
    weights = serving_weights(str(out))
    cfg = load_config("configs/tiny.yaml", {"train.seed": 7})
    want = build_stage(cfg.model, range(cfg.model.n_layers), seed=7)
    params = dict(want.named_parameters())
    assert weights.step == 0 and weights.state["dense"].keys() == {n for n in params if ".experts." not in n}
    assert all(torch.equal(t, params[n]) for n, t in weights.state["dense"].items())
    for layer, shard in want.expert_shards().items():
        assert torch.equal(weights.state["experts"][layer]["w1"], shard.w1)
    capsys.readouterr()
    assert main(["init", "--config", "configs/tiny.yaml", "--out", str(out)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not empty" in err[0]
