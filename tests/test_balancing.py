"""Where the quantile is taken (model.quantile_bias_from): each training micro-batch routed with the bias from its
own scores has no lag behind the router; evaluation keeps the step's bias; the step report says what each gives."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3ray.config import load_config
from k3ray.dtypes import matmul_f32, mm_f32
from k3ray.model.balancing import own_bias, quantile_bias, quantile_histogram
from k3ray.model.decoder import new_shard
from k3ray.model.moe import LatentMoE, LocalExperts
from k3ray.parallel.reference import ReferenceTrainer
from k3ray.parallel.step import HostCopy, balance_diagnostics
from k3ray.policies.moonep import maxvio

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
SMALL = {"model.d_model": 32, "model.d_latent": 16, "model.n_experts": 16, "model.top_k": 4,
         "model.expert_inner": 8, "model.shared_inner": 16, "model.n_shared": 1}


def _moe(bias_from: str, eval_from: str = "step") -> LatentMoE:
    cfg = load_config(TINY, {**SMALL, "model.quantile_bias_from": bias_from,
                             "model.quantile_eval_bias_from": eval_from}).model
    torch.manual_seed(0)
    moe = LatentMoE(cfg, LocalExperts(new_shard(cfg, list(range(cfg.n_experts)))))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) / (p.shape[-2] if p.dim() == 3 else p.shape[-1]) ** 0.5)
        moe.router.weight.mul_(4.0)  # a router that has moved: logits of std ~4
        moe.router.bias.copy_(torch.linspace(-0.1, 0.1, cfg.n_experts))  # a stale bias, far from balancing x
    return moe


def _x(tokens: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, tokens, 32, generator=g) + 0.5 * torch.randn(32, generator=g))  # a shared direction


@pytest.mark.parametrize("bias_from", ["previous_step", "micro_batch"])
def test_micro_batch_bias_balances_the_batch_it_routes(bias_from):
    moe = _moe(bias_from)
    E = moe.cfg.n_experts
    moe(_x())
    st = moe.stats
    step_vio = maxvio([st.balance[:E].tolist()])
    micro_vio = maxvio([st.balance[E:2 * E].tolist()])
    routed = st.tokens_per_expert.tolist()
    assert step_vio > 1.0 and micro_vio < 0.25, (step_vio, micro_vio)
    # the routes counted for the step are those of the bias the mode uses; the other is what it would have given
    assert routed == st.balance[E:2 * E].tolist() if bias_from == "micro_batch" else st.balance[:E].tolist()
    assert int(st.balance[-1]) == 4096 * E
    # the step's bias is left as it was: only the step's update sets it
    assert torch.equal(moe.router.bias, torch.linspace(-0.1, 0.1, E))


def test_evaluation_routes_with_the_step_bias():
    """Without gradients, or in eval mode (a stage as build_stage returns it: serving, tests), the step's bias."""
    moe = _moe("micro_batch")
    E = moe.cfg.n_experts
    with torch.no_grad():
        moe(_x())
    assert moe.stats.tokens_per_expert.tolist() == moe.stats.balance[:E].tolist()
    moe.stats.reset()
    moe.eval()(_x())
    assert moe.stats.tokens_per_expert.tolist() == moe.stats.balance[:E].tolist()


def test_evaluation_can_route_with_its_own_bias():
    """model.quantile_eval_bias_from=batch: a forward without gradients routes as a training micro-batch does, with
    the bias from its own scores (balanced however far the step's bias is), and leaves the step's bias as it was."""
    moe = _moe("micro_batch", eval_from="batch")
    E = moe.cfg.n_experts
    with torch.no_grad():
        moe(_x())
    st = moe.stats
    assert st.tokens_per_expert.tolist() == st.balance[E:2 * E].tolist()
    assert maxvio([st.balance[E:2 * E].tolist()]) < 0.25 < 1.0 < maxvio([st.balance[:E].tolist()])
    assert torch.equal(moe.router.bias, torch.linspace(-0.1, 0.1, E))


