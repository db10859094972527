"""The released K3's model features (K3_NOTES, "The K3 model as released"), each against its formula in float64:
KDA's short convolution and lower-bound gate, q-LoRA MLA without RoPE, Block Attention Residuals; the tiny model with
all of them split into pipeline stages equals the whole model. Ray-free."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import RELEASED
from k3ray.config import load_config
from k3ray.kernels import kda_gate, short_conv
from k3ray.kernels.kda import kda_recurrent_reference
from k3ray.model.decoder import boundary_shape, build_stage
from k3ray.model.layers import KDA, AttnResRead, GatedMLA, _AttnResMix, attn_res_mix

D = torch.float64


@pytest.fixture(scope="module")
def cfg():
    return load_config("configs/tiny.yaml", {**RELEASED, "model.dtype": "float64"}).model


def test_short_conv_matches_direct_formula_and_carries_state():
    """y_t = silu(sum_j w[:, j] x_{t-W+1+j}), zeros before the sequence; a sequence cut in two, the second part started
    from the first's state, gives the same outputs; packed sequences (cu_seqlens) do not see each other."""
    g = torch.Generator().manual_seed(0)
    T, C, W = 11, 6, 4
    x, w = torch.randn(1, T, C, generator=g, dtype=D), torch.randn(C, W, generator=g, dtype=D)
    padded = torch.cat([torch.zeros(W - 1, C, dtype=D), x[0]])
    want = torch.stack([F.silu((w * padded[t:t + W].T).sum(-1)) for t in range(T)])[None]
    y, state = short_conv(x, w, output_final_state=True)
    torch.testing.assert_close(y, want, rtol=0, atol=1e-14)
    torch.testing.assert_close(state, x[:, -(W - 1):])
    y1, s1 = short_conv(x[:, :5], w, output_final_state=True)
    y2, _ = short_conv(x[:, 5:], w, s1, output_final_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), want, rtol=0, atol=1e-14)
    y_short, s_short = short_conv(x[:, :2], w, output_final_state=True)  # shorter than the kernel
    torch.testing.assert_close(s_short[0], torch.cat([torch.zeros(1, C, dtype=D), x[0, :2]]))
    cu = torch.tensor([0, 5, T])
    packed, states = short_conv(x, w, torch.zeros(2, W - 1, C, dtype=D), output_final_state=True, cu_seqlens=cu)
    torch.testing.assert_close(packed[:, :5], y1)
    torch.testing.assert_close(packed[:, 5:], short_conv(x[:, 5:], w)[0])
    torch.testing.assert_close(states[1], x[0, -(W - 1):])


def test_kda_gate_matches_direct_formula():
    """log a = lb * sigmoid(exp(A_log) (raw + dt_bias)) in (lb, 0); without a bound -exp(A_log) softplus(...)."""
    g = torch.Generator().manual_seed(1)
    H, K = 3, 4
    raw = 4 * torch.randn(2, 5, H, K, generator=g, dtype=D)
    A_log, dt_bias = torch.randn(H, generator=g, dtype=D), torch.randn(H * K, generator=g, dtype=D)
    z = raw + dt_bias.view(H, K)
    for h in range(H):
        a = math.exp(A_log[h])
        bounded = kda_gate(raw, A_log, dt_bias, -5.0)[..., h, :]
        torch.testing.assert_close(bounded, -5.0 / (1 + torch.exp(-a * z[..., h, :])), rtol=0, atol=1e-14)
        free = kda_gate(raw, A_log, dt_bias)[..., h, :]
        torch.testing.assert_close(free, -a * torch.log1p(torch.exp(z[..., h, :])), rtol=0, atol=1e-13)
    bounded = kda_gate(raw, A_log, dt_bias, -5.0)
    assert bool(((bounded > -5) & (bounded < 0)).all())


