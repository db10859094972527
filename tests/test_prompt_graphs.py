"""Prompt iterations in pieces (k3ray.parallel.prompt_graphs): token buckets, and the pieces' data path (static
token-wise inputs, seams running the iteration's cache methods) equal to the plain forward: on a CPU run eagerly
(float64, every released feature; a first stage and a later one), on a GPU replayed from CUDA graphs."""
from __future__ import annotations

import pytest
import torch

from conftest import RELEASED
from k3ray.config import load_config
from k3ray.model.cache import SeqAdmit, StateSave, new_pools
from k3ray.model.decoder import build_stage
from k3ray.parallel.prompt_graphs import prompt_bucket
from k3ray.parallel.serving import RankPlan, StageServer


def test_prompt_buckets_are_multiples_of_64_at_most_a_quarter_above_past_512():
    buckets = [prompt_bucket(t) for t in range(1, 20000)]
    assert buckets == sorted(buckets)
    for t, b in zip(range(1, 20000), buckets):
        assert b >= t and b % 64 == 0
        assert b - t < 64 if t <= 512 else b <= 1.25 * t
    assert sorted(set(b for b in buckets if b <= 8192))[7:] == [512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048,
                                                                2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192]


def serve_script(stage, device: str, prompt_graphs: bool, graphs: bool = False):
    """Iterations of a prefix-cache workload on one server: a prompt row alone; a decode row beside a prompt row that
    saves its KDA states inside and at its end; a row admitted from that checkpoint beside a 70-token prompt (a
    bucket past 64 tokens); then decode rows. Returns (every step's StageOutput, the pools)."""
    cfg = stage.cfg
    pools = new_pools(cfg, stage.layers, 96, 4, 4, device=device, checkpoints=2)
    server = StageServer(stage, pools, device, graphs=graphs, prompt_graphs=prompt_graphs, token_budget=256)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, cfg.vocab_size, (80,), generator=g).tolist()
    outs = [server.step(RankPlan([0], [0], [5], prompt[:5], [0], admit=[SeqAdmit(0, list(range(8)))]))]
    outs.append(server.step(RankPlan([0, 1], [5, 0], [1, 13], [outs[-1].tokens[0], *prompt[:13]], [1, 0],
                                     admit=[SeqAdmit(1, list(range(8, 16)))],
                                     saves=[StateSave(1, 8, 0), StateSave(1, 13, 1)])))
    # slot 2 continues slot 1's first 8 tokens from checkpoint 0 (its pages shared), slot 3 a long prompt
    outs.append(server.step(RankPlan([2, 3, 0], [8, 0, 6], [5, 70, 1], [*prompt[8:13], *prompt[:70],
                                     outs[-1].tokens[0]], [0, 0, 2],
                                     admit=[SeqAdmit(2, [8, 9, *range(16, 22)], checkpoint=0),
                                            SeqAdmit(3, list(range(22, 42)), temperature=0.8, seed=3)])))
    for _ in range(3):
        last = outs[-1].tokens
        outs.append(server.step(RankPlan([2, 3, 0], [13 + _, 70 + _, 7 + _], [1, 1, 1], last, [1 + _, 1 + _, 3 + _])))
    return outs, pools, server


def assert_same_serving(got, want, atol: float) -> None:
    (outs_g, pools_g, _), (outs_w, pools_w, _) = got, want
    assert [o.tokens for o in outs_g] == [o.tokens for o in outs_w]
    for a, b in zip(outs_g, outs_w):
        torch.testing.assert_close(torch.tensor(a.maxabs), torch.tensor(b.maxabs), rtol=0, atol=atol)
    for name in ("state", "conv", "checkpoint_state", "checkpoint_conv", "load"):
        for layer, t in getattr(pools_w, name).items():
            real = slice(0, pools_w.slots) if name in ("state", "conv") else slice(None)  # the scratch slot aside
            torch.testing.assert_close(getattr(pools_g, name)[layer][real], t[real], rtol=0, atol=atol)
    for layer, t in pools_w.latent.items():  # every page but the scratch one
        torch.testing.assert_close(pools_g.latent[layer][:-1], t[:-1], rtol=0, atol=atol)


@pytest.mark.parametrize("rope", [False, True], ids=["released", "rope"])
def test_prompt_pieces_run_eagerly_serve_as_the_plain_forward(rope):
    """The pieces' data path on a CPU (the seams on the iteration's cache, token-wise inputs from static tensors, the
    iterations padded to their buckets) gives every step's tokens and max-abs, the KDA states and convolution tails,
    the prefix cache's checkpoints, the latents and the experts' served load of the plain forward. float64."""
    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64", **RELEASED, "model.mla_rope": rope}).model
    stage = build_stage(cfg, range(cfg.n_layers), seed=7)
    pieces = serve_script(stage, "cpu", prompt_graphs=True)
    assert sorted(pieces[2].prompt_graphs.buckets) == [64, 128]  # the 8-token iteration's and the 76-token one's
    assert_same_serving(pieces, serve_script(stage, "cpu", prompt_graphs=False), atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="prompt CUDA graphs need a GPU")
