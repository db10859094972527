"""MLA attention of a serving iteration split by phase (k3ray.model.serving_attention): a prompt row's causal
attention over its context (bottom-right aligned) by torch's fused attention, its blockwise log-sum-exp form for long
contexts, and a mixed iteration (decode rows absorbed, prompt rows not) equal to each row attended alone. float64."""
from __future__ import annotations

import pytest
import torch

from conftest import RELEASED
from k3ray import kernels
from k3ray.config import load_config
from k3ray.model import serving_attention
from k3ray.model.cache import IterationCache, SeqAdmit, StateSave, new_pools
from k3ray.model.decoder import build_stage
from k3ray.model.serving_attention import blockwise_attention, segment_attention


def plain_causal(q_nHe, k_LHe, v_LHh, scale):
    """The definition: query t (position L - n + t) attends to keys 0..L - n + t."""
    n, L = q_nHe.shape[0], k_LHe.shape[0]
    s = torch.einsum("nhe,lhe->hnl", q_nHe, k_LHe) * scale
    mask = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]
    p = torch.softmax(s.masked_fill(~mask, -torch.inf), dim=-1)
    return torch.einsum("hnl,lhd->nhd", p, v_LHh)


@pytest.mark.parametrize("n,L,chunk,block", [(5, 5, 2, 2), (7, 30, 8, 3), (1, 17, 4, 4), (12, 40, 64, 5)])
def test_segment_and_blockwise_attention_equal_the_definition(n, L, chunk, block):
    g = torch.Generator().manual_seed(n * L)
    q, k = torch.randn(n, 3, 10, generator=g, dtype=torch.float64), torch.randn(L, 3, 10, generator=g,
                                                                             dtype=torch.float64)
    v = torch.randn(L, 3, 6, generator=g, dtype=torch.float64)
    want = plain_causal(q, k, v, 0.3)
    torch.testing.assert_close(segment_attention(q, k, v, 0.3), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(blockwise_attention(q, k, v, 0.3, chunk, block), want, rtol=0, atol=1e-12)


CUDA_BF16 = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))


@pytest.mark.parametrize("device", ["cpu", CUDA_BF16])
@pytest.mark.parametrize("rope", [False, True], ids=["absorbed", "rope"])
def test_a_mixed_iteration_equals_each_row_alone(monkeypatch, rope, device):
    """Two decode rows and two prompt chunks (one continuing a cached prefix) in one iteration give the outputs each
    row gives in an iteration of its own (every released feature on: KDA's convolution state too); a tiny
    PREFIX_CHUNK (the blockwise form) or PROMPT_CONTEXT_GROUP (a row an attention call) changes nothing. float64 on
    the CPU; on a GPU in bf16 (the kernels serving runs: fla's decode and prefill, flash over packed segments),
    within bf16's rounding of the logits (a decoupled slice of 8: q's width 24, which flash takes)."""
    dtype = "float64" if device == "cpu" else "bfloat16"
    cfg = load_config("configs/tiny.yaml", {"model.dtype": dtype, **RELEASED, "model.mla_rope": rope,
                                            "model.mla_rope_dim": 8}).model
    stage = build_stage(cfg, range(cfg.n_layers), seed=2, device=device)
    g = torch.Generator().manual_seed(0)
    prefix = {s: torch.randint(0, cfg.vocab_size, (1, 9), generator=g).to(device) for s in range(4)}
    tol = {"rtol": 0, "atol": 1e-10} if device == "cpu" else {"rtol": 5e-2, "atol": 5e-2}

    def pools():
        p = new_pools(cfg, stage.layers, 32, 4, 4, device=device)
        p.admit([SeqAdmit(s, list(range(8 * s, 8 * s + 8))) for s in range(4)])
        for s in (0, 1, 3):  # slots 0, 1 decode after 9 cached tokens; slot 3 prefills on after 9; slot 2 is new
            stage(prefix[s], IterationCache.from_plan(p, [s], [0], [9], device))
        return p

    rows = [(0, 9, 1), (2, 0, 7), (1, 9, 1), (3, 9, 6)]  # (slot, start, count)
    new = {s: torch.randint(0, cfg.vocab_size, (1, c), generator=g).to(device) for s, _, c in rows}
    with torch.no_grad():
        alone = {}
        for s, start, c in rows:
            p = pools()
            alone[s] = stage(new[s], IterationCache.from_plan(p, [s], [start], [c], device))
        x = torch.cat([new[s] for s, _, _ in rows], dim=1)
        # the blockwise form (a tiny PREFIX_CHUNK), and the prompt rows in attention calls of a row each
        for chunk, group in ((serving_attention.PREFIX_CHUNK, serving_attention.PROMPT_CONTEXT_GROUP), (3, 10)):
            monkeypatch.setattr(serving_attention, "PREFIX_CHUNK", chunk)
            monkeypatch.setattr(serving_attention, "PROMPT_CONTEXT_GROUP", group)
            p = pools()
            cache = IterationCache.from_plan(p, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                                             device)
            assert cache.prompt is not None and cache.decode_rows.tolist() == [0, 2]
            assert [s.counts for s in cache.prompt.segments] == ([[7, 6]] if group > 15 else [[7], [6]])
            got = stage(x, cache)  # logits of each row's last token [N, V]
            for i, (s, _, _) in enumerate(rows):
                torch.testing.assert_close(got[i].double(), alone[s][0].double(), **tol)


