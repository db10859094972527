"""KDA (issue 24): the chunked torch reference equals the recurrent one (lengths that are and are not multiples of the
chunk, packed variable-length batches, initial and final state, gradients); prefill then decode equals one pass;
context-parallel KDA on 2 gloo ranks equals 1 rank (outputs and gradients). On CUDA with fla-core installed: fla's
chunk_kda and fused_recurrent_kda equal the fp32 torch reference on the same bf16 inputs, and the CP path on 2 GPUs.

bf16 tolerance (fla against the fp32 reference on identical bf16 inputs): relative Frobenius error of the output
<= 1e-2 and of every input gradient <= 2e-2; the fp32/fp64 CPU comparisons are to rounding (1e-10 in fp64).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from k3ray import kernels
from k3ray.control.local_nodes import free_port
from k3ray.kernels import kda as K

F64 = torch.float64


def inputs(B, T, H, Kd, V, dtype=F64, device="cpu", seed=0):
    """q, k L2-normalised; g = log alpha in (-inf, 0) around log(0.5)..0; beta in (0, 1) (as the KDA layer)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    q = F.normalize(rnd(B, T, H, Kd), dim=-1)
    k = F.normalize(rnd(B, T, H, Kd), dim=-1)
    v = rnd(B, T, H, V)
    g = -F.softplus(rnd(B, T, H, Kd) - 2.0)
    beta = torch.sigmoid(rnd(B, T, H))
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, g, beta)]


def grads(fn, xs, w):
    """Outputs of fn(*xs) and d(sum(o * w))/d xs."""
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    o = fn(*xs)
    (o * w).sum().backward()  # type promotion: bf16 * fp32 in fp32, fp64 stays fp64
    return o.detach(), [x.grad for x in xs]


# -- CPU: references ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130, 200])
def test_chunk_reference_equals_recurrent(T):
    x = inputs(2, T, 3, 16, 8)
    s0 = torch.randn(2, 3, 16, 8, dtype=F64)
    o1, s1 = K.kda_recurrent_reference(*x, initial_state=s0, output_final_state=True)
    o2, s2 = K.kda_chunk_reference(*x, initial_state=s0, output_final_state=True)
    assert o2.shape == (2, T, 3, 8) and s2.shape == (2, 3, 16, 8) and o2.dtype == F64
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, s1, rtol=1e-10, atol=1e-10)
    assert o1.abs().max() > 0.1  # not a trivially zero output


@pytest.mark.parametrize("T", [40, 150])
def test_chunk_reference_gradients_equal_recurrent(T):
    x = inputs(1, T, 2, 8, 4, seed=1)
    w = torch.randn(1, T, 2, 4, dtype=F64)
    o1, g1 = grads(lambda *a: K.kda_recurrent_reference(*a)[0], x, w)
    o2, g2 = grads(lambda *a: K.kda_chunk_reference(*a)[0], x, w)
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-10)
    for name, a, b in zip("q k v g beta".split(), g2, g1):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