def test_prompt_graphs_replayed_serve_as_the_eager_forward():
    """On a GPU every prompt iteration replays its bucket's graphs, the seams between them, and serves what the
    eager forward serves (the same kernels on the same shapes: both pad to 64 tokens up to 512)."""
    cfg = load_config("configs/tiny.yaml", {**RELEASED, "parallel.device": "cuda"}).model
    stage = build_stage(cfg, range(cfg.n_layers), device="cuda")
    graphed = serve_script(stage, "cuda", prompt_graphs=True, graphs=True)
    prompt_graphs = graphed[2].prompt_graphs
    assert prompt_graphs.enabled and sorted(prompt_graphs.buckets) == [64, 128]
    n_seams = sum(2 if cfg.layer_kind(i) == "kda" and cfg.kda_conv_size else 1 for i in range(cfg.n_layers))
    assert all(len(b.graphs) == n_seams + 1 for b in prompt_graphs.buckets.values())
    assert_same_serving(graphed, serve_script(stage, "cuda", prompt_graphs=False, graphs=True), atol=1e-5)
    # a server's start captures every bucket up to its token budget, smallest first, within its budget of seconds,
    # outside a step's no_grad yet keeping no autograd history (it would hold every layer's activations)
    assert prompt_graphs.capture_ahead(float("inf")) == 2 and sorted(prompt_graphs.buckets) == [64, 128, 192, 256]
    assert torch.is_grad_enabled() and all(b.out.grad_fn is None for b in prompt_graphs.buckets.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_serving_step_waits_for_the_gpu_once_for_its_tokens(graphs):
    """A worker's step waits for the device once: for the tokens it samples. Its inputs (admissions, a state restored
    from a checkpoint, pages grown, the plan's indices) go over without a stream synchronize, and its forward makes
    none: a prompt of 64 tokens admitted fresh; then a 60-token row from a checkpoint, saving inside a chunk and at
    its end, beside a decode row that grows a page; then both decoding. CUDA's sync debug mode counts the waits on
    a second run of the same steps (the first autotunes and captures). Eager, and from CUDA graphs."""
    import warnings

    from k3ray.model.cache import SeqPages

    cfg = load_config("configs/tiny.yaml", {**RELEASED, "parallel.device": "cuda"}).model
    stage = build_stage(cfg, range(cfg.n_layers), device="cuda")
    pools = new_pools(cfg, stage.layers, 96, 4, 4, device="cuda", checkpoints=4)
    server = StageServer(stage, pools, "cuda", graphs=graphs, token_budget=256)
    prompt = torch.randint(0, cfg.vocab_size, (128,), generator=torch.Generator().manual_seed(6)).tolist()

    def steps(a: int, b: int, page0: int, ckpt: int):  # slots a (prompt, then decode) and b (from a's checkpoint)
        yield RankPlan([a], [0], [64], prompt[:64], [0], admit=[SeqAdmit(a, list(range(page0, page0 + 16)))],
                       saves=[StateSave(0, 64, ckpt)], greedy=True)
        yield RankPlan([a, b], [64, 64], [1, 60], [prompt[64], *prompt[64:124]], [1, 0], greedy=True,
                       admit=[SeqAdmit(b, [*range(page0, page0 + 16), *range(page0 + 17, page0 + 32)],
                                       checkpoint=ckpt)],
                       grow=[SeqPages(a, 16, [page0 + 16])],
                       saves=[StateSave(1, 30, ckpt + 1), StateSave(1, 60, ckpt + 2)])
        yield RankPlan([a, b], [65, 124], [1, 1], [prompt[65], prompt[124]], [2, 1], greedy=True)

    with torch.no_grad():
        for plan in steps(0, 1, 0, 0):  # kernels autotune, graphs are captured
            server.step(plan)
        torch.cuda.synchronize()
        for i, plan in enumerate(steps(2, 3, 40, 1)):
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    server.step(plan)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            waits = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
            assert len(waits) == 1, (i, waits)


def test_a_later_stage_runs_its_pieces_from_the_hidden_state_it_receives():
    """A pipeline stage after the first takes the hidden state (with Block AttnRes, the block summary too) into its
    pieces' static input: its logits, max-abs, KDA states, latents and served load equal its plain forward's.
    float64, every released feature, the second half of the layers."""
    from k3ray.model.cache import IterationCache
    from k3ray.model.decoder import boundary_shape
    from k3ray.parallel.serving import padded_prefill

    cfg = load_config("configs/tiny.yaml", {"model.dtype": "float64", **RELEASED}).model
    stage = build_stage(cfg, range(2, cfg.n_layers), seed=9)
    plan = RankPlan([0, 1], [0, 0], [17, 30], [], [0, 0])

    def serve(prompt_graphs: bool):
        pools = new_pools(cfg, stage.layers, 32, 4, 4)
        pools.admit([SeqAdmit(0, list(range(8))), SeqAdmit(1, list(range(8, 16)))])
        server = StageServer(stage, pools, "cpu", prompt_graphs=prompt_graphs, token_budget=256)
        padded = padded_prefill(plan, pools.scratch_slot, 64, pools.max_pages * pools.page_size)
        cache = IterationCache.from_plan(pools, padded.slots, padded.starts, padded.counts, "cpu", padded=True)
        x = torch.randn(boundary_shape(cfg, 2, 1, 64), generator=torch.Generator().manual_seed(3),
                        dtype=torch.float64)
        out, tokens, maxabs = server.forward(x, cache, torch.zeros(len(padded.slots), dtype=torch.int64), True)
        assert (server.prompt_graphs is not None and 64 in server.prompt_graphs.buckets) == prompt_graphs
        return out[:2], tokens[:2], maxabs[:2], pools

    (out, tokens, maxabs, pools), (want_out, want_tokens, want_maxabs, want) = serve(True), serve(False)
    assert boundary_shape(cfg, 2, 1, 64)[0] > 1  # the block summary travels with the hidden state
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    assert tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(maxabs, want_maxabs, rtol=0, atol=1e-12)
    for name in ("state", "conv", "latent", "load"):
        for layer, t in getattr(want, name).items():
            torch.testing.assert_close(getattr(pools, name)[layer], t, rtol=0, atol=1e-12)
