"""How a training step runs (config `execution`, the optimizer's fused path, route counting) changes nothing in what
it computes: selective recompute gives the eager gradients exactly, the compiled blocks equal eager on a GPU, the
fused AdamW's in-kernel clipping is the foreach path's, and the sync-free counts and norms are their formulas."""
from __future__ import annotations

import pytest
import torch

from k3ray.config import ExecutionConfig, OptimizerConfig, load_config
from k3ray.model.decoder import build_stage, set_execution
from k3ray.model.moe import count_routes, route_order
from k3ray.optim import AdamW, sum_of_squares
from k3ray.parallel.step import lm_loss

from conftest import RELEASED, REPO

TINY = REPO / "configs" / "tiny.yaml"


def _loss_and_grads(cfg, execution: ExecutionConfig, tokens: torch.Tensor, device: str = "cpu"):
    stage = build_stage(cfg, range(cfg.n_layers), seed=0, device=device)
    set_execution(stage, execution, device)
    loss = lm_loss(stage(tokens[:, :-1]), tokens, 1.0)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in stage.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("released", [False, True])
def test_selective_recompute_gives_the_eager_gradients_exactly(released):
    """Recomputing the attention sublayers' elementwise ops in backward repeats the same ops on the same inputs:
    the loss and every gradient are bit-identical in float64 (plain residual stream and Block AttnRes)."""
    cfg = load_config(TINY, {"model.dtype": "float64", **(RELEASED if released else {})}).model
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    loss, grads = _loss_and_grads(cfg, ExecutionConfig(), tokens)
    loss_rc, grads_rc = _loss_and_grads(cfg, ExecutionConfig(recompute="attention_elementwise"), tokens)
    assert torch.equal(loss, loss_rc)
    assert grads.keys() == grads_rc.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_rc[name]), name


@torch.compiler.disable
def _eager_step(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _looped_break(x: torch.Tensor) -> torch.Tensor:
    for _ in range(2):
        x = _eager_step(x) * 2
    return x


TF32_ROUNDOFF = 2.0 ** -11


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled blocks are a GPU option (minutes to compile on CPU)")
def test_compiled_blocks_equal_eager_on_gpu():
    """Regional compilation (one torch.compile per block, kernels between the graphs) in float32 on the GPU: the loss
    agrees with eager to 1e-5 and each gradient to TF32's unit roundoff of its norm (Inductor reorders the float32
    arithmetic, and the expert kernels' fp32 dots run in TF32, Triton's default: inputs a few ulps apart round
    differently there; 1.4-1.6e-4 of the norm across layers on an H100), and no frame of a block falls back to
    eager (Dynamo does that to a frame whose loop holds a graph break: the MoE layer's loop over its shared experts
    did, around SiTU-GLU), but the quantile passes' loop, whose functions compile one by one."""
    from torch._dynamo.utils import counters

    # MLA in every layer: KDA's fla kernels would autotune for the tiny heads first (minutes); the released features
    # otherwise (q-LoRA, a dense first layer, Block AttnRes)
    cfg = load_config(TINY, {"model.dtype": "float32", **RELEASED, "model.mla_layers": [0, 1, 2, 3]}).model
    tokens = torch.randint(0, cfg.vocab_size, (2, 65), generator=torch.Generator().manual_seed(3)).cuda()
    loss, grads = _loss_and_grads(cfg, ExecutionConfig(compile_blocks=False), tokens, "cuda")
    counters.clear()  # the check sees a frame skipped for a graph break in its loop
    torch.compile(_looped_break)(torch.ones(2, device="cuda"))
    assert any("frame skipped" in why for why in counters["unimplemented"])
    counters.clear()
    loss_c, grads_c = _loss_and_grads(cfg, ExecutionConfig(compile_blocks=True), tokens, "cuda")
    skipped = [why for why in counters["unimplemented"] if "frame skipped" in why and "own_bias" not in why]
    assert not skipped, skipped
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=0)
    off = {name: float((grads_c[name] - grads[name]).norm() / (grads[name].norm() + 1e-30)) for name in grads}
    assert max(off.values()) <= TF32_ROUNDOFF, sorted(off.items(), key=lambda kv: -kv[1])[:5]


def test_route_counts_are_bincount():
    idx = torch.randint(0, 7, (50, 3), generator=torch.Generator().manual_seed(0))
    assert torch.equal(count_routes(idx, 7), torch.bincount(idx.reshape(-1), minlength=7))
    assert torch.equal(route_order(idx, 7)[1], count_routes(idx, 7))


