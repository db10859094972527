"""Serving with a real tokenizer, without Ray: the scheduler's per-request detokenizer turns generated ids into text
that never splits a character (what is streamed, joined, equals the whole output decoded at once), stop strings are
met on the text (also inside a token), end-of-text is the tokenizer's; the ingress encodes chat messages through the
tokenizer's template. The workers are scripted (the tokens they return are a given continuation), so the outputs hold
the multi-byte characters this is about."""
from __future__ import annotations

import pytest

from k3ray.serve import openai_schema as oa
from k3ray.serve.front_door import prompt_ids
from k3ray.config import ServeConfig
from k3ray.serve.scheduler import Scheduler
from k3ray.model.sampling import SamplingParams
from k3ray.parallel.serving import PoolSizes, StageOutput
from k3ray.tokenizer import load_tokenizer
from test_data import MULTIBYTE, train_bpe

SIZES = PoolSizes(pages=32, page_size=4, slots=4)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(str(train_bpe(tmp_path_factory.mktemp("bpe"))))


class ScriptedExecutor:
    """Each sequence continues with script[rid] (end-of-text after it): the sampled token the workers return."""

    def __init__(self, sched: Scheduler, scripts: dict[int, list[int]], eos: int):
        self.sched, self.scripts, self.eos = sched, scripts, eos

    def run(self, plans):
        out = {}
        for rank, plan in plans.items():
            by_slot = {r.slot: r for r in self.sched.table.running.values() if r.rank == rank}
            tokens = []
            for slot, start, n in zip(plan.slots, plan.starts, plan.counts):
                req = by_slot[slot]
                k, script = start + n - len(req.prompt), self.scripts[req.id]
                tokens.append(script[k] if k < len(script) else self.eos)
            out[rank] = StageOutput(tokens, [0.0] * len(tokens))
        return out


def serve(tok, outputs: list[str], params: list[SamplingParams]) -> list[tuple[list[str], object]]:
    """Run requests to the end; per request the text pieces as an engine streams them (one per iteration) and the
    request."""
    sched = Scheduler(ServeConfig(page_size=SIZES.page_size, pages_per_rank=SIZES.pages, slots_per_rank=SIZES.slots,
                                  token_budget=16), max_seq_len=128, tokenizer=tok)
    reqs = [sched.submit(tok.encode("<|user|>say it<|assistant|>"), p) for p in params]
    executor = ScriptedExecutor(sched, {r.id: tok.encode(o) for r, o in zip(reqs, outputs)}, tok.eos_id)
    sent, pieces = {r.id: 0 for r in reqs}, {r.id: [] for r in reqs}
    while sched.has_work:
        sched.step(executor)
        for r in reqs:
            if len(r.text) > sent[r.id]:
                pieces[r.id].append(r.text[sent[r.id]:])
                sent[r.id] = len(r.text)
    return [(pieces[r.id], r) for r in reqs]


def test_streamed_text_equals_the_whole_text_for_multibyte_characters(tok):
    texts = [MULTIBYTE, "naïve café ✓ " * 3, "日本語のテキスト"]
    for text, (pieces, req) in zip(texts, serve(tok, texts, [SamplingParams(max_tokens=100)] * 3)):
        assert req.finish == "stop" and req.out[-1] == tok.eos_id  # the tokenizer's end-of-text ended it
        assert "".join(pieces) == text == tok.decode(req.out[:-1])
        assert len(pieces) > 3 and all("\ufffd" not in p for p in pieces)  # streamed, never half a character


def test_stop_strings_are_met_on_the_text_and_cut_it(tok):
    # "ö" and "日本" are inside tokens or span several: the cut falls where the text says, not at a token edge
    (pieces, req), (pieces2, req2) = serve(tok, [MULTIBYTE, MULTIBYTE],
                                           [SamplingParams(max_tokens=100, stop=("örld",)),
                                            SamplingParams(max_tokens=100, stop=("本語", "zzz"))])
    assert "".join(pieces) == "héllo w" and req.finish == "stop" and req.out[-1] != tok.eos_id
    assert "".join(pieces2) == MULTIBYTE[:MULTIBYTE.index("本語")] and req2.finish == "stop"
    assert len(req.out) < len(tok.encode(MULTIBYTE))  # generation ended at the stop string


def test_max_tokens_ends_with_length_and_flushes(tok):
    (pieces, req), = serve(tok, [MULTIBYTE], [SamplingParams(max_tokens=5)])
    assert req.finish == "length" and "".join(pieces) == tok.decode(req.out)


def test_chat_requests_are_encoded_through_the_template(tok):
    req = oa.ChatRequest.model_validate({"model": "m", "messages": [{"role": "system", "content": "brief"},
                                                                    {"role": "user", "content": "héllo ✓"}]})
    ids, stop = prompt_ids(tok, req, chat=True)
    assert tok.decode(ids) == "<|system|>brief<|endoftext|>\n<|user|>héllo ✓<|endoftext|>\n<|assistant|>"
    assert stop == ()
    byte_ids, byte_stop = prompt_ids(load_tokenizer("bytes"), req, chat=True)
    assert bytes(byte_ids).decode() == "### system\nbrief\n### user\nhéllo ✓\n### assistant\n"
    assert byte_stop == ("\n### ",)
    plain = oa.CompletionRequest.model_validate({"model": "m", "prompt": "日本"})
    assert prompt_ids(tok, plain, chat=False) == (tok.encode("日本"), ())