def test_variable_length_batch_equals_separate_sequences():
    lengths = [10, 130, 64, 1]
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = inputs(1, int(cu[-1]), 2, 8, 4, seed=2)
    s0 = torch.randn(len(lengths), 2, 8, 4, dtype=F64)
    for ref in (K.kda_recurrent_reference, K.kda_chunk_reference):
        o, s = ref(*x, initial_state=s0, output_final_state=True, cu_seqlens=cu)
        assert o.shape == x[2].shape and s.shape == s0.shape
        for n in range(len(lengths)):
            part = [t[:, cu[n]:cu[n + 1]] for t in x]
            o_n, s_n = K.kda_recurrent_reference(*part, initial_state=s0[n:n + 1], output_final_state=True)
            torch.testing.assert_close(o[:, cu[n]:cu[n + 1]], o_n, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(s[n:n + 1], s_n, rtol=1e-10, atol=1e-10)


def test_prefill_returns_the_states_at_each_chunk_start():
    """kda_prefill_reference: the outputs and final states of the chunked pass, and with chunk_states, for every packed
    sequence the state at the start of each of its chunks (row offsets[n] + c of `chunk_layout`) equal to the final
    state of a pass over the sequence's first c * CHUNK tokens from its initial state; the layout is fla's (each
    chunk's sequence and place)."""
    lengths = [10, 130, 64, 1, 0]
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = inputs(1, int(cu[-1]), 2, 8, 4, seed=4)
    s0 = torch.randn(len(lengths), 2, 8, 4, dtype=F64)
    indices, offsets = K.chunk_layout(lengths, K.CHUNK)
    assert offsets.tolist() == [0, 1, 10, 14, 15, 15]
    assert indices.tolist() == [[0, 0], *([1, c] for c in range(9)), *([2, c] for c in range(4)), [3, 0]]
    o, s, states = K.kda_prefill_reference(*x, s0, cu, indices, offsets, chunk_states=True)
    o_want, s_want = K.kda_chunk_reference(*x, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    torch.testing.assert_close(o, o_want, rtol=0, atol=1e-12)
    torch.testing.assert_close(s, s_want, rtol=0, atol=1e-12)
    assert states.shape == (15, 2, 8, 4) and K.kda_prefill_reference(*x, s0, cu)[2] is None
    for n, length in enumerate(lengths):
        for c in range(-(-length // K.CHUNK)):
            part = [t[:, cu[n]:cu[n] + c * K.CHUNK] for t in x]
            _, want = K.kda_recurrent_reference(*part, initial_state=s0[n:n + 1], output_final_state=True)
            torch.testing.assert_close(states[offsets[n] + c], want[0], rtol=0, atol=1e-12)


def test_prefill_then_decode_equals_one_pass():
    x = inputs(2, 100, 2, 8, 4, seed=3)
    o_all, s_all = kernels.kda_attention(*x, output_final_state=True)
    _, s = kernels.kda_attention(*[t[:, :70] for t in x], output_final_state=True)
    outs = []
    for t in range(70, 100):
        o_t, s = kernels.kda_decode(*[u[:, t:t + 1] for u in x], initial_state=s)
        outs.append(o_t)
    torch.testing.assert_close(torch.cat(outs, dim=1), o_all[:, 70:], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s_all, rtol=1e-10, atol=1e-10)


def test_affine_map_of_a_slice():
    """The slice's [S_loc | M] maps any incoming state S0 to the final state of the slice run from S0."""
    q, k, v, g, beta = inputs(2, 90, 2, 8, 4, seed=4)
    s0 = torch.randn(2, 2, 8, 4, dtype=F64)
    maps = K._affine_map(k, v, g, beta)
    _, s_end = K.kda_recurrent_reference(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    torch.testing.assert_close(maps[..., 4:] @ s0 + maps[..., :4], s_end, rtol=1e-10, atol=1e-10)


# -- CPU: context parallelism over gloo ----------------------------------------------------------------------------
def _cp_rank(rank, world, port, T_local, device, backend, results):
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        dtype = F64 if device == "cpu" else torch.bfloat16
        x = inputs(1, T_local * world, 2 if device == "cpu" else 4, 16 if device == "cpu" else 128,
                   8 if device == "cpu" else 128, dtype=dtype, device=device, seed=5)
        w = torch.randn(x[2].shape, generator=torch.Generator().manual_seed(6), dtype=torch.float32).to(device)
        mine = slice(rank * T_local, (rank + 1) * T_local)
        o, gs = grads(lambda *a: kernels.kda_context_parallel(*a, group=dist.group.WORLD),
                      [t[:, mine] for t in x], w[:, mine])
        results[rank] = [o.cpu()] + [t.cpu() for t in gs]
    finally:
        dist.destroy_process_group()


def run_cp(world, T_local, device, backend):
    # the Manager's server process is spawned, not forked: on CUDA this process is multi-threaded by now
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_cp_rank, args=(world, free_port(), T_local, device, backend, results), nprocs=world, join=True)
    return [torch.cat([results[r][i] for r in range(world)], dim=1) for i in range(6)]


@pytest.mark.parametrize("T_local", [50, 100])
def test_context_parallel_two_gloo_ranks_equal_one(T_local):
    """Each rank holds T_local tokens (not a multiple of the chunk); the concatenated outputs and input gradients of
    the 2 ranks equal one rank running the whole sequence."""
    world = 2
    x = inputs(1, T_local * world, 2, 16, 8, seed=5)
    w = torch.randn(x[2].shape, generator=torch.Generator().manual_seed(6), dtype=torch.float32)
    o1, g1 = grads(lambda *a: K.kda_recurrent_reference(*a)[0], x, w)
    o2, *g2 = run_cp(world, T_local, "cpu", "gloo")
    torch.testing.assert_close(o2, o1, rtol=1e-10, atol=1e-10)
    for name, a, b in zip("q k v g beta".split(), g2, g1):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


# -- CUDA with fla-core ---------------------------------------------------------------------------------------------
needs_fla = pytest.mark.skipif(not torch.cuda.is_available() or K.fla_ops() is None,
                               reason="needs CUDA and fla-core (pip install .[kda])")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_bf16(o, gs, o_ref, gs_ref, what):
    errs = {"o": rel(o, o_ref)} | {n: rel(a, b) for n, a, b in zip("q k v g beta".split(), gs, gs_ref)}
    print(what, {n: f"{e:.1e}" for n, e in errs.items()})
    assert errs["o"] <= 1e-2, (what, errs)
    assert all(e <= 2e-2 for e in errs.values()), (what, errs)


@needs_fla
@pytest.mark.parametrize("T", [64, 200, 1000, 4096])
def test_fla_chunk_equals_reference_bf16(T):
    x = inputs(2, T, 4, 128, 128, dtype=torch.bfloat16, device="cuda", seed=7)
    w = torch.randn(2, T, 4, 128, device="cuda")
    o, gs = grads(lambda *a: K.kda_chunk_fla(*a)[0], x, w)
    assert o.dtype == torch.bfloat16
    o_ref, gs_ref = grads(lambda *a: K.kda_chunk_reference(*a)[0], [t.float() for t in x], w)
    check_bf16(o, gs, o_ref, gs_ref, f"chunk_kda T={T}")


@needs_fla
@pytest.mark.parametrize("T", [200, 1000])
def test_fla_safe_gate_equals_reference_bf16(T):
    """Gates bounded as K3's (g = -5 sigmoid(.), in (-5, 0)) take fla's tensor-core intra-chunk kernels
    (safe_gate); their outputs and gradients are the reference's as closely as the unbounded kernels' are, whole
    rows and variable-length sequences. 32 heads, as gpu2's layers: fla autotunes its kernels per head count, so
    the kept kernel cache of a training run serves this test too (a cold autotune takes minutes)."""
    x = inputs(2, T, 32, 128, 128, dtype=torch.bfloat16, device="cuda", seed=11)
    gen = torch.Generator(device="cpu").manual_seed(12)
    x[3] = (-5.0 * torch.sigmoid(torch.randn(x[3].shape, generator=gen) * 3)).to("cuda", torch.bfloat16)
    assert K.safe_gate(-5.0) and not K.safe_gate(None) and not K.safe_gate(-6.0)
    w = torch.randn(2, T, 32, 128, device="cuda")
    o, gs = grads(lambda *a: K.kda_chunk_fla(*a, gate_lower_bound=-5.0)[0], x, w)
    o_ref, gs_ref = grads(lambda *a: K.kda_chunk_reference(*a)[0], [t.float() for t in x], w)
    check_bf16(o, gs, o_ref, gs_ref, f"chunk_kda safe_gate T={T}")
    packed = [t.reshape((1, 2 * T) + t.shape[2:]) for t in x]
    cu = torch.tensor([0, T // 3, T, 2 * T], device="cuda")
    o, gs = grads(lambda *a: kernels.kda_attention(*a, cu_seqlens=cu, gate_lower_bound=-5.0)[0], packed,
                  w.reshape(1, 2 * T, 32, 128))
    o_ref, gs_ref = grads(lambda *a: K.kda_chunk_reference(*a, cu_seqlens=cu)[0], [t.float() for t in packed],
                          w.reshape(1, 2 * T, 32, 128))
    check_bf16(o, gs, o_ref, gs_ref, f"chunk_kda safe_gate varlen T={T}")


@needs_fla
def test_fla_variable_length_and_states_equal_reference_bf16():
    lengths = [100, 1000, 64, 37, 2048]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    x = inputs(1, int(cu[-1]), 4, 128, 128, dtype=torch.bfloat16, device="cuda", seed=8)
    s0 = torch.randn(len(lengths), 4, 128, 128, device="cuda") * 0.1
    o, s = K.kda_chunk_fla(*x, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    o_ref, s_ref = K.kda_chunk_reference(*[t.float() for t in x], initial_state=s0, output_final_state=True,
                                         cu_seqlens=cu)
    print("varlen", f"o {rel(o, o_ref):.1e} state {rel(s, s_ref):.1e}")
    assert rel(o, o_ref) <= 1e-2 and rel(s, s_ref) <= 1e-2
    w = torch.randn(o.shape, device="cuda")
    o, gs = grads(lambda *a: K.kda_chunk_fla(*a, cu_seqlens=cu)[0], x, w)
    o_ref, gs_ref = grads(lambda *a: K.kda_chunk_reference(*a, cu_seqlens=cu)[0], [t.float() for t in x], w)
    check_bf16(o, gs, o_ref, gs_ref, "chunk_kda varlen")


@needs_fla
def test_fla_prefill_is_chunk_kda_bit_for_bit_with_no_host_sync():
    """kda_prefill_fla (chunk_kda's forward step by step, its chunk indices from `chunk_layout`): outputs and final
    states bitwise chunk_kda's, with and without chunk states, and no host sync (CUDA's sync debug mode raises at
    one); the chunk states rounded to bf16 bitwise chunk_kda's own intermediate states; and each chunk state in fp32
    bitwise the final state of chunk_kda over the sequence's tokens before it (what a checkpoint from a pass that
    stops there holds). Safe-gate gates, 32 heads (gpu2's: the kept autotune cache serves it)."""
    lengths = [300, 1, 64, 129, 700]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    x = inputs(1, int(cu[-1]), 32, 128, 128, dtype=torch.bfloat16, device="cuda", seed=13)
    gen = torch.Generator(device="cpu").manual_seed(14)
    x[3] = (-5.0 * torch.sigmoid(torch.randn(x[3].shape, generator=gen) * 3)).to("cuda", torch.float32)
    s0 = torch.randn(len(lengths), 32, 128, 128, device="cuda") * 0.1
    indices, offsets = (t.cuda() for t in K.chunk_layout(lengths, K.FLA_CHUNK))
    with torch.no_grad():
        o_want, s_want = K.kda_chunk_fla(*x, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                                         gate_lower_bound=-5.0)
        for chunk_states in (False, True):  # the first call of each autotunes (it synchronizes): not checked
            K.kda_prefill_fla(*x, s0, cu, indices, offsets, -5.0, chunk_states)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                o, s, states = K.kda_prefill_fla(*x, s0, cu, indices, offsets, -5.0, chunk_states)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert torch.equal(o, o_want) and torch.equal(s, s_want), chunk_states
            assert (states is None) != chunk_states
        with torch.inference_mode():
            chunk_kda, _ = K.fla_ops()
            *_, h = chunk_kda(*K._fla_inputs(*x), scale=1.0, initial_state=s0, output_final_state=True,
                              cu_seqlens=cu, safe_gate=True, return_intermediate_states=True)
        assert states.dtype == torch.float32 and torch.equal(states.to(h.dtype), h[0])
        for n, c in [(0, 1), (0, 4), (3, 2), (4, 5), (4, 10)]:
            part = [t[:, cu[n]:cu[n] + c * K.FLA_CHUNK] for t in x]
            _, want = K.kda_chunk_fla(*part, initial_state=s0[n:n + 1], output_final_state=True,
                                      gate_lower_bound=-5.0)
            assert torch.equal(states[offsets[n] + c], want[0]), (n, c)


@needs_fla
def test_fla_prefill_then_decode_equals_reference_bf16():
    x = inputs(2, 300, 4, 128, 128, dtype=torch.bfloat16, device="cuda", seed=9)
    _, s = kernels.kda_attention(*[t[:, :250] for t in x], output_final_state=True)
    o_dec, s = kernels.kda_decode(*[t[:, 250:] for t in x], initial_state=s)
    o_ref, s_ref = K.kda_recurrent_reference(*[t.float() for t in x], output_final_state=True)
    print("decode", f"o {rel(o_dec, o_ref[:, 250:]):.1e} state {rel(s, s_ref):.1e}")
    assert rel(o_dec, o_ref[:, 250:]) <= 1e-2 and rel(s, s_ref) <= 1e-2


@needs_fla
def test_kda_layer_fla_equals_reference_bf16():
    from k3ray.config import ModelConfig
    from k3ray.model.layers import KDA

    cfg = ModelConfig(d_model=512, n_layers=1, n_heads=4, head_dim=128, kv_rank=64, d_latent=256, n_experts=4,
                      top_k=2, expert_inner=64, shared_inner=64, max_seq_len=1024, kda_head_dim=128)
    torch.manual_seed(0)
    layer = KDA(cfg).cuda().to(torch.bfloat16)
    x = torch.randn(2, 1000, 512, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    kernels.set_backend("reference")
    try:
        y_ref = layer(x)
    finally:
        kernels.set_backend(os.environ.get("K3RAY_KERNELS", "auto"))
    print("layer", f"{rel(y, y_ref):.1e}")
    assert rel(y, y_ref) <= 2e-2


@needs_fla
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fla_context_parallel_two_gpus_equal_one_bf16():
    T_local, world = 1024, 2
    x = inputs(1, T_local * world, 4, 128, 128, dtype=torch.bfloat16, device="cuda", seed=5)
    w = torch.randn(x[2].shape, generator=torch.Generator().manual_seed(6), dtype=torch.float32).cuda()
    o1, g1 = grads(lambda *a: K.kda_chunk_reference(*a)[0], [t.float() for t in x], w)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    o2, *g2 = run_cp(world, T_local, "cuda", "nccl")
    check_bf16(o2, g2, o1.cpu(), [t.cpu() for t in g1], "chunk_kda cp=2")


def _slots_case(device, dtype):
    """6 sequences in slots [4, 0, 7, 2, 5, 1] of a pool of 9 states, one token each."""
    x = inputs(6, 1, 4, 32, 32, dtype=dtype, device=device, seed=13)
    gen = torch.Generator(device="cpu").manual_seed(5)
    pool = torch.randn(9, 4, 32, 32, generator=gen).to(device=device, dtype=torch.float32 if dtype != F64 else F64)
    slots = torch.tensor([4, 0, 7, 2, 5, 1], device=device)
    return x, pool, slots


def test_decode_from_slots_updates_only_those_slots_in_place():
    """The slot form equals decoding from the gathered states; the slots hold the final states afterwards and
    the other slots are untouched."""
    x, pool, slots = _slots_case("cpu", F64)
    before = pool.clone()
    o_want, s_want = K.kda_recurrent_reference(*x, initial_state=pool[slots], output_final_state=True)
    o = K.kda_decode_slots_reference(*x, pool, slots)
    assert torch.equal(o, o_want) and torch.equal(pool[slots], s_want)
    others = [i for i in range(9) if i not in slots.tolist()]
    assert torch.equal(pool[others], before[others])


@needs_fla
def test_fla_decode_from_slots_equals_reference_bf16():
    x, pool, slots = _slots_case("cuda", torch.bfloat16)
    ref_pool = pool.clone()
    o = K.kda_decode_slots_fla(*x, pool, slots)
    o_ref = K.kda_decode_slots_reference(*[t.float() for t in x], ref_pool, slots)
    print("decode slots", f"o {rel(o, o_ref):.1e} pool {rel(pool, ref_pool):.1e}")
    assert rel(o, o_ref) <= 1e-2 and rel(pool, ref_pool) <= 1e-2


@needs_fla
def test_fla_short_conv_and_gate_equal_reference():
    """fla's causal_conv1d (+ SiLU, packed sequences) and fused KDA gate (both formulas), forward and backward,
    against the torch references in fp32."""
    import importlib

    C = importlib.import_module("k3ray.kernels.short_conv")  # the module: k3ray.kernels.short_conv is also a function

    g = torch.Generator(device="cuda").manual_seed(9)
    cu = torch.tensor([0, 100, 137, 400], device="cuda")
    x = torch.randn(1, 400, 3 * 256, device="cuda", generator=g, requires_grad=True)
    w = torch.randn(3 * 256, 4, device="cuda", generator=g, requires_grad=True)
    y = C.short_conv_fla(x, w, cu_seqlens=cu)[0]
    y_ref = C.short_conv_reference(x, w, cu_seqlens=cu)[0]
    assert rel(y, y_ref) <= 1e-5, rel(y, y_ref)
    dy = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, w), dy)
    assert rel(gx, gx_ref) <= 1e-5 and rel(gw, gw_ref) <= 1e-4, (rel(gx, gx_ref), rel(gw, gw_ref))
    raw = 3 * torch.randn(2, 50, 4, 128, device="cuda", generator=g, requires_grad=True)
    A_log = torch.randn(4, device="cuda", generator=g, requires_grad=True)
    dt_bias = torch.randn(4 * 128, device="cuda", generator=g, requires_grad=True)
    for lb in (None, -5.0):
        out, ref = K.kda_gate_fla(raw, A_log, dt_bias, lb), K.kda_gate_reference(raw, A_log, dt_bias, lb)
        assert rel(out, ref) <= 1e-5, (lb, rel(out, ref))
        d = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad(out, (raw, A_log, dt_bias), d),
                        torch.autograd.grad(ref, (raw, A_log, dt_bias), d)):
            assert rel(a, b) <= 1e-4, (lb, rel(a, b))
