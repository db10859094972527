"""Triton kernels of the routed-expert path against their torch references (k3ray/kernels).

Without a GPU every Triton kernel runs under TRITON_INTERPRET=1 on tiny CPU tensors (the variable is set below,
before the kernel modules are (re)imported, since @triton.jit reads it when a kernel is defined). With a GPU the
same tests run compiled on CUDA, plus real-shape bf16 checks against an fp32 reference (rel err < 1e-2).
Inputs are random draws seeded per test (a failure reproduces); kernel outputs are allocated NaN-poisoned so
unwritten elements fail.

The interpreter rounds fp32 -> bf16 toward zero (triton 3.9), so its bf16 checks use a looser bound than the GPU's;
exact-arithmetic checks use fp32.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
# @triton.jit reads TRITON_INTERPRET when a kernel is defined, so tests/conftest.py sets it (no CUDA) before anything
# imports triton; run alone with `TRITON_INTERPRET=1` set by conftest too.
assert CUDA or os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET=1 without CUDA"

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import k3ray.kernels as kernels  # noqa: E402
from k3ray.kernels import attn_res as attn_res_kernels  # noqa: E402
from k3ray.kernels.grouped_ffn import grouped_expert_ffn_reference, grouped_expert_ffn_triton  # noqa: E402
from k3ray.kernels.histogram import score_histogram_reference, score_histogram_triton  # noqa: E402
from k3ray.kernels.permute import (  # noqa: E402
    permute_rows_reference,
    permute_rows_triton,
    unpermute_rows_reference,
    unpermute_rows_triton,
)
from k3ray.kernels.situ_glu import situ_glu_reference, situ_glu_triton  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter overflow in exp(+-inf) paths
BF16_TOL = 1e-2 if CUDA else 2.5e-2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values (unwritten output?)"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def seeded():
    """Every test draws its inputs from the same seed, so a failure reproduces."""
    torch.manual_seed(0)


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty / empty_like return NaN-filled (float) or -7777-filled (int) tensors while the test runs."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan") if t.is_floating_point() else -7777) if t.numel() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


def k3_formula(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """K3_NOTES: beta * tanh(g / beta) * sigmoid(g) * (beta_lin * tanh(u / beta_lin)), in float64."""
    g, u = g.double(), u.double()
    return 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * (25.0 * torch.tanh(u / 25.0))


# ---------------------------------------------------------------------------------------------------------- SiTU-GLU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_situ_glu_matches_k3_formula(poisoned, dtype):
    g = (torch.randn(3, 333, device=DEV) * 6).to(dtype)
    u = (torch.randn(3, 333, device=DEV) * 40).to(dtype)
    want = k3_formula(g, u)
    tol = 1e-5 if dtype == torch.float32 else BF16_TOL / 2
    for fn in (situ_glu_reference, situ_glu_triton):
        out = fn(g, u)
        assert out.dtype == dtype and out.shape == g.shape
        assert rel_err(out, want) < tol, fn.__name__


_extreme = st.one_of(
    st.floats(allow_nan=False, allow_infinity=True, width=32),
    st.sampled_from([1e30, -1e30, math.inf, -math.inf, 0.0, -0.0, 3.4e38, -3.4e38]),
)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(_extreme, _extreme), min_size=1, max_size=16))
def test_situ_glu_bounded_and_finite(pairs):
    g = torch.tensor([p[0] for p in pairs], device=DEV)
    u = torch.tensor([p[1] for p in pairs], device=DEV)
    for fn in (situ_glu_reference, situ_glu_triton):
        for dtype in (torch.float32, torch.bfloat16):
            out = fn(g.to(dtype), u.to(dtype)).float()
            assert torch.isfinite(out).all(), (fn.__name__, g, u, out)
            assert (out.abs() <= 100.0).all(), (fn.__name__, g, u, out)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(-0.0078125, 0.0078125, width=32), st.floats(-0.0078125, 0.0078125, width=32)), min_size=1,
                max_size=16))
def test_situ_glu_is_swiglu_near_zero(pairs):
    g = torch.tensor([p[0] for p in pairs], device=DEV)
    u = torch.tensor([p[1] for p in pairs], device=DEV)
    swiglu = torch.nn.functional.silu(g.double()) * u.double()
    for fn in (situ_glu_reference, situ_glu_triton):
        torch.testing.assert_close(fn(g, u).double(), swiglu, rtol=1e-3, atol=1e-12)


def test_situ_glu_gradients(poisoned):
    g = (torch.randn(5, 77, device=DEV) * 5).requires_grad_()
    u = (torch.randn(5, 77, device=DEV) * 30).requires_grad_()
    dout = torch.randn(5, 77, device=DEV)
    want = torch.autograd.grad(situ_glu_reference(g, u), (g, u), dout)
    got = torch.autograd.grad(situ_glu_triton(g, u), (g, u), dout)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-5


# ------------------------------------------------------------------------------------------------ grouped expert FFN
def group_sizes(layout: str, n_rows: int, n_groups: int) -> torch.Tensor:
    if layout == "one_group_all":
        sizes = torch.zeros(n_groups, dtype=torch.int64)
        sizes[torch.randint(n_groups, ())] = n_rows
        return sizes
    weights = torch.rand(n_groups) + 0.05
    if layout == "empty_groups":
        weights[torch.randperm(n_groups)[: n_groups // 2]] = 0
    idx = torch.multinomial(weights, n_rows, replacement=True)
    return torch.bincount(idx, minlength=n_groups)


def ffn_inputs(n_rows, d, inner, n_groups, layout, dtype, scale: bool):
    sizes = group_sizes(layout, n_rows, n_groups)
    ends = torch.cumsum(sizes, 0).to(torch.int32).to(DEV)
    x = torch.randn(n_rows, d, device=DEV).to(dtype)
    w1 = (torch.randn(n_groups, d, 2 * inner, device=DEV) / d**0.5).to(dtype)
    w2 = (torch.randn(n_groups, inner, d, device=DEV) / inner**0.5).to(dtype)
    s = torch.rand(n_rows, device=DEV) if scale else None
    return x, w1, w2, ends, s


TINY = [(70, 40, 24, 5), (64, 32, 32, 3)]  # uneven and even tile edges (interpreter blocks are 16)


@pytest.mark.parametrize("shape", TINY)
@pytest.mark.parametrize("layout", ["random", "empty_groups", "one_group_all"])
@pytest.mark.parametrize("scale", [False, True])
def test_grouped_ffn_forward_backward_fp32(poisoned, shape, layout, scale):
    x, w1, w2, ends, s = ffn_inputs(*shape, layout, torch.float32, scale)
    leaves = [x, w1, w2] + ([s] if scale else [])
    ref_in = [t.clone().requires_grad_() for t in leaves]
    tri_in = [t.clone().requires_grad_() for t in leaves]
    y_ref = grouped_expert_ffn_reference(*ref_in[:3], ends, ref_in[3] if scale else None)
    y_tri = grouped_expert_ffn_triton(*tri_in[:3], ends, tri_in[3] if scale else None)
    assert y_tri.shape == y_ref.shape and y_tri.dtype == y_ref.dtype
    tol = 1e-2 if CUDA else 1e-5  # the GPU's fp32 dot is tf32
    assert rel_err(y_tri, y_ref) < tol
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    y_tri.backward(dy)
    for name, a, b in zip(["dx", "dw1", "dw2", "ds"], tri_in, ref_in):
        assert rel_err(a.grad, b.grad) < tol, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_ffn_micro_batches_add_into_the_weight_grads(poisoned, monkeypatch, dtype):
    """Two micro-batches' backward passes through the same leaf weights: inside `adding_into_grads` the second adds
    its weight gradients into the first's `.grad` in the weight-gradient kernel (no gradient returned to autograd),
    giving what autograd's accumulation gives (bf16: within the one rounding it saves; fp32: the reference's);
    `torch.autograd.grad` outside it returns the gradient and leaves `.grad` alone."""
    import k3ray.kernels.grouped_ffn as ffn

    into = []
    wgrad = ffn._wgrad
    monkeypatch.setattr(ffn, "_wgrad", lambda *a: into.append(len(a) > 4 and a[4] is not None) or wgrad(*a))
    batches = [ffn_inputs(*TINY[0], "random", dtype, True) for _ in range(2)]
    w1, w2 = batches[0][1], batches[0][2]
    fused, added, ref = ([w.clone().to(t).requires_grad_() for w in (w1, w2)]
                         for t in (dtype, dtype, torch.float32))
    for x, _, _, ends, s in batches:
        with kernels.adding_into_grads():
            grouped_expert_ffn_triton(x, *fused, ends, s).float().square().sum().backward()
        grouped_expert_ffn_triton(x, *added, ends, s).float().square().sum().backward()
        grouped_expert_ffn_reference(x.float(), *ref, ends, s).square().sum().backward()
    # dW1 and dW2 per backward (fused, then autograd's accumulation): the kernel adds in the fused second only
    assert into == [False] * 4 + [True, True, False, False]
    for a, b, r in zip(fused, added, ref):
        assert a.grad.dtype == dtype
        assert rel_err(a.grad, b.grad) < (1e-6 if dtype == torch.float32 else 1e-2)
        if dtype == torch.float32:
            assert rel_err(a.grad, r.grad) < (1e-2 if CUDA else 1e-5)
    before = [w.grad.clone() for w in fused]
    x, _, _, ends, s = batches[1]
    got = torch.autograd.grad(grouped_expert_ffn_triton(x, *fused, ends, s).float().square().sum(), fused)
    want = torch.autograd.grad(grouped_expert_ffn_triton(x, *added, ends, s).float().square().sum(), added)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(w.grad, b) for w, b in zip(fused, before))


@pytest.mark.parametrize("layout", ["random", "one_group_all"])
def test_grouped_ffn_bf16_and_group_order(poisoned, layout):
    x, w1, w2, ends, s = ffn_inputs(*TINY[0], layout, torch.bfloat16, True)
    want = grouped_expert_ffn_reference(x.float(), w1.float(), w2.float(), ends, s)
    y = grouped_expert_ffn_triton(x, w1, w2, ends, s)
    assert y.dtype == torch.bfloat16 and rel_err(y, want) < BF16_TOL
    order = torch.randperm(w1.shape[0], device=DEV)
    y2 = grouped_expert_ffn_triton(x, w1, w2, ends, s, group_order=order)
    assert torch.equal(y, y2)  # the order moves tiles between programs, never the arithmetic


def test_grouped_ffn_no_grad_and_empty(poisoned):
    x, w1, w2, ends, _ = ffn_inputs(*TINY[1], "random", torch.float32, False)
    with torch.no_grad():
        y = grouped_expert_ffn_triton(x, w1, w2, ends)
    assert rel_err(y, grouped_expert_ffn_reference(x, w1, w2, ends)) < (1e-2 if CUDA else 1e-5)
    zero = torch.zeros_like(ends)
    assert grouped_expert_ffn_triton(x[:0], w1, w2, zero).shape == (0, x.shape[1])
    with pytest.raises(ValueError, match="no groups"):
        grouped_expert_ffn_triton(x, w1[:0], w2[:0], ends[:0])
    leaves = [t.clone().requires_grad_() for t in (x[:0], w1, w2)]
    grouped_expert_ffn_triton(*leaves, zero).sum().backward()
    assert leaves[0].grad.shape == (0, x.shape[1])
    assert torch.equal(leaves[1].grad, torch.zeros_like(w1)) and torch.equal(leaves[2].grad, torch.zeros_like(w2))


@pytest.mark.parametrize("layout", ["random", "empty_groups", "one_group_all"])
@pytest.mark.parametrize("given_order", [False, True])
def test_schedule_tiles_largest_group_first(poisoned, monkeypatch, layout, given_order):
    """The row-tile table: every group's BM-row tiles back to back, groups largest first (ties by index) or in the
    given order, the tile count after the tiles. Ranked 4 groups at a time here, so 11 groups take three blocks."""
    from k3ray.kernels import grouped_ffn

    monkeypatch.setattr(grouped_ffn, "_BLOCK_G", 4)
    sizes = group_sizes(layout, 300, 11)
    ends = torch.cumsum(sizes, 0).to(torch.int32).to(DEV)
    order = torch.randperm(11) if given_order else torch.argsort(sizes, descending=True, stable=True)
    sched = grouped_ffn._Schedule(ends, order.to(DEV) if given_order else None, 300)
    bm = 16
    tiles, mt = sched.tiles(bm)
    tiles = tiles.cpu()
    starts = (torch.cumsum(sizes, 0) - sizes).tolist()
    want = [(g, starts[g] + m * bm) for g in order.tolist() for m in range(-(-int(sizes[g]) // bm))]
    n = int(tiles[2 * mt])
    assert n == len(want) <= mt
    assert list(zip(tiles[:n].tolist(), tiles[mt:mt + n].tolist())) == want
    assert torch.equal(sched.order().cpu().long(), order)


def _compiled_variants(kernel) -> int | None:
    """Compiled variants of a @triton.jit kernel on every device so far (None under the interpreter)."""
    caches = getattr(kernel, "device_caches", None)
    return None if caches is None else sum(len(entry[0]) for entry in caches.values())


def test_grouped_ffn_compiles_once_whatever_the_load(poisoned, monkeypatch):
    """Routing changes the group count and the rows every call; no kernel may compile a new variant for that
    (a compile stalls a training step for seconds). Checked on every launch's compile-time constants, and on
    CUDA on Triton's own cache of compiled kernels. The schedule kernel ranks the groups in blocks (4 here, so 9
    groups take three blocks)."""
    from k3ray.kernels import grouped_ffn, grouped_gemm

    monkeypatch.setattr(grouped_ffn, "_BLOCK_G", 4)
    names = [n for n in vars(grouped_gemm) if n.endswith("_kernel")]
    constants: dict[str, set] = {}

    class Recorded:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                constants.setdefault(self.name, set()).add(tuple(sorted(kwargs.items())))
                return launch(*args, **kwargs)
            return run

    kernels_by_name = {n: getattr(grouped_gemm, n) for n in names}
    for name, kernel in kernels_by_name.items():
        monkeypatch.setattr(grouped_gemm, name, Recorded(name, kernel))

    def train_call(n_rows, n_groups, layout, w1, w2):
        x, _, _, ends, s = ffn_inputs(n_rows, w1.shape[1], w2.shape[1], n_groups, layout, torch.float32, True)
        leaves = [t.clone().requires_grad_() for t in (x, w1[:n_groups], w2[:n_groups], s)]
        ref = [t.detach().clone().requires_grad_() for t in leaves]
        y = grouped_expert_ffn_triton(*leaves[:3], ends, leaves[3])
        y_ref = grouped_expert_ffn_reference(*ref[:3], ends, ref[3])
        dy = torch.randn_like(y_ref)
        y.backward(dy)
        y_ref.backward(dy)
        tol = 1e-2 if CUDA else 1e-5
        assert rel_err(y, y_ref) < tol
        for a, b in zip(leaves, ref):
            assert rel_err(a.grad, b.grad) < tol

    d, inner = 32, 32
    w1 = torch.randn(9, d, 2 * inner, device=DEV) / d**0.5
    w2 = torch.randn(9, inner, d, device=DEV) / inner**0.5
    train_call(48, 3, "random", w1, w2)  # the first call compiles
    before = {n: _compiled_variants(k) for n, k in kernels_by_name.items()}
    first = {n: set(v) for n, v in constants.items()}
    for n_rows, n_groups, layout in [(7, 9, "random"), (50, 9, "empty_groups"), (33, 5, "one_group_all"),
                                     (16, 1, "random")]:
        train_call(n_rows, n_groups, layout, w1, w2)
    assert first and constants == first, {n: v - first.get(n, set()) for n, v in constants.items()}
    assert {n: _compiled_variants(k) for n, k in kernels_by_name.items()} == before


# -------------------------------------------------------------------------------------------- permute / unpermute
def routes(n_tokens: int, k: int, drop: float):
    """dest [T, K]: a random injective map of the kept routes into rows [0, num_rows), num_rows > kept."""
    keep = torch.rand(n_tokens, k) >= drop
    num_rows = int(keep.sum()) + 3
    rows = torch.randperm(num_rows)[: int(keep.sum())]
    dest = torch.full((n_tokens, k), -1, dtype=torch.int64)
    dest[keep] = rows
    return dest.to(DEV), num_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_permute_unpermute(poisoned, dtype, drop):
    n_tokens, k, d = 37, 3, 48
    dest, num_rows = routes(n_tokens, k, drop)
    x = torch.randn(n_tokens, d, device=DEV).to(dtype)
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_r = permute_rows_reference(xr, dest, num_rows)
    out_t = permute_rows_triton(xt, dest, num_rows)
    assert torch.equal(out_t, out_r)  # pure data movement: bit-exact, untargeted rows zero
    g = torch.randn_like(out_r)
    out_r.backward(g)
    out_t.backward(g)
    assert rel_err(xt.grad, xr.grad) < (1e-6 if dtype == torch.float32 else BF16_TOL)

    y = torch.randn(num_rows, d, device=DEV).to(dtype)
    w = torch.rand(n_tokens, k, device=DEV)
    yr, yt = y.clone().requires_grad_(), y.clone().requires_grad_()
    wr, wt = w.clone().requires_grad_(), w.clone().requires_grad_()
    c_r = unpermute_rows_reference(yr, dest, wr)
    c_t = unpermute_rows_triton(yt, dest, wt)
    tol = 1e-6 if dtype == torch.float32 else BF16_TOL
    assert c_t.dtype == dtype and rel_err(c_t, c_r) < tol
    g = torch.randn_like(c_r)
    c_r.backward(g)
    c_t.backward(g)
    assert rel_err(yt.grad, yr.grad) < tol
    assert rel_err(wt.grad, wr.grad) < tol
    assert (wt.grad[dest < 0] == 0).all()


# ------------------------------------------------------------------------------------------------------- histogram
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_histogram(dtype):
    values = (torch.randn(123, 37, device=DEV) * 0.6).to(dtype)
    values[0, :3] = torch.tensor([-5.0, 5.0, math.inf])  # clamped into the edge bins
    for lo, hi, bins in [(-1.0, 1.0, 1000), (-0.3, 0.7, 17)]:
        got = score_histogram_triton(values, lo, hi, bins)
        assert got.dtype == torch.int64
        assert torch.equal(got, score_histogram_reference(values, lo, hi, bins))
        assert (got.sum(1) == values.shape[0]).all()


# -------------------------------------------------------------------------------------------------------- dispatch
def test_dispatch_picks_backend(monkeypatch):
    g, u = torch.randn(4, 8, device=DEV), torch.randn(4, 8, device=DEV)
    calls = []
    monkeypatch.setattr(kernels._situ, "situ_glu_triton", lambda *a: calls.append("triton") or situ_glu_reference(*a))
    monkeypatch.setattr(kernels, "_backend", "auto")
    kernels.situ_glu(g, u)
    assert calls == (["triton"] if CUDA else [])
    kernels.set_backend("triton")
    kernels.situ_glu(g, u)
    kernels.set_backend("reference")
    kernels.situ_glu(g, u)
    assert calls[-1] == "triton" and len(calls) == (2 if CUDA else 1)
    with pytest.raises(ValueError):
        kernels.set_backend("fast")


# ---------------------------------------------------------------------------------------- real shapes, GPU only
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["random", "empty_groups", "one_group_all"])
@pytest.mark.parametrize("rows,widths,experts", [(4096, (3584, 2048), 14), (16384, (2048, 1024), 32)])
def test_grouped_ffn_real_shape_bf16(poisoned, layout, rows, widths, experts):
    """K3's widths, and gpu2's with many rows a group (the configs tuned there: grouped_ffn.CONFIGS_AT_WIDTHS)."""
    x, w1, w2, ends, s = ffn_inputs(rows, *widths, experts, layout, torch.bfloat16, True)
    leaves = [x, w1, w2, s]
    ref_in = [t.float().clone().requires_grad_() for t in leaves]
    tri_in = [t.clone().requires_grad_() for t in leaves]
    y_ref = grouped_expert_ffn_reference(*ref_in[:3], ends, ref_in[3])
    y_tri = grouped_expert_ffn_triton(*tri_in[:3], ends, tri_in[3])
    assert rel_err(y_tri, y_ref) < 1e-2
    dy = torch.randn_like(y_ref)
    y_ref.backward(dy)
    y_tri.backward(dy.bfloat16())
    for name, a, b in zip(["dx", "dw1", "dw2", "ds"], tri_in, ref_in):
        assert rel_err(a.grad, b.grad) < 1e-2, name


def test_backward_kernel_from_a_fresh_thread():
    """Autograd runs the backward in a thread of its own, which starts with no CUDA context current. The dH kernel's
    TMA descriptors need one: it failed with "invalid device context" once the caching allocator had its memory, so
    that nothing else touched CUDA first. No poisoning here: its fill kernel would bind the context itself."""
    import threading

    from k3ray.kernels import grouped_ffn

    n_rows, d, inner, n_groups = (512, 256, 128, 4) if CUDA else (64, 32, 32, 3)
    x, w1, w2, ends, _ = ffn_inputs(n_rows, d, inner, n_groups, "random", torch.bfloat16, False)
    dy = torch.randn_like(x)
    sched = grouped_ffn._Schedule(ends, None, n_rows)
    with torch.no_grad():
        _, act, h = grouped_ffn._ffn_forward(x, w1, w2, sched, None, True, 4.0, 25.0)
        want = grouped_ffn._ffn_dh(dy, w2, h, None, sched, 4.0, 25.0)[0]
    if CUDA:
        torch.cuda.synchronize()
    result = {}

    def backward_thread():
        try:
            with torch.no_grad():
                result["dh"] = grouped_ffn._ffn_dh(dy, w2, h, None, sched, 4.0, 25.0)[0]
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            result["error"] = e

    thread = threading.Thread(target=backward_thread)
    thread.start()
    thread.join()
    assert "error" not in result, result.get("error")
    assert torch.equal(result["dh"], want)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_permute_histogram_real_shape(poisoned):
    dest, num_rows = routes(4096, 8, 0.1)
    x = torch.randn(4096, 3584, device=DEV, dtype=torch.bfloat16)
    assert torch.equal(permute_rows_triton(x, dest, num_rows), permute_rows_reference(x, dest, num_rows))
    y = torch.randn(num_rows, 3584, device=DEV, dtype=torch.bfloat16)
    w = torch.rand(4096, 8, device=DEV)
    assert rel_err(unpermute_rows_triton(y, dest, w), unpermute_rows_reference(y.float(), dest, w)) < 1e-2
    v = torch.rand(8192, 896, device=DEV)
    assert torch.equal(score_histogram_triton(v, 0.0, 1.0, 1000), score_histogram_reference(v, 0.0, 1.0, 1000))


@given(lengths=st.lists(st.integers(1, 9), min_size=1, max_size=5), W=st.integers(2, 5), fresh=st.booleans(),
       seed=st.integers(0, 2**16), data=st.data())
@settings(max_examples=30, deadline=None)
def test_short_conv_packed_equals_the_per_sequence_reference(lengths, W, fresh, seed, data):
    """Every packed sequence at once, from its carried state in a pool slot (indices built on the host), equals the
    reference's loop over sequences: outputs and final states, sequences shorter than the kernel included, from
    carried states or zeros; a tail at a point inside a sequence is the final state of the reference stopped there.
    The Triton kernels (two launches: outputs; final states and tails) equal the torch form, and the pool is not
    written."""
    from k3ray.kernels.short_conv import (packed_conv_index, short_conv_packed_reference, short_conv_packed_triton,
                                          short_conv_reference)

    g = torch.Generator().manual_seed(seed)
    C, T, N = 6, sum(lengths), len(lengths)
    x = torch.randn(1, T, C, generator=g, dtype=torch.float64)
    w = torch.randn(C, W, generator=g, dtype=torch.float64)
    pool = torch.randn(N + 2, W - 1, C, generator=g, dtype=torch.float64)
    slots = torch.randperm(N + 2, generator=g)[:N].tolist()
    if fresh:
        pool[slots] = 0.0
    before = pool.clone()
    points = data.draw(st.lists(st.integers(0, N - 1).flatmap(
        lambda n: st.tuples(st.just(n), st.integers(1, lengths[n]))), max_size=4))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    index = packed_conv_index(lengths, slots, W, points)
    y, s, tails = short_conv_packed_reference(x, w, pool, index)
    y_ref, s_ref = short_conv_reference(x, w, pool[slots], output_final_state=True, cu_seqlens=cu)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert tails.shape == (len(points), W - 1, C)
    for (n, offset), tail in zip(points, tails):
        _, want = short_conv_reference(x[:, cu[n]:cu[n] + offset], w, pool[slots[n]][None], output_final_state=True)
        torch.testing.assert_close(tail, want[0], rtol=0, atol=0)
    f32 = [t.float() for t in (x, w, pool)]
    y_t, s_t, tails_t = short_conv_packed_triton(*f32, index)
    y_r, s_r, tails_r = short_conv_packed_reference(*f32, index)
    torch.testing.assert_close(y_t, y_r, rtol=1e-5, atol=1e-5)
    assert torch.equal(s_t, s_r) and torch.equal(tails_t, tails_r)
    assert torch.equal(pool, before)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_short_conv_packed_triton_real_shape():
    """gpu2's KDA convolution (3 x 32 heads x 128, W = 4) over a mixed iteration in bf16 on the GPU: a 700-token row
    from a carried state beside 63 decode rows, tails at two points."""
    from k3ray.kernels.short_conv import packed_conv_index, short_conv_packed_reference, short_conv_packed_triton

    g = torch.Generator(device="cpu").manual_seed(3)
    C, W, lengths = 3 * 32 * 128, 4, [700] + [1] * 63
    x = torch.randn(1, sum(lengths), C, generator=g).to(DEV, torch.bfloat16)
    w = torch.randn(C, W, generator=g).to(DEV, torch.bfloat16)
    pool = torch.randn(257, W - 1, C, generator=g).to(DEV, torch.bfloat16)
    index = packed_conv_index(lengths, list(range(64)), W, [(0, 64), (0, 130)])
    index = type(index)(*(t.to(DEV) for t in (index.src, index.last, index.tails)))
    y, s, tails = short_conv_packed_triton(x, w, pool, index)
    y_r, s_r, tails_r = short_conv_packed_reference(x, w, pool, index)
    assert rel_err(y.float(), y_r.float()) < 1e-2
    assert torch.equal(s, s_r) and torch.equal(tails, tails_r)


def _attn_res_inputs(N, T, d):
    g = torch.Generator().manual_seed(N * 1000 + T)
    p = torch.softmax(torch.randn(N, T, generator=g), 0)
    a, b = torch.randn(N, T, generator=g), torch.randn(N, T, generator=g) * 1e-3
    u, dh, v = torch.randn(d, generator=g), torch.randn(T, d, generator=g), torch.randn(N, T, d, generator=g)
    dh = dh.bfloat16().float()  # exact in either dtype under test
    return {k: t.to(DEV) for k, t in dict(p=p, a=a, b=b, u=u, dh=dh, v=v).items()}


_ATTN_RES_CALLS = {  # kernel name: its arguments from _attn_res_inputs, the values v in the dtype under test
    "attn_res_scores": lambda x, v: (v, x["u"], 1e-5),
    "attn_res_weighted_sum": lambda x, v: (x["p"], v),
    "attn_res_value_dots": lambda x, v: (x["dh"].to(v.dtype), v),
    "attn_res_value_grad": lambda x, v: (x["p"], x["dh"].to(v.dtype), x["a"], x["b"], x["u"], v),
}


@pytest.mark.parametrize("name", sorted(_ATTN_RES_CALLS))
@pytest.mark.parametrize("N,T,d", [(2, 5, 300), (3, 33, 64), (1, 16, 256)])
def test_attn_res_kernels_match_references(name, N, T, d):
    """An AttnRes read's passes (scores, mix, the values' dots with dh, the values' gradient with x): each kernel
    equals its reference on fp32 values (every element written: odd T and d past the tiles; x summed over more
    than one token tile), and on bf16 values within one bf16 rounding of the exact sums over the values as stored."""
    x = _attn_res_inputs(N, T, d)
    triton_fn = getattr(attn_res_kernels, f"{name}_triton")
    reference = getattr(attn_res_kernels, f"{name}_reference")

    def outputs(fn, v):
        out = fn(*_ATTN_RES_CALLS[name](x, v))
        return out if isinstance(out, tuple) else (out,)

    for got, want in zip(outputs(triton_fn, x["v"]), outputs(reference, x["v"]), strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    bf = x["v"].bfloat16()
    for got, want in zip(outputs(triton_fn, bf), outputs(reference, bf.float()), strict=True):
        if got.dtype == torch.bfloat16:  # rounded once to the values' dtype
            torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=1e-5)
        else:  # fp32 sums over the bf16 values
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