def test_sum_of_squares_is_its_formula():
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)]
    torch.testing.assert_close(sum_of_squares(ts), sum(t.square().sum() for t in ts), rtol=1e-14, atol=0)
    bf = [t.to(torch.bfloat16) for t in ts]  # bf16 gradients: accumulated in fp32, no bf16 rounding of the sum
    want = sum(t.double().square().sum() for t in bf)
    assert sum_of_squares(bf).dtype == torch.float32
    torch.testing.assert_close(sum_of_squares(bf).double(), want, rtol=1e-6, atol=0)
    assert float(sum_of_squares([])) == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused AdamW runs on CUDA tensors")
def test_fused_adamw_clipping_equals_foreach():
    """On CUDA the clip coefficient is applied inside the fused kernel (it divides by 1 / coefficient): the same
    update as the foreach path's multiply on CPU, to fp32 rounding."""
    cfg = OptimizerConfig()
    g = torch.Generator().manual_seed(0)
    init = torch.randn(64, 32, generator=g)
    grads = [torch.randn(64, 32, generator=g) for _ in range(3)]
    out = {}
    for device in ("cpu", "cuda"):
        params = {"w": torch.nn.Parameter(init.clone().to(device))}
        opt = AdamW(cfg)
        for grad in grads:
            params["w"].grad = grad.clone().to(device)
            opt.step(params, 1e-2, grad_scale=0.3)
        out[device] = params["w"].detach().cpu()
    torch.testing.assert_close(out["cuda"], out["cpu"], rtol=1e-5, atol=1e-6)


def test_blocks_compile_by_default_on_cuda_only():
    """execution.compile_blocks null (the default) compiles where the workers run CUDA; an explicit value wins."""
    assert load_config(TINY).execution.compile_blocks is None
    assert ExecutionConfig().compiles_blocks("cuda") and not ExecutionConfig().compiles_blocks("cpu")
    assert not ExecutionConfig(compile_blocks=False).compiles_blocks("cuda")
    stage = build_stage(load_config(TINY).model, range(2), seed=0)
    set_execution(stage, ExecutionConfig(), "cpu")
    assert all(block._compiled_call_impl is None for block in stage.blocks.values())


def test_a_served_stage_runs_its_blocks_eagerly():
    """Compiled blocks are the training step's: a serving grid's config turns them off (its iterations change their
    token count every time; a GPU's replay CUDA graphs instead)."""
    from k3ray.config import serving_config

    trained = load_config(TINY, {"parallel.device": "cuda", "execution.compile_blocks": True})
    assert trained.execution.compiles_blocks("cuda")
    assert not serving_config(trained.model_dump(), 1, 1).execution.compiles_blocks("cuda")


def test_compiled_blocks_are_refused_on_cpu_with_the_field_named():
    from k3ray.config import ConfigError

    with pytest.raises(ConfigError, match=r"execution.compile_blocks: CUDA only"):
        load_config(TINY, {"execution.compile_blocks": True})


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernels are wrapped by torch.compiler.disable")
def test_without_cuda_a_worker_process_does_not_import_torch_dynamo():
    """Nothing compiles without CUDA, so no worker pays torch._dynamo's import (~1 s of CPU per process)."""
    import subprocess
    import sys

    code = ("import sys, k3ray.grid.worker, k3ray.grid.worker_serving, k3ray.grid.worker_state, "
            "k3ray.grid.worker_training, k3ray.parallel.engine; print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_device_timer_reports_the_previous_steps_phases_without_waiting(device):
    """Each step's report carries the previous step's device seconds by phase, which add up within its total; on
    CPU (no device clock) and on the first step, none."""
    from k3ray.parallel.device_timer import MARKS, PHASES, DeviceTimer

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA events need a GPU")
    timer, a = DeviceTimer(torch.device(device)), torch.ones(512, 512, device=device)
    reports = []
    for _ in range(3):
        for mark in MARKS:
            a = a @ a / 512
            timer.mark(mark)
        reports.append(timer.finish())
    if device == "cpu":
        assert reports == [{}, {}, {}]
        return
    assert reports[0] == {} and set(reports[1]) == set(reports[2]) == set(PHASES)
    parts = sum(reports[2][p] for p in PHASES if p != "device_total")
    assert 0 < parts <= reports[2]["device_total"] + 1e-6
