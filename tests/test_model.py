"""Model maths: LatentMoE gradients (float64 finite differences) and latent-width routing, Quantile Balancing
against the sign update on a skewed synthetic router, bias-independent combine weights, and KDA's recurrence.
SiTU-GLU is covered by tests/test_kernels.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import functional_call

from k3ray.config import load_config
from k3ray.model.balancing import quantile_bias, quantile_histogram, select_experts, sign_bias
from k3ray.model.decoder import build_stage, new_shard
from k3ray.kernels import score_histogram
from k3ray.kernels.kda import kda_recurrent_reference
from k3ray.model.moe import LatentMoE, LocalExperts
from k3ray.policies.moonep import maxvio

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"

SMALL_F64 = {"model.dtype": "float64", "model.d_model": 16, "model.d_latent": 8, "model.n_experts": 8,
             "model.top_k": 2, "model.expert_inner": 8, "model.shared_inner": 16, "model.n_shared": 1}


def _small_moe(seed: int = 0) -> LatentMoE:
    cfg = load_config(TINY, SMALL_F64).model
    torch.manual_seed(seed)
    moe = LatentMoE(cfg, LocalExperts(new_shard(cfg, list(range(cfg.n_experts))))).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            fan_in = p.shape[-2] if p.dim() == 3 else p.shape[-1]
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / fan_in ** 0.5)
        moe.router.bias.copy_(torch.randn(cfg.n_experts, generator=g) * 0.05)  # a fixed, non-zero bias
    return moe


def _routing_margin(moe: LatentMoE, x: torch.Tensor) -> float:
    """Smallest gap between the k-th and (k+1)-th biased score over the tokens: the selection cannot change under
    perturbations much smaller than this."""
    with torch.no_grad():
        biased = moe.router(x) + moe.router.bias
        top = torch.topk(biased, moe.cfg.top_k + 1, dim=-1).values
    return float((top[:, -2] - top[:, -1]).min())


def test_latent_moe_gradients_match_finite_differences():
    moe = _small_moe()
    cfg = moe.cfg
    # a deterministic input whose routing has a clear margin: FD steps (1e-6) cannot flip a top-k choice
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        x = torch.randn(2, 3, cfg.d_model, generator=g, dtype=torch.float64)
        if _routing_margin(moe, x.view(-1, cfg.d_model)) > 1e-3:
            break
    assert _routing_margin(moe, x.view(-1, cfg.d_model)) > 1e-3
    names = ["router.weight", "w_down.weight", "w_up.weight", "experts.shard.w2"]
    params = dict(moe.named_parameters())
    weights = tuple(params[n].detach().clone().requires_grad_(True) for n in names)

    def f(x_in, *ws):
        return functional_call(moe, {**params, **dict(zip(names, ws))}, (x_in,))

    x = x.requires_grad_(True)
    idx_before = select_experts(moe.router(x.view(-1, cfg.d_model)), moe.router.bias, cfg.top_k)[0]
    assert torch.autograd.gradcheck(f, (x, *weights), eps=1e-6, atol=1e-6, rtol=1e-5)
    idx_after = select_experts(moe.router(x.view(-1, cfg.d_model)), moe.router.bias, cfg.top_k)[0]
    assert torch.equal(idx_before, idx_after)


def test_routed_tensors_have_latent_width():
    cfg = load_config(TINY).model
    stage = build_stage(cfg, range(cfg.n_layers))
    seen_in, seen_out = [], []
    for moe in stage.moe_layers().values():
        assert moe.w_down.out_features == cfg.d_latent
        assert moe.w_up.in_features == cfg.d_latent and moe.w_up.out_features == cfg.d_model
        moe.experts.register_forward_pre_hook(lambda m, args: seen_in.append(args[0].shape))
        moe.experts.register_forward_hook(lambda m, args, out: seen_out.append(out.shape))
    with torch.no_grad():
        stage(torch.randint(0, cfg.vocab_size, (2, 8)))
    assert len(seen_in) == len(seen_out) == cfg.n_layers
    assert all(s == (16, cfg.d_latent) for s in seen_in)
    assert all(s == (16, cfg.d_latent) for s in seen_out)
    assert cfg.d_latent == cfg.d_model // 2


# ---------------------------------------------------------------------------------------------------------------------
# Quantile Balancing vs the sign update on a strongly skewed synthetic router

E, K = 64, 4
SKEW = torch.linspace(2.5, -2.5, E)  # expert 0 hottest


def _scores(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.sigmoid(torch.randn(tokens, E, generator=g) + SKEW)


def _load(scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    idx, _ = select_experts(scores, bias, K)
    return torch.bincount(idx.reshape(-1), minlength=E)


def test_quantile_balancing_beats_sign_update_on_skewed_router():
    fresh = _scores(32768, seed=10_000)
    unbalanced = _load(fresh, torch.zeros(E))
    # the skew is strong: without balancing a quarter of the experts take over half of the routes
    assert unbalanced.sort(descending=True).values[: E // 4].sum() > 0.5 * unbalanced.sum()
    assert maxvio(unbalanced) > 3.0
    b_quantile, b_sign = torch.zeros(E), torch.zeros(E)
    updates = 20
    for step in range(updates):
        batch = _scores(65536, seed=step)
        hist = quantile_histogram(batch, b_quantile, K, bins=1000, window=2.0, resolution=1e-5)
        b_quantile = quantile_bias(hist, b_quantile, K, window=2.0, resolution=1e-5)
        b_sign = sign_bias(_load(batch, b_sign), b_sign, rate=1e-3)
    vio_quantile = maxvio(_load(fresh, b_quantile))
    vio_sign = maxvio(_load(fresh, b_sign))
    assert vio_quantile < 0.10, vio_quantile
    assert vio_quantile < vio_sign
    assert abs(float(b_quantile.mean())) < 1e-5  # centred


def _saturated_scores(tokens: int, seed: int, logit_std: float = 10.0) -> torch.Tensor:
    """A trained router's sigmoid scores: logits of std 10 with per-expert offsets, so many scores sit near 1 and
    the margins of most tokens at the top-k boundary are within 1e-3 of each other."""
    g = torch.Generator().manual_seed(7)
    w, offset = torch.randn(64, 32, generator=g) * logit_std / 32 ** 0.5, torch.randn(64, generator=g) * 3
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(seed))
    return torch.sigmoid(x @ w.T + offset)


def test_quantile_balancing_reads_margins_of_saturated_scores():
    """64 experts, top-8, 16,384 tokens per step (gpu2's): with saturated scores the margins near the boundary are
    far finer than 1000 even bins over [-0.5, 0.5] resolve (bins 1e-3 wide): the even histogram leaves MaxVio near 1
    (what gpu2 showed), the log-spaced one balances fresh batches to the sampling noise (~0.06)."""
    k, E64 = 8, 64
    margins = _saturated_scores(16384, 0)
    top = torch.topk(margins, k + 1, dim=-1).values
    assert float((top[:, k - 1] - top[:, k]).median()) < 1e-3

    def even_update(scores, b):
        biased = scores + b
        return _even_quantile_bias(biased - torch.topk(biased, k + 1, dim=-1).values[:, k:k + 1], b, k)

    b_log, b_even = torch.zeros(E64), torch.zeros(E64)
    for step in range(25):
        batch = _saturated_scores(16384, 1 + step)
        b_log = quantile_bias(quantile_histogram(batch, b_log, k, 1000, 2.0, 1e-5), b_log, k, 2.0, 1e-5)
        b_even = even_update(batch, b_even)
    fresh = _saturated_scores(16384, 999)
    load_log = torch.bincount(select_experts(fresh, b_log, k)[0].reshape(-1), minlength=E64)
    load_even = torch.bincount(select_experts(fresh, b_even, k)[0].reshape(-1), minlength=E64)
    assert maxvio(load_log) < 0.12, maxvio(load_log)
    assert maxvio(load_even) > 0.5, maxvio(load_even)


def _even_quantile_bias(margins: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """The former update: the quantile of the margins from 1000 even bins over [-0.5, 0.5], linearly interpolated."""
    counts = score_histogram(margins, -0.5, 0.5, 1000).double()
    target = counts[0].sum() * k / counts.shape[0]
    above = torch.cat([counts.flip(1).cumsum(1).flip(1), counts.new_zeros(counts.shape[0], 1)], dim=1)
    i = ((above[:, :1000] >= target).sum(1) - 1).clamp(0, 999)
    in_bin = counts.gather(1, i[:, None]).squeeze(1)
    frac = ((target - above.gather(1, (i + 1)[:, None]).squeeze(1)) / in_bin.clamp(min=1)).clamp(0, 1)
    b_hat = b.double() - (-0.5 + (i.double() + 1 - frac) * 1e-3)
    return (b_hat - b_hat.mean()).float()


def test_quantile_balancing_moves_past_the_former_window():
    """Margins outside [-0.5, 0.5]: an expert nobody picks (its scores 0.9 below everyone's) needs a bias about 0.9 above the others;
    one update on the batch itself balances it (the former window clamped the move at 0.5)."""
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(8192, 16, generator=g) * 0.1 + 0.9
    scores[:, 0] -= 0.9
    b = quantile_bias(quantile_histogram(scores, torch.zeros(16), 4, 1000, 2.0, 1e-5), torch.zeros(16), 4, 2.0, 1e-5)
    assert float(b[0] - b[1:].mean()) > 0.8  # beyond the former window
    load = torch.bincount(select_experts(scores, b, 4)[0].reshape(-1), minlength=16)
    assert maxvio(load) < 0.05, maxvio(load)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bias_scale=st.sampled_from([0.0, 1e-3, 0.1, 1.0, 10.0]),
       tokens=st.integers(1, 40), experts=st.integers(3, 32), data=st.data())
def test_bias_never_changes_combine_weights(seed, bias_scale, tokens, experts, data):
    top_k = data.draw(st.integers(1, experts - 1))
    g = torch.Generator().manual_seed(seed)
    scores = torch.sigmoid(torch.randn(tokens, experts, generator=g) * 3)
    bias = torch.randn(experts, generator=g) * bias_scale
    idx, weight = select_experts(scores, bias, top_k)
    picked = scores.gather(1, idx)
    torch.testing.assert_close(weight, picked / picked.sum(-1, keepdim=True), rtol=0, atol=0)
    assert torch.all(weight > 0) and torch.allclose(weight.sum(-1), torch.ones(tokens))
    # the bias decided who was picked: the selected set is the top-k of s + b
    expected = torch.topk(scores + bias, top_k, dim=-1).indices.sort(-1).values
    assert torch.equal(idx.sort(-1).values, expected)
    # ... and wherever another bias picks the same experts, their weights are exactly the same
    other = torch.randn(experts, generator=g) * bias_scale
    idx2, weight2 = select_experts(scores, other, top_k)
    order1, order2 = idx.argsort(-1), idx2.argsort(-1)
    rows = (idx.gather(1, order1) == idx2.gather(1, order2)).all(-1)
    # (equal up to fp32 summation order: topk may list the same experts in another order)
    torch.testing.assert_close(weight.gather(1, order1)[rows], weight2.gather(1, order2)[rows], rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# KDA


def test_kda_recurrent_reference_matches_explicit_matrices():
    B, S, H, h, hv = 2, 6, 2, 4, 3
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(B, S, H, h, generator=g, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, S, H, h, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, S, H, hv, generator=g, dtype=torch.float64)
    log_alpha = -torch.nn.functional.softplus(torch.randn(B, S, H, h, generator=g, dtype=torch.float64))
    beta = torch.sigmoid(torch.randn(B, S, H, generator=g, dtype=torch.float64))
    out, _ = kda_recurrent_reference(q, k, v, log_alpha, beta)
    assert out.dtype == torch.float64 and out.shape == (B, S, H, hv)
    eye = torch.eye(h, dtype=torch.float64)
    expected = torch.empty(B, S, H, hv, dtype=torch.float64)
    for b in range(B):
        for hh in range(H):
            state = torch.zeros(h, hv, dtype=torch.float64)
            for t in range(S):
                kt, vt, qt, bt = k[b, t, hh], v[b, t, hh], q[b, t, hh], beta[b, t, hh]
                decay = torch.diag(log_alpha[b, t, hh].exp())
                state = (eye - bt * torch.outer(kt, kt)) @ decay @ state + bt * torch.outer(kt, vt)
                expected[b, t, hh] = state.T @ qt
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_quantile_step_moves_the_bias_part_of_the_way():
    """model.quantile_step s: b <- b + s (b_hat - b); s = 1 sets b to the quantile's b_hat (K3's rule)."""
    from k3ray.parallel.step import update_router_bias

    cfg = load_config(TINY).model
    scores = _saturated_scores(4096, 5)[:, :cfg.n_experts]
    hist = quantile_histogram(scores, torch.zeros(cfg.n_experts), cfg.top_k, 1000, 2.0, 1e-5)
    b_hat = quantile_bias(hist, torch.zeros(cfg.n_experts), cfg.top_k, 2.0, 1e-5)
    for step in (1.0, 0.3):
        moe = LatentMoE(cfg.model_copy(update={"quantile_step": step}), torch.nn.Identity())
        update_router_bias(moe.cfg, moe, hist, torch.zeros(cfg.n_experts))
        torch.testing.assert_close(moe.router.bias, step * b_hat)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention needs a GPU")
def test_mla_attention_with_a_narrower_v_equals_the_padded_and_the_fp32_math_on_gpu():
    """MLA's causal attention with q, k 192 wide and v 128 (v as it is where cuDNN takes it, padded elsewhere):
    output and gradients as the padded kernel's and, to bf16 accuracy, as fp32 attention by the formula."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from k3ray.model.layers import causal_attention

    gen = torch.Generator(device="cpu").manual_seed(3)
    q, k = (torch.randn(2, 512, 4, 192, generator=gen).cuda().bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(2, 512, 4, 128, generator=gen).cuda().bfloat16().requires_grad_()
    do = torch.randn(2, 512, 4, 128, generator=gen).cuda().bfloat16()

    def run(fn):
        for t in (q, k, v):
            t.grad = None
        o = fn()
        o.backward(do)
        return [o.detach().float()] + [t.grad.float() for t in (q, k, v)]

    got = run(lambda: causal_attention(q, k, v, 192 ** -0.5))

    def padded():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               F.pad(v, (0, 64)).transpose(1, 2), is_causal=True, scale=192 ** -0.5)
        return o[..., :128].transpose(1, 2)

    def math32():
        s = torch.einsum("bqhe,bkhe->bhqk", q.float(), k.float()) * 192 ** -0.5
        s = s.masked_fill(~torch.ones(512, 512, dtype=torch.bool, device="cuda").tril(), float("-inf"))
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.float())

    for ref, tol in ((run(padded), 1e-2), (run(math32), 2e-2)):
        for a, b in zip(got, ref):
            assert ((a - b).norm() / b.norm()).item() < tol