def test_attn_res_matches_direct_formula():
    """h = sum_n softmax_n(w . RMSNorm(v_n)) v_n per token; a zero pseudo-query (the initialisation) averages."""
    g = torch.Generator().manual_seed(2)
    N, B, S, d = 3, 2, 4, 8
    v = torch.randn(N, B, S, d, generator=g, dtype=D)
    w, nw = torch.randn(d, generator=g, dtype=D), 1 + torch.rand(d, generator=g, dtype=D)
    eps = 1e-5
    want = torch.empty(B, S, d, dtype=D)
    for b in range(B):
        for s in range(S):
            logits = [float(w @ (v[n, b, s] / torch.sqrt(v[n, b, s].pow(2).mean() + eps) * nw)) for n in range(N)]
            e = [math.exp(x - max(logits)) for x in logits]
            want[b, s] = sum(e[n] / sum(e) * v[n, b, s] for n in range(N))
    torch.testing.assert_close(attn_res_mix(v, w, nw, eps), want, rtol=0, atol=1e-13)
    read = AttnResRead(d, eps).to(D)
    torch.nn.init.zeros_(read.proj.weight)
    torch.testing.assert_close(read(list(v)), v.mean(0))


def test_attn_res_in_bf16_has_fp32_scores_and_exact_gradients():
    """The bf16 read (_AttnResMix: the norm folded into the score, explicit backward) is the formula's derivative
    (gradcheck in float64), and in bf16 it stays within bf16 rounding of the float64 read, for the pseudo-query's and
    the norm's gradients too when the values are alike (their depth softmax gradient sums to zero: bf16 keys leaked
    the values' common part into those sums, a few percent)."""
    g = torch.Generator().manual_seed(5)
    N, B, S, d, eps = 3, 2, 5, 8, 1e-5
    args = (torch.randn(N, B, S, d, generator=g, dtype=D, requires_grad=True),
            torch.randn(d, generator=g, dtype=D, requires_grad=True),
            (1 + torch.rand(d, generator=g, dtype=D)).requires_grad_(True))
    assert torch.autograd.gradcheck(lambda v, w, nw: _AttnResMix.apply(v, w, nw, eps), args)
    torch.testing.assert_close(_AttnResMix.apply(*args, eps), attn_res_mix(*args, eps), rtol=0, atol=1e-14)

    N, S, d = 3, 64, 256
    common = torch.randn(1, B, S, d, generator=g, dtype=D)
    for spread in (1.0, 0.05):
        v = (common + spread * torch.randn(N, B, S, d, generator=g, dtype=D)).to(torch.bfloat16)
        w = (0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)
        nw = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)
        dh = torch.randn(B, S, d, generator=g, dtype=D)
        outs = {}
        for dt in (D, torch.bfloat16):
            leaves = [t.to(dt).requires_grad_(True) for t in (v, w, nw)]
            h = attn_res_mix(*leaves, eps)
            assert h.dtype == dt
            outs[dt] = [h.detach()] + list(torch.autograd.grad(h, leaves, dh.to(dt)))
        for got, want in zip(outs[torch.bfloat16], outs[D]):  # h, dv, dw, dnw
            assert float((got.double() - want).norm() / want.norm()) < 5e-3


def test_qlora_mla_without_rope_matches_direct_formula(cfg):
    """q = W_q_up RMSNorm(W_q_down x); [c | k_p] = W_dkv x; [k_n | v] = W_ukv RMSNorm(c) per head; k = [k_n | k_p]
    (k_p shared by the heads, unrotated); causal softmax(q k^T / sqrt(h + p)) v; W_o(o * sigmoid(W_g x))."""
    torch.manual_seed(3)
    mla = GatedMLA(cfg).to(D)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.3)
    B, S, H, h, p, r = 2, 7, cfg.n_heads, cfg.head_dim, cfg.mla_rope_dim, cfg.kv_rank
    x = torch.randn(B, S, cfg.d_model, dtype=D)

    def rms(t, wt):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * wt

    q = (rms(x @ mla.w_q_down.weight.T, mla.q_norm.weight) @ mla.w_q_up.weight.T).view(B, S, H, h + p)
    ckv = x @ mla.w_dkv.weight.T
    c, k_p = rms(ckv[..., :r], mla.kv_norm.weight), ckv[..., r:]
    kv = (c @ mla.w_ukv.weight.T).view(B, S, H, 2 * h)
    k = torch.cat([kv[..., :h], k_p[:, :, None].expand(B, S, H, p)], -1)
    scores = torch.einsum("bihe,bjhe->bhij", q, k) / math.sqrt(h + p)
    scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("bhij,bjhe->bihe", scores.softmax(-1), kv[..., h:]).flatten(2)
    want = (o * torch.sigmoid(x @ mla.w_g.weight.T)) @ mla.w_o.weight.T
    torch.testing.assert_close(mla(x), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("rotate", [False, True])
def test_mla_without_rope_scores_ignore_positions(cfg, rotate):
    """Same tokens, only their positions permuted (and shifted): without RoPE no MLA score changes, because position
    enters MLA nowhere but the causal mask (the 64-wide slice is kept unrotated; KDA's recurrence carries position).
    With RoPE on the slice (the control) the scores do change."""
    c = cfg.model_copy(update={"mla_rope": rotate})
    torch.manual_seed(4)
    mla = GatedMLA(c).to(D)
    for p in mla.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, 9, c.d_model, dtype=D)

    def scores(pos):
        k, _ = mla.up(mla.latent(x), pos)
        return torch.einsum("bihe,bjhe->bhij", mla.queries(x, pos), k)

    base, moved = scores(torch.arange(9)), scores(torch.randperm(9, generator=torch.Generator().manual_seed(0)) + 50)
    if rotate:
        assert not torch.allclose(base, moved)
    else:
        torch.testing.assert_close(base, moved, rtol=0, atol=0)


