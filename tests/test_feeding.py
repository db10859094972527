"""How a running request's known tokens are fed (k3ray.serve.feeding), as pure functions over requests: an
iteration is expected eager where a prompt chunk, a new request or a forced run longer than its rank's rows is
coming, and every iteration is eager without decode graphs; what is left to run counts as forced output only past
the prompt and up to where jump-forward wrote."""
from __future__ import annotations

from types import SimpleNamespace

from k3ray.model.sampling import SamplingParams
from k3ray.serve.feeding import eager_ranks, forced_only, stepwise
from k3ray.serve.scheduler_output import Request


def request(prompt: int, out: int = 0, planned: int = 0, forced_end: int = 0, rank: int = 0) -> Request:
    req = Request(0, list(range(prompt)), SamplingParams(max_tokens=100), 0.0, out=list(range(out)), rank=rank)
    req.planned, req.forced_end = planned, forced_end
    return req


def pools(*free_slots: int) -> list:
    return [SimpleNamespace(free_slots=list(range(n))) for n in free_slots]


def decoding(rank: int = 0) -> Request:
    return request(100, out=5, planned=104, rank=rank)  # one token to run


def test_forced_output_is_what_jump_forward_wrote_past_the_prompt():
    assert forced_only(request(100, out=10, planned=101, forced_end=110))
    assert not forced_only(request(100, out=10, planned=101, forced_end=105))  # sampled tokens follow the run
    assert not forced_only(request(100, out=10, planned=50, forced_end=110))  # the prompt is still being fed
    assert not forced_only(request(100, out=10, planned=101))  # re-fed output after a requeue (forced_end 0)


def test_an_iteration_is_eager_where_a_chunk_a_new_request_or_a_long_forced_run_comes():
    short_run = request(100, out=4, planned=101, forced_end=104)  # 3 forced tokens, 4 rows on its rank
    rows = [decoding(), decoding(), decoding(), short_run]
    assert eager_ranks(rows, [], pools(0), stepwise_max=64) == [False]
    long_run = request(100, out=9, planned=101, forced_end=109)  # 8 forced tokens > 4 rows
    assert eager_ranks(rows[:3] + [long_run], [], pools(0), stepwise_max=64) == [True]
    chunk = request(300, planned=100, rank=1)  # a prompt chunk on rank 1 only
    assert eager_ranks(rows + [chunk], [], pools(0, 0), stepwise_max=64) == [False, True]
    waiting = [request(300)]  # a new request, admitted where a slot is free
    assert eager_ranks(rows, waiting, pools(0, 2), stepwise_max=64) == [False, True]
    assert eager_ranks(rows, [request(10)], pools(2), stepwise_max=64) == [False]  # a short prompt goes stepwise
    assert eager_ranks(rows, [], pools(0), stepwise_max=0) == [True]  # no decode graphs: always eager
    assert stepwise(request(64), 64) and not stepwise(request(65), 64) and not stepwise(request(1), None)
