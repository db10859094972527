"""The last stage's grammar matchers (xgrammar), one per state slot: a constrained row's token bitmask is filled
where its token is sampled, so a constrained request needs no round trip through the engine between two tokens
and decodes in every iteration, its rows taking their token on the device (`RankPlan.from_device`) as any other.

A row's `GrammarRow` names its compiled grammar; the first row of a request seated on a slot brings the output so far
(`replay`: a new matcher accepts it), and each later row first accepts the token the slot's last constrained row
sampled (kept here on the host: the last stage reads its sampled tokens back every iteration). A slot seated anew
(`RankPlan.admit`) drops its matcher. Compiled grammars and the tokenizer's description come with the first row
that needs them on this rank; the last `GRAMMARS_HELD` used are kept, as the engine's books say (both see the same
rows in the same order). xgrammar is imported at the first constrained row.
"""
from __future__ import annotations

import torch

from k3ray.model.sampling import HeldGrammars, LogitsRow


class GrammarMasks:
    def __init__(self):
        self.tokenizer = None  # xgrammar TokenizerInfo
        self.compiled = HeldGrammars()  # key -> CompiledGrammar
        self.matchers: dict[int, object] = {}  # slot -> GrammarMatcher
        self.sampled: dict[int, int] = {}  # slot -> the token its last constrained row sampled, not yet accepted

    def seated(self, slots: list[int]) -> None:
        """Slots given to new sequences: their matchers are gone."""
        for slot in slots:
            self.matchers.pop(slot, None)
            self.sampled.pop(slot, None)

    def fill(self, slots: list[int], rows: list[LogitsRow]) -> None:
        """Each constrained row's bitmask (`LogitsRow.mask`) from its slot's matcher; slots: the plan's."""
        for r in rows:
            if r.grammar is not None:
                r.mask = self._next_mask(slots[r.row], r)

    def took(self, slots: list[int], rows: list[LogitsRow], tokens: list[int]) -> None:
        """The tokens the iteration sampled: each constrained row's goes to its slot's matcher before its next mask."""
        for r in rows:
            if r.grammar is not None:
                self.sampled[slots[r.row]] = tokens[r.row]

    def _next_mask(self, slot: int, r: LogitsRow) -> torch.Tensor:
        import xgrammar as xgr

        g = r.grammar
        if g.tokenizer is not None:
            self.tokenizer = xgr.TokenizerInfo.deserialize_json(g.tokenizer)
        compiled = self.compiled.use(g.key, None if g.compiled is None else
                                     lambda: xgr.CompiledGrammar.deserialize_json(g.compiled, self.tokenizer))
        if g.replay is not None:
            if compiled is None:
                raise RuntimeError(f"grammar {g.key} is not held on this stage, and its row did not bring it")
            matcher = self.matchers[slot] = xgr.GrammarMatcher(compiled)
            self.sampled.pop(slot, None)
            for token in g.replay:
                _accept(matcher, token)
        matcher = self.matchers[slot]
        if slot in self.sampled:
            _accept(matcher, self.sampled.pop(slot))
        words = torch.full((1, xgr.get_bitmask_shape(1, self.tokenizer.vocab_size)[1]), -1, dtype=torch.int32)
        if not matcher.is_terminated():  # terminated: a row scheduled before its end-of-text came back (void)
            matcher.fill_next_token_bitmask(words, 0)
        return words[0]


def _accept(matcher, token: int) -> None:
    if not matcher.is_terminated():
        matcher.accept_token(token)
