"""Grammars filled where tokens are sampled (k3ray.parallel.grammar_masks), without Ray: constrained requests decode
in every iteration with iterations overlapped (their rows take their token on the device), their outputs follow the
grammar and equal those of sequential iterations, and a request preempted and seated again replays its output into
a new matcher with no token changed; the text a grammar forces (at the output's start and later) is prefilled, not
decoded a token an iteration (jump-forward), with the output unchanged. The engine's books of what a rank holds
(`GrammarBooks`) send each compiled grammar and the tokenizer's description once. float64, the tiny model."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from k3ray.config import ServeConfig, load_config
from k3ray.data import encode
from k3ray.model.decoder import build_stage
from k3ray.model.sampling import SamplingParams
from k3ray.parallel.serving import LocalExecutor, PoolSizes
from k3ray.serve.grammar import Grammars, RequestLogits, request_grammar
from k3ray.serve.scheduler import Scheduler
from k3ray.tokenizer import ByteTokenizer
from test_serving_overlap import drive

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
PROMPTS = ["def ", "import os\n", "x = ", "class A:\n"]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64"}).model
    return build_stage(cfg, range(cfg.n_layers), seed=3)


@pytest.fixture(scope="module")
def grammar():
    text = request_grammar({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, None, None, False)
    return text, asyncio.run(Grammars(ByteTokenizer(), 30.0).compile(text))


def run(model, grammar, overlap: bool, pages: int = 96, max_tokens: int = 40, stop: tuple[str, ...] = ()):
    text, compiled = grammar
    serve = ServeConfig(page_size=4, pages_per_rank=pages, slots_per_rank=8, token_budget=24, max_waiting=64)
    sched = Scheduler(serve, model.cfg.max_seq_len, tokenizer=ByteTokenizer())
    ex = LocalExecutor(model, PoolSizes(pages, 4, 8))
    params = [SamplingParams(max_tokens=max_tokens, grammar=text, temperature=0.0 if i % 2 else 0.9, seed=7 + i,
                             stop=stop)
              for i in range(len(PROMPTS))]
    reqs = []
    submit = sched.submit

    def submit_with_grammar(prompt, sp):
        req = submit(prompt, sp, compiled)
        reqs.append(req)
        return req

    sched.submit = submit_with_grammar
    log = []
    drive(sched, ex, overlap=overlap, submit_at={0: [(encode(p), sp) for p, sp in zip(PROMPTS, params)]}, log=log)
    return [r.out for r in reqs], log, sched


def follows(compiled, out: list[int]) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return all(matcher.accept_token(t) for t in out if not matcher.is_terminated())


def test_constrained_requests_decode_every_iteration_overlapped_and_follow_the_grammar(model, grammar):
    seq, _, _ = run(model, grammar, overlap=False)
    outs, log, sched = run(model, grammar, overlap=True)
    assert outs == seq
    assert all(len(o) > 5 and follows(grammar[1], o) for o in outs)
    text = bytes(outs[1]).decode(errors="replace")
    assert text.startswith("{") and '"name"' in text[:12], text
    rows = [(b.plan.from_device[r.row], r.grammar) for plans in log for b in plans.ranks.values()
            for r in b.plan.logits]
    assert sum(1 for f, g in rows if f and g is not None) > 20  # constrained rows took their token on the device
    sent = [g for _, g in rows if g is not None and g.compiled is not None]
    assert len(sent) == 1 and sum(1 for _, g in rows if g is not None and g.tokenizer is not None) == 1
    assert sched.usage()["slots_used"] == 0
    done = [r for r in sched.table.requests.values() if r.finish == "stop"]
    for r in done:  # a finished JSON object parses
        json.loads(bytes(r.out[:-1]).decode(errors="replace"))  # bytes of a string may split a character


def test_a_preempted_constrained_request_replays_its_output_into_a_new_matcher(model, grammar):
    want, _, _ = run(model, grammar, overlap=True)
    outs, log, sched = run(model, grammar, overlap=True, pages=16)  # too few pages: newer requests preempted
    assert sched.table.preemptions > 0
    replays = [r.grammar.replay for plans in log for b in plans.ranks.values() for r in b.plan.logits
               if r.grammar is not None and r.grammar.replay]
    assert replays, "no request came back with output to replay"
    assert outs == want


def test_constrained_requests_survive_a_lost_worker_unchanged(model, grammar):
    """The engine with iterations overlapped loses its worker mid-generation (FakeGrid): the new grid holds no
    matcher and no grammar, every constrained request is seated again with its output replayed, and each ends as it
    would have undisturbed."""
    from fakes.serving import SERVE, FakeGrid, sizes

    from k3ray.serve.engine import Engine

    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64", "parallel.pp": 1, "parallel.ep": 1,
                                            "serve.overlap": True, **{f"serve.{k}": v for k, v in SERVE.items()}})

    def serve(lose_at):
        grid = FakeGrid(model, sizes(cfg), lose_at=lose_at)

        async def one(eng, i):
            sp = SamplingParams(max_tokens=24, grammar=grammar[0], temperature=0.0 if i % 2 else 0.9, seed=3 + i)
            return [t for item in [x async for x in eng.generate(encode(PROMPTS[i]), sp)]
                    for t in item.get("tokens", [])]

        async def main():
            eng = Engine(cfg, 0, grid)
            return await asyncio.gather(*(one(eng, i) for i in range(3)))

        return asyncio.run(main()), grid

    want, _ = serve(())
    got, grid = serve({9})
    assert "recover" in grid.calls and got == want
    assert all(len(t) > 5 and follows(grammar[1], t) for t in got)


def test_after_a_failed_iteration_the_grammar_is_sent_again(model, grammar):
    """An iteration fails with no worker lost (FakeGrid.fail_at) as the first constrained request's grammar is on
    its way: that request ends with the error, and the next one with the same grammar still decodes under it (the
    engine's books start over, so the last stage gets the grammar again)."""
    from fakes.serving import SERVE, FakeGrid, sizes

    from k3ray.serve.engine import Engine

    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64", "parallel.pp": 1, "parallel.ep": 1,
                                            "serve.overlap": False, **{f"serve.{k}": v for k, v in SERVE.items()}})
    grid = FakeGrid(model, sizes(cfg))
    grid.fail_at = {1}
    engine = Engine(cfg, 0, grid)
    sp = SamplingParams(max_tokens=16, grammar=grammar[0])

    async def main():
        first = [x async for x in engine.generate(encode(PROMPTS[0]), sp)]
        second = [x async for x in engine.generate(encode(PROMPTS[1]), sp)]
        return first, second

    first, second = asyncio.run(main())
    assert first[-1].get("error") == "internal", first[-1]
    out = [t for item in second for t in item.get("tokens", [])]
    assert "error" not in second[-1] and len(out) > 5 and follows(grammar[1], out)


TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}},
         {"type": "function", "function": {"name": "open", "parameters": {
             "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


@pytest.mark.parametrize("kind", ["json_schema", "tool_call"])
def test_what_the_grammar_forces_is_prefilled_not_decoded_and_the_output_is_unchanged(model, grammar, kind,
                                                                                       monkeypatch):
    # chat requests carry the template's stop string ("\n### " for the byte template), as served
    size = {"pages": 256, "max_tokens": 160, "stop": ("\n### ",)}
    if kind == "tool_call":
        text = request_grammar(None, TOOLS, "required", True)
        grammar = text, asyncio.run(Grammars(ByteTokenizer(), 30.0).compile(text))
        forced = "<|tool_calls_section_begin|><|tool_call_begin|>functions."
    else:
        forced = '{"name": "'
    outs, log, _ = run(model, grammar, overlap=True, **size)
    monkeypatch.setattr(RequestLogits, "forced", lambda self, tok, limit, usable=None: [])
    decoded, decoded_log, _ = run(model, grammar, overlap=True, **size)
    assert outs == decoded  # the same tokens (the forced ones, then what the model chose), greedy and sampled
    assert all(bytes(o).decode(errors="replace").startswith(forced) for o in outs)
    # prefilled, the four requests' forced text took what a token budget of 24 needs; decoded, one iteration a token
    prefill = -(-len(PROMPTS) * len(forced) // 24)
    assert len(log) <= len(decoded_log) - len(forced) + prefill + 2
    # later in the output too (the call's name, its argument markers): rows of several known tokens
    later = [n for plans in log for b in plans.ranks.values() for n, c in zip(b.plan.counts, b.plan.counters)
             if n > 1 and c > len(forced)]
    assert later or kind != "tool_call"
    assert not [n for plans in decoded_log for b in plans.ranks.values()
                for n, c in zip(b.plan.counts, b.plan.counters) if n > 1 and c > 0]


def test_a_stop_string_inside_forced_text_ends_the_output_where_decoding_would(model, monkeypatch):
    """The stop string "call_begin" lies inside what a required tool call forces at its start: the jump takes
    the forced tokens short of the stop string's last one, which is decoded and ends each request as decoding every
    token would; the stop string itself is never output."""
    text = request_grammar(None, TOOLS, "required", True)
    grammar = text, asyncio.run(Grammars(ByteTokenizer(), 30.0).compile(text))
    size = {"pages": 256, "max_tokens": 160, "stop": ("call_begin",)}
    outs, log, sched = run(model, grammar, overlap=True, **size)
    monkeypatch.setattr(RequestLogits, "forced", lambda self, tok, limit, usable=None: [])
    decoded, decoded_log, _ = run(model, grammar, overlap=True, **size)
    assert outs == decoded
    assert all(bytes(o).decode().endswith("<|tool_call_begin") for o in outs)  # the stop's last token ended it
    assert all(r.finish == "stop" and "call_begin" not in r.text for r in sched.table.requests.values())
    assert len(log) < len(decoded_log)  # the jump still took the forced text before the stop string


def test_what_the_grammar_forces_is_taken_up_to_the_room_left(grammar):
    text, compiled = grammar
    logits = RequestLogits(SamplingParams(max_tokens=100, grammar=text), compiled)
    logits.jump_forward()
    tok = ByteTokenizer()
    assert bytes(logits.forced(tok, 100)).decode() == '{"name": "'
    assert logits.forced(tok, 100) == []  # then the model writes the name: nothing forced
    for token in b'ab"':
        logits.accept(token)
    assert bytes(logits.forced(tok, 3)).decode() == ', "'  # at most the room left


def test_forced_output_rides_an_eager_iteration_whole_and_a_decode_one_a_token(model):
    """With decode graphs (stepwise_prefill_max > 0), a run of forced output shorter than its rank's rows is fed
    one token an iteration where the iteration decodes only (it stays decode-shaped: a graph), and whole where a
    prompt chunk makes the iteration eager anyway or the run is longer than the rows; the outputs are those of
    feeding every run whole (float64)."""
    schema = {"type": "object", "required": ["name", "n", "a_key_longer_than_the_rows_are_many"],
              "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                             "a_key_longer_than_the_rows_are_many": {"type": "integer"}}}
    text = request_grammar({"type": "json_schema", "json_schema": {"schema": schema}}, None, None, False)
    compiled = asyncio.run(Grammars(ByteTokenizer(), 30.0).compile(text))
    prompts = [encode(p) for p in PROMPTS * 2]

    def served(stepwise: int):
        serve = ServeConfig(page_size=4, pages_per_rank=256, slots_per_rank=8, token_budget=64, max_waiting=64,
                            stepwise_prefill_max=stepwise)
        sched = Scheduler(serve, model.cfg.max_seq_len, tokenizer=ByteTokenizer())
        ex = LocalExecutor(model, PoolSizes(256, 4, 8))
        params = [SamplingParams(max_tokens=60, grammar=text, temperature=0.0, stop=("\n### ",)) for _ in prompts]
        reqs, submit = [], sched.submit
        sched.submit = lambda prompt, sp: reqs.append(submit(prompt, sp, compiled)) or reqs[-1]
        log = []
        # the second half arrives later: its prompt chunks make some iterations eager
        drive(sched, ex, overlap=True, submit_at={0: list(zip(prompts[:4], params[:4])),
                                                   12: list(zip(prompts[4:], params[4:]))}, log=log)
        return [r.out for r in reqs], log

    outs, log = served(stepwise=1)  # prompts are longer than 1 token: only forced runs go stepwise
    whole, whole_log = served(stepwise=0)
    assert outs == whole
    fed_one, fed_whole = 0, 0
    for plans in log:
        for b in plans.ranks.values():
            counts, ending = b.plan.counts, {r.row for r in b.plan.logits}
            output = [start >= len(req.prompt) for start, req in zip(b.plan.starts, b.requests)]
            prompt_chunk = any(n > 1 and not out for n, out in zip(counts, output))
            for row, n in enumerate(counts):
                if output[row] and n > 1:  # forced output fed whole: the iteration was eager, or the run long
                    assert prompt_chunk or n > len(counts) or sum(m > 1 for m in counts) > 1
                    fed_whole += 1
                elif output[row] and row not in ending:  # a forced token fed alone, its sampled token dropped
                    assert max(counts) == 1
                    fed_one += 1
    assert fed_one and fed_whole


def _forced_runs(text: str, chosen: bytes) -> list[str]:
    """What the grammar forces at the output's start, then after each token of `chosen` (the model's choices)."""
    logits = RequestLogits(SamplingParams(max_tokens=300, grammar=text),
                           asyncio.run(Grammars(ByteTokenizer(), 30.0).compile(text)))
    logits.jump_forward()
    runs = [bytes(logits.forced(ByteTokenizer(), 300)).decode()]
    for token in chosen:
        logits.accept(token)
        runs.append(bytes(logits.forced(ByteTokenizer(), 300)).decode())
    return runs


def test_a_tool_calls_id_and_name_are_forced_after_its_first_letter():
    from k3ray.serve.openai_schema import ChatRequest

    # the conversation had two calls: this reply's first call is functions.NAME:2 (K3's template numbers them)
    request = ChatRequest.model_validate({"model": "m", "tools": TOOLS, "tool_choice": "required", "messages": [
        {"role": "user", "content": "find it"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"functions.search:{i}", "type": "function", "function": {"name": "search", "arguments": "{}"}}
            for i in range(2)]},
        *({"role": "tool", "tool_call_id": f"functions.search:{i}", "content": "none"} for i in range(2))]})
    assert _forced_runs(request.grammar(), b"o") == [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.", "pen:2<|tool_call_argument_begin|>{"]
    named = request_grammar(None, TOOLS, {"type": "function", "function": {"name": "open"}}, True, 0)
    assert _forced_runs(named, b"") == [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.open:0<|tool_call_argument_begin|>{"]
    # parallel calls: the later ones take any index (an integer); without, the section ends after one
    for parallel, second in ((True, True), (False, False)):
        matcher = xgr.GrammarMatcher(asyncio.run(Grammars(ByteTokenizer(), 30.0).compile(
            request_grammar(None, TOOLS, "required", parallel, 0))))
        call = '<|tool_call_begin|>functions.search:{}<|tool_call_argument_begin|>{{"q": "x"}}<|tool_call_end|>'
        assert all(matcher.accept_token(b) for b in ("<|tool_calls_section_begin|>" + call.format(0)).encode())
        assert all(matcher.accept_token(b) for b in call.format(1).encode()) == second


def test_a_grammar_sent_again_is_neither_built_nor_compiled_again(monkeypatch):
    """Agents send the same tools and schemas every turn: the front door builds a request's grammar once per distinct
    fields, and the engine returns one it holds without a thread's round trip (in a busy engine process, milliseconds
    of the request's first token); it keeps the last COMPILED_HELD."""
    import k3ray.serve.grammar as grammar_module

    tools = [{"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}}]
    before = grammar_module._tool_grammar.cache_info().hits
    first = request_grammar(None, tools, "required", True)
    assert request_grammar(None, json.loads(json.dumps(tools)), "required", True) == first
    assert grammar_module._tool_grammar.cache_info().hits == before + 1
    assert request_grammar(None, tools, "required", True, first_index=1) != first  # the call's index is in it
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"type": 7}}}}}
    for _ in range(2):  # an error is not kept: each request with it gets it
        with pytest.raises(grammar_module.GrammarError, match="response_format.json_schema"):
            request_grammar(bad, None, None, False)

    threads = []
    real = asyncio.to_thread

    async def counted(fn, *args):
        threads.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(grammar_module.asyncio, "to_thread", counted)
    monkeypatch.setattr(grammar_module, "COMPILED_HELD", 2)
    grammars = Grammars(ByteTokenizer(), 30.0)
    schemas = [request_grammar({"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {f"k{i}": {"type": "integer"}}}}}, None, None, False) for i in range(3)]
    compiled = asyncio.run(grammars.compile(schemas[0]))
    assert asyncio.run(grammars.compile(schemas[0])) is compiled and len(threads) == 1
    for text in schemas[1:]:
        asyncio.run(grammars.compile(text))
    assert list(grammars.held) == schemas[1:] and len(threads) == 3  # the least recent one let go
