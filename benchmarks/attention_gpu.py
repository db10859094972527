"""Issue 24: K3's two attention layers on one GPU, forward + backward, tokens/s against context length.

Rows (bf16, one sequence of T tokens, d_model 4096, H = 32 heads of 128, MLA kv_rank 512, as configs/gpu2.yaml):
  KDA layer        k3ray's KDA (projections, L2 norms, gate, fla-core's chunk_kda, output norm and gate, W_o);
  MLA layer        k3ray's gated MLA through SDPA with FlashAttention-2 (flash), cuDNN (the layer's default) or
                   the memory-efficient backend first;
  chunk_kda / SDPA the attention ops alone (q, k, v already projected), fla's chunk_kda and causal SDPA (flash).
Times are medians of CUDA-event timings of forward + backward after warm-up; tokens/s = T / time.

    python benchmarks/attention_gpu.py [--lengths 4096,32768,131072] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3ray.config import load_config  # noqa: E402
from k3ray.kernels import kda as K  # noqa: E402
from k3ray.model import layers  # noqa: E402


def time_fwd_bwd(fn, warmup: int, iters: int) -> float:
    """Median seconds of fn() (forward + backward) over `iters` CUDA-event timings after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def layer_step(layer, x, dy):
    def fn():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(dy)
    return fn


def op_inputs(T, H, D, device):
    gen = torch.Generator(device=device).manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16)
    q = F.normalize(torch.randn(1, T, H, D, generator=gen, **bf), dim=-1)
    k = F.normalize(torch.randn(1, T, H, D, generator=gen, **bf), dim=-1)
    v = torch.randn(1, T, H, D, generator=gen, **bf)
    g = -F.softplus(torch.randn(1, T, H, D, generator=gen, device=device) - 4.0)
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen, **bf))
    return [t.requires_grad_(True) for t in (q, k, v, g, beta)]


def kda_op_step(xs, dy):
    def fn():
        for t in xs:
            t.grad = None
        K.kda_chunk_fla(*xs)[0].backward(dy)
    return fn


def sdpa_op_step(xs, dy, backends):
    q, k, v = (t.transpose(1, 2) for t in xs[:3])

    def fn():
        for t in xs:
            t.grad = None
        with sdpa_kernel(backends, set_priority=True):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dy.transpose(1, 2))
    return fn


MLA_ORDERS = {
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH],
}


LAYER_ORDER = layers.MLA_CUDA_BACKENDS


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/gpu2.yaml")
    ap.add_argument("--lengths", default="4096,32768,131072")
    ap.add_argument("--rows", default="kda,mla-flash,mla-cudnn,mla-efficient,op-kda,op-sdpa")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/attention"))
    args = ap.parse_args(argv)
    cfg = load_config(args.config).model
    dev = torch.device("cuda")
    fla = K.fla_ops()
    import triton
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
           "fla": __import__("importlib.metadata").metadata.version("fla-core") if fla else None,
           "gpu": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "d_model": cfg.d_model, "heads": cfg.n_heads, "head_dim": cfg.head_dim, "kda_head_dim": cfg.kda_head_dim,
           "kv_rank": cfg.kv_rank}
    print(json.dumps(env), flush=True)
    rows = []
    wanted = args.rows.split(",")
    for T in (int(t) for t in args.lengths.split(",")):
        warmup, iters = (3, 10) if T <= 8192 else (2, 5) if T <= 40000 else (1, 3)
        for name in wanted:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.time()
            try:
                if name == "kda" or name.startswith("mla"):
                    torch.manual_seed(0)
                    layer = (layers.KDA(cfg) if name == "kda" else layers.GatedMLA(cfg)).to(dev, torch.bfloat16)
                    x = (torch.randn(1, T, cfg.d_model, device=dev, dtype=torch.bfloat16) * 0.5).requires_grad_(True)
                    dy = torch.randn_like(x)
                    if name.startswith("mla"):
                        layers.MLA_CUDA_BACKENDS = MLA_ORDERS[name.split("-")[1]]
                    fn = layer_step(layer, x, dy)
                else:
                    xs = op_inputs(T, cfg.n_heads, cfg.head_dim, dev)
                    dy = torch.randn_like(xs[2])
                    fn = kda_op_step(xs, dy) if name == "op-kda" else sdpa_op_step(xs, dy, MLA_ORDERS["flash"])
                if "kda" in name and fla is None:
                    raise RuntimeError("fla-core is not installed")
                s = time_fwd_bwd(fn, warmup, iters)
                row = {"T": T, "what": name, "ms": s * 1e3, "tokens_per_s": T / s,
                       "peak_gb": torch.cuda.max_memory_allocated() / 2**30, "wall_s": time.time() - t0}
            except Exception as e:  # one failing row (e.g. out of memory) must not lose the others
                row = {"T": T, "what": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            finally:
                layers.MLA_CUDA_BACKENDS = LAYER_ORDER
                fn = layer = x = xs = dy = None
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_gpu.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(f"\nforward + backward, bf16, one sequence, d_model {cfg.d_model}, {cfg.n_heads} heads x {cfg.head_dim}; "
          f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, fla-core {env['fla']}")
    print(f"| T | what | ms | tokens/s | peak GiB |\n|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['T']} | {r['what']} | {r['error']} | | |")
        else:
            print(f"| {r['T']} | {r['what']} | {r['ms']:.2f} | {r['tokens_per_s'] / 1e6:.3f}M | {r['peak_gb']:.1f} |")


if __name__ == "__main__":
    main()