def test_a_padded_prefill_iteration_changes_no_row_and_counts_no_padding_route():
    """An iteration with prompt rows runs a multiple of the server's prefill bucket of tokens (a padding row of the
    scratch slot; PREFILL_TOKEN_BUCKET on a GPU, none on a CPU): its rows' tokens, activations, KDA states, latents
    and checkpoints, and the experts' served load, equal those of the same iteration unpadded; the padding row's
    outputs are dropped. float64, every released feature."""
    from k3ray.parallel.serving import PREFILL_TOKEN_BUCKET, RankPlan, StageServer

    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64", **RELEASED}).model
    stage = build_stage(cfg, range(cfg.n_layers), seed=3)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (13,), generator=g).tolist()

    def run(bucket: int):
        pools = new_pools(cfg, stage.layers, 32, 4, 4, checkpoints=2)
        server = StageServer(stage, pools, "cpu", graphs=False)
        assert server.prefill_bucket == 1  # the CPU's
        server.prefill_bucket = bucket
        first = server.step(RankPlan([0], [0], [5], prompt[:5], [0], admit=[SeqAdmit(0, [0, 1, 2, 3])]))
        assert first.path == "prompt eager"  # how the worker ran it (the engine's breakdown of the workers' time)
        # a decode row beside a prompt row that saves its state inside and at its end (the prefix cache)
        plan = RankPlan([0, 1], [5, 0], [1, 13], [first.tokens[0], *prompt], [1, 0], admit=[SeqAdmit(1, [4, 5, 6, 7])],
                        saves=[StateSave(1, 8, 0), StateSave(1, 13, 1)])
        out = server.step(plan)
        assert out.path == "prompt eager, saves inside rows"
        return out, pools

    (want, p1), (got, p64) = run(1), run(PREFILL_TOKEN_BUCKET)
    assert got.tokens == want.tokens
    torch.testing.assert_close(torch.tensor(got.maxabs), torch.tensor(want.maxabs), rtol=1e-12, atol=0)
    for name in ("state", "conv", "checkpoint_state", "checkpoint_conv", "load"):
        real = slice(0, p1.slots) if name in ("state", "conv") else slice(None)  # the scratch slot aside
        for layer, t in getattr(p1, name).items():
            torch.testing.assert_close(getattr(p64, name)[layer][real], t[real], rtol=0, atol=1e-12)
    for layer, t in p1.latent.items():  # every page but the scratch one
        torch.testing.assert_close(p64.latent[layer][:-1], t[:-1], rtol=0, atol=1e-12)
    assert sum(int(t.sum()) for t in p64.load.values()) == sum(int(t.sum()) for t in p1.load.values()) > 0