def test_kda_layer_is_conv_gate_and_recurrence(cfg):
    """The released KDA layer composes its parts as the formula says: q, k, v = SiLU(conv(W x)), q and k normalised,
    q scaled by K^-1/2, the lower-bound gate, beta = sigmoid(W_b x), per-head RMSNorm times sigmoid(W_g x), W_o."""
    torch.manual_seed(5)
    kda = KDA(cfg).to(D)
    for p in kda.parameters():
        torch.nn.init.normal_(p, std=0.3)
    B, S, H, K = 2, 6, cfg.n_heads, cfg.kda_head_dim
    x = torch.randn(B, S, cfg.d_model, dtype=D)
    W = cfg.kda_conv_size

    def conv(t, w):  # w [C, 1, W]
        full = torch.cat([torch.zeros(B, W - 1, t.shape[-1], dtype=D), t], 1)
        return F.silu(torch.stack([(full[:, s:s + W] * w[:, 0].T).sum(1) for s in range(S)], 1))

    q = F.normalize(conv(x @ kda.w_q.weight.T, kda.q_conv.weight).view(B, S, H, K), dim=-1) / math.sqrt(K)
    k = F.normalize(conv(x @ kda.w_k.weight.T, kda.k_conv.weight).view(B, S, H, K), dim=-1)
    v = conv(x @ kda.w_v.weight.T, kda.v_conv.weight).view(B, S, H, K)
    raw = (x @ kda.w_a_down.weight.T @ kda.w_a_up.weight.T).view(B, S, H, K) + kda.dt_bias.view(H, K)
    g = -5 * torch.sigmoid(kda.A_log.exp()[:, None] * raw)
    beta = torch.sigmoid(x @ kda.w_b.weight.T)
    o, _ = kda_recurrent_reference(q, k, v, g, beta)
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * kda.o_norm.weight
    want = (o.flatten(2) * torch.sigmoid(x @ kda.w_g.weight.T)) @ kda.w_o.weight.T
    torch.testing.assert_close(kda(x), want, rtol=0, atol=1e-11)


def test_stages_with_attn_res_equal_the_whole_model(cfg):
    """Split after layer 2 (pp=2), the second stage receives the partial block and one block summary
    ([2, B, S, d]) and the two stages compute the whole model's logits, forward and backward."""
    whole = build_stage(cfg, range(4), seed=7)
    first, second = build_stage(cfg, range(0, 2), seed=7), build_stage(cfg, range(2, 4), seed=7)
    tokens = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    hidden = first(tokens)
    assert hidden.shape == boundary_shape(cfg, 2, 2, 20) == (2, 2, 20, cfg.d_model)
    torch.testing.assert_close(second(hidden), whole(tokens), rtol=0, atol=1e-12)
    whole(tokens).square().mean().backward()
    second(first(tokens)).square().mean().backward()
    grads = {n: p.grad for n, p in [*first.named_parameters(), *second.named_parameters()] if p.grad is not None}
    for name, p in whole.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_released_structure(cfg):
    """Layer 0 carries the dense FFN (no experts), layers 1-3 the MoE; MLA where listed; AttnRes reads per layer and
    before the final norm."""
    stage = build_stage(cfg, range(4))
    assert sorted(stage.moe_layers()) == [1, 2, 3] and sorted(stage.expert_shards()) == [1, 2, 3]
    assert stage.blocks["0"].moe is None and stage.blocks["0"].ffn.w_gate.weight.shape == (96, cfg.d_model)
    assert [type(b.attn).__name__ for b in stage.blocks.values()] == ["KDA", "GatedMLA", "KDA", "GatedMLA"]
    names = dict(stage.named_parameters())
    assert names["blocks.1.attn.w_dkv.weight"].shape == (cfg.kv_rank + cfg.mla_rope_dim, cfg.d_model)
    assert names["blocks.0.attn.q_conv.weight"].shape == (cfg.n_heads * cfg.kda_head_dim, 1, 4)
    assert "output_res.proj.weight" in names and "blocks.3.ffn_res.norm.weight" in names
    assert float(names["blocks.2.attn_res.proj.weight"].detach().abs().sum()) == 0  # uniform mix at start


