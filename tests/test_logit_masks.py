"""Grammar bitmasks on the logits (k3ray.model.sampling): `mask_logits` (device ops only) reads the bit layout
xgrammar writes, and `adjust_logits` masks the rows that carry one; on CUDA a masked decode iteration replayed as a
graph (sampling after it) samples what the same iteration run eagerly samples."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3ray.config import load_config
from k3ray.model.cache import SeqAdmit
from k3ray.model.decoder import build_stage
from k3ray.model.sampling import LogitsRow, adjust_logits, mask_logits

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


def _words(allowed_NV: torch.Tensor, width: int) -> torch.Tensor:
    """xgrammar's layout by hand: bit v % 32 of word v // 32 set where token v is allowed."""
    N, V = allowed_NV.shape
    words = torch.zeros(N, width, dtype=torch.int64)
    for n in range(N):
        for v in allowed_NV[n].nonzero().flatten().tolist():
            words[n, v // 32] |= 1 << (v % 32)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # bit 31: the sign of an int32


def test_mask_logits_forbids_what_the_bits_forbid_and_past_the_words():
    g = torch.Generator().manual_seed(0)
    V, N = 100, 4
    logits = torch.randn(N, V, generator=g, dtype=torch.float64)
    allowed = torch.rand(N, V, generator=g) < 0.3
    allowed[:, 31] = allowed[:, 63] = True  # the sign bits of words 0 and 1
    words = _words(allowed[:, :64], 2)  # a tokenizer of 64 tokens under a 100-token model: the rest forbidden
    want = torch.where(allowed & (torch.arange(V) < 64), logits, -torch.inf)
    assert torch.equal(mask_logits(logits, words), want)
    everything = torch.full((N, -(-V // 32)), -1, dtype=torch.int32)  # every bit: a row with no grammar
    assert torch.equal(mask_logits(logits, everything), logits)


def test_adjust_logits_masks_only_the_rows_with_a_mask_and_adds_biases():
    g = torch.Generator().manual_seed(1)
    V = 70
    logits = torch.randn(3, V, generator=g)
    allowed = torch.rand(1, V, generator=g) < 0.5
    words = _words(allowed, -(-V // 32))[0]
    out = adjust_logits(logits, [LogitsRow(1, mask=words), LogitsRow(2, bias_ids=[5, 5], bias=[1.0, 2.0])])
    assert torch.equal(out[0], logits[0])
    assert torch.equal(out[1], torch.where(allowed[0], logits[1], -torch.inf))
    want = logits[2].clone()
    want[5] += 3.0
    assert torch.equal(out[2], want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="decode CUDA graphs need a GPU")
def test_a_masked_decode_iteration_replayed_as_a_graph_samples_what_eager_does():
    from k3ray.parallel.serving import LocalExecutor, PoolSizes, RankPlan

    cfg = load_config(TINY, {"parallel.device": "cuda"}).model
    model = build_stage(cfg, range(cfg.n_layers), device="cuda")
    V, n = cfg.vocab_size, 3
    g = torch.Generator().manual_seed(2)
    allowed = torch.rand(n, V, generator=g) < 0.1
    allowed[:, 7] = True
    words = _words(allowed, -(-V // 32))
    tokens = {}
    for graphs in (False, True):
        ex = LocalExecutor(model, PoolSizes(64, 16, 8), device="cuda", graphs=graphs)
        prompt = [[1, 2, 3], [4, 5], [6]]
        admit = [SeqAdmit(slot=i, pages=[i]) for i in range(n)]
        ex.run({0: RankPlan(slots=list(range(n)), starts=[0] * n, counts=[len(p) for p in prompt],
                            tokens=sum(prompt, []), counters=[0] * n, admit=admit, greedy=True)})
        rows = [LogitsRow(i, mask=words[i]) for i in (0, 2)]  # row 1 unconstrained
        out = ex.run({0: RankPlan(slots=list(range(n)), starts=[len(p) for p in prompt], counts=[1] * n,
                                  tokens=[9, 9, 9], counters=[1] * n, greedy=True, logits=rows)})[0]
        tokens[graphs] = out.tokens
        if graphs:
            assert any(not key[3] for key in ex.server.graphs.graphs), "the masked iteration ran eagerly"
    assert tokens[True] == tokens[False]
    assert allowed[0, tokens[True][0]] and allowed[2, tokens[True][2]]