def test_own_bias_is_repeated_quantile_passes():
    scores = torch.sigmoid(4 * _x(512)[0] @ torch.randn(32, 16, generator=torch.Generator().manual_seed(2)) / 32 ** 0.5)
    bias = torch.zeros(16)
    hist, one = own_bias(scores, bias, 4, 1000, 2.0, 1e-5, passes=1)
    assert torch.equal(hist, quantile_histogram(scores, bias, 4, 1000, 2.0, 1e-5))
    assert torch.equal(one, quantile_bias(hist, bias, 4, 2.0, 1e-5))
    first, three = own_bias(scores, bias, 4, 1000, 2.0, 1e-5)
    assert torch.equal(first, hist)
    assert torch.equal(three, own_bias(scores, own_bias(scores, one, 4, 1000, 2.0, 1e-5, passes=1)[1], 4, 1000, 2.0,
                                       1e-5, passes=1)[1])


def test_empty_histogram_keeps_the_bias():
    bias = torch.tensor([0.3, -0.1, -0.2])
    assert torch.equal(quantile_bias(torch.zeros(3, 10, dtype=torch.int64), bias, 1, 2.0, 1e-5), bias)


def test_balance_diagnostics():
    counts = torch.tensor([4, 4, 4, 4, 8, 4, 2, 2, 3, 10], dtype=torch.int64)  # E = 4, 3 of 10 scores saturated
    d = balance_diagnostics(counts, 4)
    assert d == {"maxvio_step_bias": 0.0, "maxvio_micro_batch_bias": 1.0, "saturated": 0.3}
    assert balance_diagnostics(counts.tolist(), 4) == d  # as read to the host with the rest of the step report


def test_step_report_reads_are_one_host_copy_of_the_same_values():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 1 << 40, (2, 3), generator=g), torch.randn(4, generator=g),
               torch.randn(2, 2, generator=g, dtype=torch.float64), torch.zeros(2, 0, dtype=torch.int64),
               torch.tensor(7)]
    got = HostCopy(tensors).values()
    assert got == [t.tolist() for t in tensors]
    assert [type(x) for x in got[0][0]] == [int] * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy is asynchronous only from a GPU")
def test_a_host_copy_on_cuda_reads_the_values_it_was_issued_for():
    """What a step ahead relies on: work queued after the report's copy was issued (the next step overwriting the
    statistics in place) changes none of the values read."""
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randint(0, 1 << 40, (64, 3), device="cuda", generator=g), torch.randn(1000, device="cuda",
                                                                                            generator=g)]
    want = [t.tolist() for t in tensors]
    pending = HostCopy(tensors)
    a = torch.randn(4096, 4096, device="cuda", generator=g)
    for _ in range(20):  # keeps the device busy past the overwrite below
        a = a @ a / 64
    for t in tensors:
        t.fill_(-1)
    assert pending.values() == want


