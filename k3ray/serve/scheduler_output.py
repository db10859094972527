"""What the scheduler hands the engine: the requests it tracks, and each iteration as scheduled (as vLLM v1's
`SchedulerOutput`): per data-parallel rank the workers' plan and, per row, the request and its incarnation."""
from __future__ import annotations

from dataclasses import dataclass, field

from k3ray.model.sampling import SamplingParams
from k3ray.parallel.serving import RankPlan
from k3ray.policies import guards
from k3ray.serve.grammar import RequestLogits
from k3ray.tokenizer import Detokenizer


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    arrival: float
    out: list[int] = field(default_factory=list)
    rank: int = -1
    pages: list[int] = field(default_factory=list)
    slot: int = -1
    cached: int = 0  # tokens of `ids` whose cache entries the workers hold
    planned: int = 0  # positions whose cache entries are scheduled: `cached` and those of iterations in flight
    unconfirmed: int = 0  # tokens sampled by iterations in flight, not yet appended to `out`
    in_flight: int = 0  # iterations in flight with a row of this request (its slot and pages stay taken)
    epoch: int = 0  # incarnation: preempted requests start a new one, the rows of the old one in flight are void
    finish: str | None = None  # 'stop', 'length', 'cancelled', 'error'
    error: str = ""
    trip: guards.Trip | None = None  # the guard that stopped it (finish 'error')
    token_times: list[float] = field(default_factory=list)  # wall time of each generated token
    seed: int = 0  # the sampling noise's seed (the request's own, or drawn at submit)
    detok: Detokenizer | None = None  # the output as text, token by token: stop strings are checked on it
    text: str = ""  # the output text so far that is final (no half character, nothing a stop string may still cut)
    logits: RequestLogits | None = None  # grammar, penalties, logit_bias, logprobs: what its sampling rows carry
    logprobs: list = field(default_factory=list)  # per token of `out` (params.logprobs set): `token_logprobs`'s
    keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of the full blocks of `ids` known so far
    blocks_offered: int = 0  # pages of this incarnation offered to the prefix cache (its hit's included)
    shared_blocks: dict[int, bytes] = field(default_factory=dict)  # position -> key of a cached block it holds
    # beside its own page of the same tokens (another request cached that block first)
    cached_prompt: int | None = None  # prompt tokens its first admission took from the prefix cache
    shared_prefix: int = 0  # tokens of its prefix in cached blocks at its admission (`Hit.shared`)
    grammar_seated: bool = False  # its grammar's matcher is on its slot's last stage (a constrained row went there)
    forced_end: int = 0  # the end of the positions jump-forward wrote last (0 once its caches are gone: prefilled)

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.out

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.out)

    @property
    def to_run(self) -> int:
        """Known positions not yet scheduled (the tokens in flight count as known: their rows take them on the
        device)."""
        return self.length + self.unconfirmed - self.planned

    def tokens(self, start: int, n: int) -> list[int]:
        """ids[start:start + n] without building ids (decode steps ask for the last token only)."""
        p = len(self.prompt)
        if start >= p:
            return self.out[start - p:start - p + n]
        return (self.prompt[start:start + n] + self.out[:max(0, start + n - p)])[:n]

    @property
    def done(self) -> bool:
        return self.finish is not None


@dataclass
class RankBatch:
    """One rank's part of an iteration: its plan for the workers, and per row the request and its incarnation."""
    plan: RankPlan = field(default_factory=RankPlan)
    requests: list[Request] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    saves: list[tuple[int, int, int]] = field(default_factory=list)  # (row, boundary, checkpoint) of plan.saves

    def add_row(self, req: Request, n: int, from_device: bool) -> None:
        """`req`'s row of n positions from req.planned, last in the batch; from_device: its one token is the one an
        iteration in flight samples (0 here, taken on the workers)."""
        plan = self.plan
        plan.tokens += [0] if from_device else req.tokens(req.planned, n)
        plan.from_device.append(from_device)
        plan.slots.append(req.slot)
        plan.starts.append(req.planned)
        plan.counts.append(n)
        plan.counters.append(len(req.out) + req.unconfirmed)
        self.requests.append(req)
        self.epochs.append(req.epoch)


@dataclass
class SchedulerOutput:
    """An iteration as scheduled: every rank's batch (also ranks with nothing to do: they join the EP exchanges),
    the tokens scheduled in all, and the requests preempted to make room."""
    ranks: dict[int, RankBatch]
    total_tokens: int = 0
    preempted: list[int] = field(default_factory=list)

    def plans(self) -> dict[int, RankPlan]:
        return {r: b.plan for r, b in self.ranks.items()}

    @property
    def empty(self) -> bool:
        return not any(b.plan.slots or b.plan.admit for b in self.ranks.values())
