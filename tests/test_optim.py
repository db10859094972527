"""AdamW (k3ray.optim): the update is torch's AdamW math; bf16 parameters keep fp32 masters that travel with
expert rows."""
from __future__ import annotations

import torch

from k3ray.config import OptimizerConfig
from k3ray.model.moe import ExpertShard
from k3ray.optim import AdamW
from k3ray.parallel import shards


def _adamw_by_hand(p: torch.Tensor, grads: list[torch.Tensor], cfg: OptimizerConfig, lr: float, scale: float):
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    b1, b2 = cfg.betas
    for t, g in enumerate(grads, 1):
        g = g * scale
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p * (1 - lr * cfg.weight_decay) if p.ndim >= 2 else p
        p = p - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + cfg.eps)
    return p


def test_update_is_adamw_with_clipping_and_matrix_only_decay():
    cfg = OptimizerConfig()
    g = torch.Generator().manual_seed(0)
    init = {"w": torch.randn(4, 3, generator=g, dtype=torch.float64), "b": torch.randn(3, generator=g, dtype=torch.float64)}
    grads = {n: [torch.randn(t.shape, generator=g, dtype=torch.float64) for _ in range(4)] for n, t in init.items()}
    params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt = AdamW(cfg)
    for i in range(4):
        for n, p in params.items():
            p.grad = grads[n][i].clone()
        opt.step(params, 1e-2, grad_scale=0.5)
    for n in init:
        torch.testing.assert_close(params[n].detach(), _adamw_by_hand(init[n], grads[n], cfg, 1e-2, 0.5),
                                   rtol=1e-12, atol=1e-14)


def test_bf16_parameters_keep_fp32_masters():
    """Updates far below bf16's resolution accumulate in the master; the parameter is its rounding."""
    cfg = OptimizerConfig(weight_decay=0.0)
    w = {"w": torch.nn.Parameter(torch.ones(8, 8, dtype=torch.bfloat16))}
    ref = {"w": torch.nn.Parameter(torch.ones(8, 8, dtype=torch.float32))}
    opt, opt_ref = AdamW(cfg), AdamW(cfg)
    for _ in range(50):
        w["w"].grad = torch.ones(8, 8, dtype=torch.bfloat16)
        ref["w"].grad = torch.ones(8, 8)
        opt.step(w, 1e-4)
        opt_ref.step(ref, 1e-4)
    master = opt.state["w"]["master"]
    assert master.dtype == torch.float32 and opt.state["w"]["m"].dtype == torch.float32
    torch.testing.assert_close(master, ref["w"].detach(), rtol=0, atol=1e-7)  # 50 x 1e-4 down: 0.995
    assert torch.equal(w["w"].detach(), master.to(torch.bfloat16))
    assert float(master[0, 0]) < 0.996  # a bf16 parameter updated in place would still read 1.0


def test_expert_rows_carry_their_masters():
    cfg = OptimizerConfig()
    shard = ExpertShard([0, 1, 2], 4, 3, dtype=torch.bfloat16)
    with torch.no_grad():
        shard.w1.copy_(torch.randn(shard.w1.shape))
        shard.w2.copy_(torch.randn(shard.w2.shape))
    opt = AdamW(cfg)
    params = {f"s.{n}": p for n, p in shard.named_parameters()}
    for p in params.values():
        p.grad = torch.randn(p.shape).to(torch.bfloat16)
    opt.step(params, 1e-3)
    payload = shards.export_experts(shard, opt, "s", [2])
    assert set(payload["opt"]["w1"]) == {"m", "v", "master"}
    torch.testing.assert_close(payload["opt"]["w1"]["master"], opt.state["s.w1"]["master"][2:3])
    other = ExpertShard([5], 4, 3, dtype=torch.bfloat16)
    with torch.no_grad():  # finite weights (torch.empty may hold NaN, and NaN != NaN)
        other.w1.copy_(torch.randn(other.w1.shape))
        other.w2.copy_(torch.randn(other.w2.shape))
    other_opt = AdamW(cfg)
    shards.set_experts(other, other_opt, "s", [payload], [5])  # expert 5 arrives with no state: fresh
    assert other.expert_ids == [2, 5]
    st = other_opt.state["s.w1"]
    torch.testing.assert_close(st["master"][0], opt.state["s.w1"]["master"][2])
    assert torch.equal(st["m"][1], torch.zeros_like(st["m"][1]))
    assert torch.equal(st["master"][1], other.w1[1].detach().float())