def test_router_scores_in_bf16_are_the_widened_products():
    """bf16 router: fp32 scores from one GEMM with fp32 output (dtypes.matmul_f32), the same as widening x and W
    first; the gradients come back in bf16."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(8, 64, generator=g) / 8).to(torch.bfloat16).requires_grad_(True)
    s = matmul_f32(x, w.t())
    assert s.dtype == torch.float32 and torch.equal(s, x.detach().float() @ w.detach().float().t())
    ds = torch.randn(s.shape, generator=g)
    gx, gw = torch.autograd.grad(s, (x, w), ds)
    assert gx.dtype == gw.dtype == torch.bfloat16
    for got, want in ((gx, ds @ w.detach().float()), (gw, ds.t() @ x.detach().float())):  # within bf16 rounding
        assert float((got.float() - want).norm() / want.norm()) < 5e-3


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="torch's fp32-output GEMM on bf16 operands (out_dtype) exists on CUDA only; the CPU path "
                           "widens the operands and is tested above")
def test_fp32_output_gemms_on_cuda_are_the_widened_products():
    """mm_f32 on CUDA (cuBLAS with an fp32 output: torch's out_dtype) against widening first."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(64, 128, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(128, 32, device="cuda", generator=g).to(torch.bfloat16)
    got = mm_f32(a, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, a.float() @ b.float(), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled blocks (and with them the compiled quantile "
                    "passes) are CUDA's; the CPU runs own_bias eagerly")
def test_compiled_quantile_passes_on_cuda_give_the_eager_bias():
    """The MoE layer's own_bias as set_execution compiles it (Inductor, the histogram kernel between its graphs)
    against eager, on a gpu2-sized micro-batch: the same first histogram, and the same bias to float rounding."""
    from k3ray.model.decoder import compiled_own_bias

    g = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.sigmoid(3 * torch.randn(8192, 64, device="cuda", generator=g))
    bias = 0.05 * torch.randn(64, device="cuda", generator=g)
    want_hist, want = own_bias(scores, bias, 8, 1000, 2.0, 1e-5)
    got_hist, got = compiled_own_bias()(scores, bias, 8, 1000, 2.0, 1e-5)
    assert int((got_hist - want_hist).abs().sum()) <= 8  # a margin on a bin's edge may round to either side
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_set_execution_gives_the_moe_layers_a_compiled_own_bias_only_with_compiled_blocks():
    """Compiled blocks run the quantile passes compiled too (the same function); eager blocks run them eagerly."""
    from k3ray.config import ExecutionConfig
    from k3ray.model.decoder import build_stage, compiled_own_bias, set_execution

    cfg = load_config(TINY, SMALL).model
    stage = build_stage(cfg, range(cfg.n_layers))
    moes = [b.moe for b in stage.blocks.values() if b.moe is not None]
    assert moes and all(m.own_bias is own_bias for m in moes)
    set_execution(stage, ExecutionConfig(compile_blocks=False), "cpu")
    assert all(m.own_bias is own_bias for m in moes)
    set_execution(stage, ExecutionConfig(compile_blocks=True), "cpu")  # compiled lazily: nothing runs here
    assert all(m.own_bias is compiled_own_bias() for m in moes)


def test_micro_batch_bias_holds_in_training_at_a_high_learning_rate(one_thread):
    """64 experts top-8 at a high learning rate (the router moves fast): the one-step-stale bias smoothed by
    quantile_step 0.3 (gpu2's former setting) leaves MaxVio near 2 in the first steps; micro-batch biases balance
    every step, and the step report carries the per-layer diagnostics of both."""
    def run(bias_from: str, step: float) -> list:
        cfg = load_config(TINY, {"model.n_experts": 64, "model.top_k": 8, "model.n_layers": 2,
                                 "model.quantile_step": step, "model.quantile_bias_from": bias_from,
                                 "parallel.ep": 1, "parallel.micro_batches": 2, "data.micro_batch_size": 8,
                                 "optimizer.lr": 0.015, "train.steps": 8})
        trainer = ReferenceTrainer(cfg)
        return [trainer.train_step(s, s) for s in range(8)]

    stale, micro = run("previous_step", 0.3), run("micro_batch", 1.0)
    for r in micro:
        assert set(r.balance) == set(r.maxvio)
        for layer, d in r.balance.items():
            assert d["maxvio_micro_batch_bias"] == pytest.approx(r.maxvio[layer])
    tail = slice(2, None)
    mean_micro = sum(r.mean_maxvio for r in micro[tail]) / len(micro[tail])
    mean_stale = sum(r.mean_maxvio for r in stale[tail]) / len(stale[tail])
    assert max(r.mean_maxvio for r in micro[tail]) < 1.0 and mean_micro < 0.25 * mean_stale, (mean_micro, mean_stale)