@pytest.mark.parametrize("start", [0, 5])
def test_states_saved_inside_a_row_are_those_after_its_first_tokens(start):
    """A save after a row's first n new tokens (n below and above the convolution's W-1, where the prefill kernel's
    chunks start and inside them, from a fresh slot and after cached tokens) checkpoints the KDA states and
    convolution tails that prefilling only those n tokens leaves in the slot. float64, every released feature."""
    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64", **RELEASED}).model
    stage = build_stage(cfg, range(cfg.n_layers), seed=4)
    g = torch.Generator().manual_seed(2)
    chunk = kernels.kda_state_chunk("cpu")
    tokens = torch.randint(0, cfg.vocab_size, (1, start + 2 * chunk + 9), generator=g)
    # below, at the edge of and past W-1 = 3; at chunk starts (their states read from the chunked pass) and in chunks
    offsets = [1, 2, 7, chunk, chunk + 5, 2 * chunk]
    with torch.no_grad():
        def pools():
            p = new_pools(cfg, stage.layers, 32, 4, 2, checkpoints=len(offsets))
            p.admit([SeqAdmit(0, list(range(-(-tokens.shape[1] // 4))))])
            if start:
                stage(tokens[:, :start], IterationCache.from_plan(p, [0], [0], [start], "cpu"))
            return p

        p = pools()
        saves = [StateSave(0, n, i) for i, n in enumerate(offsets)]
        stage(tokens[:, start:], IterationCache.from_plan(p, [0], [start], [tokens.shape[1] - start], "cpu",
                                                          saves=saves))
        for i, n in enumerate(offsets):
            alone = pools()
            stage(tokens[:, start:start + n], IterationCache.from_plan(alone, [0], [start], [n], "cpu"))
            for layer in alone.state:
                torch.testing.assert_close(p.checkpoint_state[layer][i], alone.state[layer][0], rtol=0, atol=1e-12)
                torch.testing.assert_close(p.checkpoint_conv[layer][i], alone.conv[layer][0], rtol=0, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available() or serving_attention.varlen_attention() is None,
                    reason="flash attention over packed segments needs a GPU")
def test_prompt_rows_in_one_flash_call_equal_a_call_a_row(monkeypatch):
    """The prompt rows of an iteration in one call of flash attention over packed segments (each row's new tokens
    over its context, bottom-right causal; contexts up-projected together) give what a fused call a row gives, at
    gpu2's released MLA shape in bf16 (rows of 1 to 300 new tokens, contexts cached or not; one group and three)."""
    from k3ray.model.layers import GatedMLA

    cfg = load_config("configs/gpu2.yaml", {"model.q_lora_rank": 1024, "model.mla_rope_dim": 64}).model
    torch.manual_seed(0)
    mla = GatedMLA(cfg).to("cuda", torch.bfloat16)
    rows = [(7, 7), (300, 1800), (1, 40), (64, 64), (129, 2100)]  # (new tokens, context)
    counts, lengths = [n for n, _ in rows], [L for _, L in rows]
    q = torch.randn(sum(counts), cfg.n_heads, cfg.head_dim + cfg.mla_rope_dim, device="cuda", dtype=torch.bfloat16)
    lat = torch.randn(sum(lengths), cfg.kv_rank + cfg.mla_rope_dim, device="cuda", dtype=torch.bfloat16)
    for group in (serving_attention.PROMPT_CONTEXT_GROUP, 2000):
        monkeypatch.setattr(serving_attention, "PROMPT_CONTEXT_GROUP", group)
        cu = torch.tensor(serving_attention.segment_offsets(counts, lengths), device="cuda", dtype=torch.int32)
        segments = serving_attention.prompt_segments(counts, lengths, cu)
        assert len(segments) == (1 if group > 5000 else 3)
        with torch.no_grad():
            got = torch.cat([serving_attention.prompt_rows_attention_varlen(q[s.queries], lat[s.contexts], s, mla)
                             for s in segments])
            want = torch.cat([serving_attention.prompt_rows_attention_reference(q[s.queries], lat[s.contexts], s,
                                                                                mla) for s in segments])
        assert got.shape == want.shape == (sum(counts), cfg.n_heads, cfg.head_dim)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