def test_state_made_before_the_first_step_changes_no_update():
    """`init_state` (snapshots size their buffers from the first one) makes what the first step would: the same
    parameters, masters and moments after steps, for bf16 and float64 parameters."""
    cfg = OptimizerConfig()
    g = torch.Generator().manual_seed(3)
    init = {"w": torch.randn(4, 3, generator=g).to(torch.bfloat16),
            "b": torch.randn(3, generator=g, dtype=torch.float64)}
    grads = [{n: torch.randn(t.shape, generator=g).to(t.dtype) for n, t in init.items()} for _ in range(3)]
    runs = []
    for eager in (False, True):
        params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
        opt = AdamW(cfg)
        if eager:
            opt.init_state(params)
            assert set(opt.state) == {"w", "b"} and set(opt.state["w"]) == {"m", "v", "master"}
        for step in grads:
            for n, p in params.items():
                p.grad = step[n].clone()
            opt.step(params, 1e-2)
        runs.append((params, opt.state))
    (lazy_p, lazy_s), (eager_p, eager_s) = runs
    for n in init:
        assert torch.equal(lazy_p[n], eager_p[n])
        for k in lazy_s[n]:
            assert torch.equal(lazy_s[n][k], eager_s[n][k])


def test_bf16_moments_round_each_step_and_follow_the_state_across_a_restore():
    """moments_dtype bfloat16: the step is fp32 AdamW on the master with each moment rounded to bf16 when stored
    (the CPU path; the fused kernel: tests/test_adamw_kernel.py); float64 parameters keep float64 moments; state
    restored from an fp32-moment optimizer (a checkpoint of before) takes the configured dtype, and back."""
    cfg, wide = OptimizerConfig(moments_dtype="bfloat16", weight_decay=0.1), OptimizerConfig(weight_decay=0.1)
    g = torch.Generator().manual_seed(5)
    init = torch.randn(6, 5, generator=g).to(torch.bfloat16)
    grads = [torch.randn(6, 5, generator=g).to(torch.bfloat16) for _ in range(4)]
    params = {"w": torch.nn.Parameter(init.clone()), "b": torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))}
    opt = AdamW(cfg)
    master, m, v = init.float(), torch.zeros(6, 5), torch.zeros(6, 5)
    (b1, b2), lr = cfg.betas, 1e-2
    for t, grad in enumerate(grads, 1):
        params["w"].grad, params["b"].grad = grad.clone(), torch.ones(5, dtype=torch.float64)
        opt.step(params, lr)
        m_new, v_new = b1 * m + (1 - b1) * grad.float(), b2 * v + (1 - b2) * grad.float().square()
        master = master * (1 - lr * cfg.weight_decay)
        master = master - lr * (m_new / (1 - b1 ** t)) / ((v_new / (1 - b2 ** t)).sqrt() + cfg.eps)
        m, v = m_new.bfloat16().float(), v_new.bfloat16().float()
    st = opt.state["w"]
    assert st["m"].dtype == st["v"].dtype == torch.bfloat16 and st["master"].dtype == torch.float32
    assert opt.state["b"]["m"].dtype == torch.float64
    assert torch.equal(st["m"].float(), m) and torch.equal(st["v"].float(), v)
    torch.testing.assert_close(st["master"], master, rtol=1e-6, atol=1e-7)
    assert torch.equal(params["w"].detach(), st["master"].bfloat16())
    restored = AdamW(wide)
    restored.set_state("w", {k: t.clone() for k, t in st.items()})
    assert restored.state["w"]["m"].dtype == torch.float32 and torch.equal(restored.state["w"]["m"], m)
    back = AdamW(cfg)
    back.set_state("w", restored.state["w"])
    assert back.state["w"]["v"].dtype == torch.bfloat16 and torch.equal(back.state["w"]["v"].float(), v)