def test_serving_stages_with_attn_res_equal_the_whole_model(cfg):
    """Serving split after layer 2: each stage keeps its own caches (KDA state and convolution state, MLA latents);
    the block summaries go with the hidden state to the next stage. A prefill chunk, then two decode steps, give the
    whole model's logits."""
    from k3ray.model.cache import IterationCache, SeqAdmit, new_pools

    whole = build_stage(cfg, range(4), seed=7)
    first, second = build_stage(cfg, range(0, 2), seed=7), build_stage(cfg, range(2, 4), seed=7)
    pools = {name: new_pools(cfg, stage.layers, 8, 4, 2) for name, stage in
             [("whole", whole), ("first", first), ("second", second)]}
    for p in pools.values():
        p.admit([SeqAdmit(slot=1, pages=[0, 1, 2])])
    tokens = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))

    def cache(name: str, start: int, n: int) -> IterationCache:
        return IterationCache.from_plan(pools[name], [1], [start], [n], "cpu")

    for start, n in [(0, 7), (7, 1), (8, 1)]:
        x = tokens[:, start:start + n]
        want = whole(x, cache("whole", start, n))
        hidden = first(x, cache("first", start, n))
        assert hidden.shape == boundary_shape(cfg, 2, 1, n)
        torch.testing.assert_close(second(hidden, cache("second", start, n)), want, rtol=0, atol=1e-12)
    full = whole(tokens)[0, -1]
    torch.testing.assert_close(want[0], full, rtol=0, atol=1e-10)


def test_document_masking_keeps_each_packed_document_to_itself(cfg):
    """With document masking (data.document_masking) a document packed after another in a row is computed as if it
    began the row: MLA attends within it, KDA's recurrence and convolution restart at it (the released model has no
    positions to reset: MLA carries no RoPE). Split over two stages it equals the whole model."""
    from k3ray.model.layers import Documents

    eos = 0
    gen = torch.Generator().manual_seed(4)
    doc1, doc2 = torch.randint(1, cfg.vocab_size, (1, 9), generator=gen), torch.randint(1, cfg.vocab_size, (1, 12),
                                                                                       generator=gen)
    row = torch.cat([doc1, torch.zeros(1, 1, dtype=torch.int64), doc2], dim=1)  # doc1, end-of-text, doc2
    other = torch.cat([torch.randint(1, cfg.vocab_size, (1, 9), generator=gen), row[:, 9:]], dim=1)
    docs = Documents(torch.cat([row, other]), eos)
    assert docs.cu_seqlens.tolist() == [0, 10, 22, 32, 44]
    assert docs.mask[0, 0, 10, :10].any().item() is False and docs.mask[0, 0, 10, 10].item() is True
    whole = build_stage(cfg, range(4), seed=2)
    both = whole(torch.cat([row, other]), documents=docs)
    alone = whole(doc2)
    torch.testing.assert_close(both[0, 10:], alone[0], rtol=0, atol=1e-10)
    torch.testing.assert_close(both[1, 10:], alone[0], rtol=0, atol=1e-10)  # the first document does not matter
    unmasked = whole(row)
    assert not torch.allclose(unmasked[0, 10:], alone[0], atol=1e-6)  # without masking it does
    first, second = build_stage(cfg, range(0, 2), seed=2), build_stage(cfg, range(2, 4), seed=2)
    split = second(first(torch.cat([row, other]), documents=docs), documents=docs)
    torch.testing.assert_close(split, both, rtol=0, atol=1e-12)
