"""The peer, measured: torchtitan 0.3.0 training its fine-grained MoE flavour (Qwen3-MoE) sized as gpu2, on one GPU.

torchtitan's own model, parallelize function and settings as its Trainer applies them on one GPU: the model built on
the meta device, `parallelize_qwen3` (per-block torch.compile with fullgraph, FSDP2 of degree 1 for bf16 parameters
with fp32 gradient reduction, no activation checkpointing), `init_weights`, its default AdamW (fused, lr 8e-4,
betas 0.9/0.95, wd 0.1), FlexAttention (its default backend) with one causal document per row, the loss compiled.
Only the data loader is replaced by random tokens (its datasets need a download). Sizes as close to gpu2 as the
flavour allows: d 4096, 8 layers, 32 heads of 128 (GQA, 4 KV heads as Qwen3-30B-A3B), 64 experts top-8 of width 1024,
no shared expert (Qwen3-MoE has none), vocab 256, seq 4096, 16,384 tokens per step.

    torchtitan and its needs on PYTHONPATH (benchmarks/carry_torchtitan.sh packs them), then:
    python benchmarks/torchtitan_peer.py --steps 8 --warmup 3 --out $OUT
MFU counts as benchmarks/e2e_gpu.py does: 6 x active parameters + 6 x seq x heads x head_dim per attention layer,
over the dense bf16 matmul peak measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F


def build(args):
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    import torchtitan.models.qwen3 as q3
    from torchtitan.models.qwen3 import CosSinRoPE, Embedding, Linear, Qwen3Model, parallelize_qwen3

    dim, head_dim, layers, vocab = args.dim, 128, args.layers, args.vocab
    config = Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=q3._qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=q3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=q3._LINEAR_INIT),
        layers=q3._build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=layers, dim=dim, n_heads=args.heads, n_kv_heads=args.kv_heads,
            head_dim=head_dim, moe_hidden_dim=args.expert_inner, num_experts=args.experts, top_k=args.top_k,
            attn_backend=args.attn, rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=args.seq, theta=1e6),
            moe_comm_backend="standard"))
    with torch.device("meta"):
        model = config.build()
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=1,
                        spmd_backend=ParallelismConfig().spmd_backend)
    dims.build_mesh()
    model = parallelize_qwen3(model, parallel_dims=dims,
                              training=TrainingConfig(local_batch_size=args.batch, seq_len=args.seq),
                              parallelism=ParallelismConfig(), compile_config=CompileConfig(enable=args.compile),
                              ac_config=None, dump_folder="/tmp/torchtitan_peer")
    model.to_empty(device=args.device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model, config


def counts(model, args) -> dict:
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - routed + routed * args.top_k / args.experts
    flops = 6 * active + 6 * args.layers * args.seq * args.heads * 128
    return {"total_params": total, "routed_params": routed, "active_params": active, "flops_per_token": flops}


def matmul_peak_tflops(n: int = 8192, iters: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * iters / (time.perf_counter() - t0) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4, help="rows of --seq tokens per micro-batch")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step (gradient accumulation)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-inner", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--attn", default="flex")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/torchtitan_peer"))
    args = ap.parse_args()
    cuda = args.device == "cuda"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    if cuda:
        torch.cuda.set_device(0)
    import torchtitan

    peak = matmul_peak_tflops() if cuda else float("nan")
    model, config = build(args)
    info = counts(model, args)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=cuda, foreach=not cuda)
    loss_fn = torch.compile(lambda logits, labels: F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())) \
        if args.compile else (lambda logits, labels: F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()))
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(args.seq, device=args.device).repeat(args.batch, 1)
    masks = model.get_attention_masks(positions=positions) if args.attn in ("flex", "varlen") else None
    times, losses = [], []
    for step in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(args.accum):
            tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(args.device)
            logits = model(tokens[:, :-1], attention_masks=masks, positions=positions)
            loss = loss_fn(logits, tokens[:, 1:]) / args.accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        losses.append(float(total))
        times.append(time.perf_counter() - t0)
        print(f"step {step}: {times[-1]:.3f} s, loss {losses[-1]:.4f}", flush=True)
    med = statistics.median(times[args.warmup:])
    tokens_per_step = args.batch * args.seq * args.accum
    out = {"torchtitan": torchtitan.__version__ if hasattr(torchtitan, "__version__") else "0.3.0",
           "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args), **info,
           "peak_tflops": peak, "step_seconds": times, "losses": losses, "median_step_s": med,
           "tokens_per_s": tokens_per_step / med,
           "mfu": info["flops_per_token"] * tokens_per_step / med / (peak * 1e12),
           "reserved_gb": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "torchtitan_peer.json").write_text(json.dumps(out, indent=1))
    print(f"\n| system | median step s | tokens/s | MFU | GFLOP/token | active params | reserved GiB |\n"
          f"|---|---|---|---|---|---|---|\n| torchtitan 0.3.0 Qwen3-MoE (gpu2-sized) | {med:.3f} | "
          f"{out['tokens_per_s']:,.0f} | {out['mfu']:.1%} | {info['flops_per_token'] / 1e9:.2f} | "
          f"{info['active_params'] / 1e9:.2f} B | {out['reserved_gb']:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
