"""DeepSpeed-MoE peer baseline: the same MoE block shapes as our layer, run through
``deepspeed.moe.layer.MoE`` with dropless routing (drop_tokens=False).

    x [tokens, d_model] -> W_down (d_model -> d_latent)
      -> deepspeed MoE(hidden=d_latent, GLU experts d_latent -> 2*inner -> d_latent, top-k, ep ranks)
      -> W_up (d_latent -> d_model)

Router skew: the gate's logits get a bias  b_e = -zipf * ln(e + 1)  (expert e's routing
probability ~ (e + 1)^-zipf; zipf=0: no bias), matching the "zipf:A" traces of k3ray.traces.

``deepspeed_moe_layer_ms`` is meant to be called inside an already initialised
torch.distributed process group (NCCL on GPU, one process per GPU, world size = ep;
gloo on CPU).  ``python benchmarks/moe_deepspeed.py`` launches the ep processes itself.

DeepSpeed is not a dependency of k3ray: on the offline GPU machine it comes from the
wheels that benchmarks/carry_deepspeed.sh puts in .whl/:

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/dsw .whl/*.whl
    PYTHONPATH=/tmp/dsw:$PYTHONPATH python3 benchmarks/moe_deepspeed.py            # 2 x H200 defaults

How DeepSpeed 0.19.x executes dropless top-k (deepspeed/moe/sharded_moe.py), which is what
this baseline measures: with drop_tokens=False the capacity C of *every* expert is the
largest per-(rank, expert) token count, all-reduced (MAX) over the EP group, each step.
Every rank then ships an [E, C, d] buffer through two equal-split all-to-alls and runs
each local expert on ep*C rows, padded with zero rows.  So compute and all-to-all volume
are E*C rows per rank instead of tokens*k: under skew C approaches ``tokens`` (each token
can pick an expert once), i.e. up to E/k times the useful work.  The local experts run
one after another (a Python loop over nn.Modules), and reading C costs a device->host sync.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from k3ray.control.local_nodes import free_port

ZIPFS = (0.0, 1.2, 1.5)
_GATING_FNS = ("top1gating", "top2gating", "topkgating")


def _import_deepspeed(device: str):
    """Import deepspeed with the accelerator pinned to ``device`` and no op pre-build."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if str(device).startswith("cuda") else "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")
    import importlib

    import deepspeed

    # (not `import deepspeed.comm.torch as m`: that resolves to the real torch module,
    # which deepspeed.comm re-exports under the same name)
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    # DeepSpeed's TorchBackend asks the accelerator for a shared-memory allreduce op and
    # JIT-compiles it (C++) when the CPU accelerator says it is compatible. The MoE layer
    # only needs plain torch.distributed collectives, so never build anything.
    ds_torch_comm.build_shm_op = lambda: None
    return deepspeed


class GLUExpert(nn.Module):
    """Linear(d, 2*inner) split into gate/up, silu(gate) * up, Linear(inner, d); no biases."""

    def __init__(self, d: int, inner: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(d, 2 * inner, bias=False)
        self.w_out = nn.Linear(inner, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(F.silu(gate) * up)


class DeepSpeedMoEBlock(nn.Module):
    def __init__(self, moe_cls, d_model: int, d_latent: int, inner: int, n_experts: int, top_k: int,
                 ep: int) -> None:
        super().__init__()
        self.w_down = nn.Linear(d_model, d_latent, bias=False)
        self.moe = moe_cls(hidden_size=d_latent, expert=GLUExpert(d_latent, inner), num_experts=n_experts,
                           ep_size=ep, k=top_k, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=0,
                           drop_tokens=False, use_rts=False, noisy_gate_policy=None,
                           top2_2nd_expert_sampling=False)
        self.w_up = nn.Linear(d_latent, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _l_aux, _counts = self.moe(self.w_down(x))
        return self.w_up(h)


def _install_gate_bias(gate: nn.Module, bias: torch.Tensor) -> list[int]:
    """Make the gate's logits wg(x) + bias.

    TopKGate.forward computes ``F.linear(x.float(), wg.weight.float(), bias=None)`` (so a
    bias Parameter on ``wg`` would be ignored) and hands the logits to the module-level
    top1gating / top2gating / topkgating. For the duration of this gate's forward those
    are swapped for wrappers that add ``bias`` (fp32) to the logits. Returns a one-element
    counter of how often the bias was applied, to check the hook is live.
    """
    import deepspeed.moe.sharded_moe as sm

    bias = bias.detach().float()
    applied = [0]
    inner_forward = gate.forward  # bound method of the class

    def biased(fn):
        def call(logits, *args, **kwargs):
            applied[0] += 1
            return fn(logits + bias, *args, **kwargs)

        return call

    def forward(*args, **kwargs):
        saved = {name: getattr(sm, name) for name in _GATING_FNS}
        for name, fn in saved.items():
            setattr(sm, name, biased(fn))
        try:
            return inner_forward(*args, **kwargs)
        finally:
            for name, fn in saved.items():
                setattr(sm, name, fn)

    gate.forward = forward  # instance attribute: nn.Module.__call__ picks it up
    return applied


def zipf_bias(n_experts: int, zipf: float) -> torch.Tensor:
    return -float(zipf) * torch.log(torch.arange(n_experts, dtype=torch.float32) + 1.0)


def deepspeed_moe_layer_ms(tokens: int, d_model: int, d_latent: int, inner: int, n_experts: int, top_k: int,
                           ep: int, zipf: float, iters: int, warmup: int, device: str, dtype,
                           seed: int = 0, gate_std: float | None = None) -> dict[str, Any]:
    """Median forward+backward ms of W_down -> deepspeed MoE (dropless) -> W_up on every rank.

    Call inside an initialised torch.distributed group with world size == ep (one process
    per GPU). ``tokens`` is per rank. Returns the slowest rank's median (ms_median),
    global tokens/s, the routed load skew across ranks / experts and DeepSpeed's padding.

    gate_std: None keeps nn.Linear's default init of the gate (logit std ~0.33 at the default
    shapes, so the zipf bias decides nearly all of the routing); a number rescales the gate
    weight once so that the unbiased logits wg(W_down x) have that std (mean over ranks).
    """
    assert dist.is_initialized(), "needs an initialised torch.distributed process group"
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world == ep, f"world size {world} != ep {ep}: run one process per expert-parallel rank"
    assert n_experts % ep == 0, f"{n_experts} experts do not split over ep={ep}"
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    if on_cuda and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())

    deepspeed = _import_deepspeed(str(device))
    from deepspeed.moe.layer import MoE

    # deepspeed.comm wraps the existing torch.distributed group (TorchBackend skips
    # init_process_group when torch.distributed is already initialised).
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=None, verbose=False)

    # Same non-expert weights and gate on every rank (they are data-parallel replicas);
    # each rank's local experts get their own init.
    torch.manual_seed(seed)
    model = DeepSpeedMoEBlock(MoE, d_model, d_latent, inner, n_experts, top_k, ep)
    n_local = n_experts // ep
    for i, expert in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
        torch.manual_seed(seed + 1 + rank * n_local + i)
        for lin in (expert.w_in, expert.w_out):
            lin.reset_parameters()
    model.moe.set_deepspeed_parallelism()  # creates/reuses the "ep_size_{ep}" group, hands it to the gate
    model.to(device=device, dtype=dtype).train()

    applied = _install_gate_bias(model.moe.deepspeed_moe.gate, zipf_bias(n_experts, zipf).to(device))

    gen = torch.Generator(device="cpu").manual_seed(seed + 1000 + rank)
    x = torch.randn(tokens, d_model, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)

    wg = model.moe.deepspeed_moe.gate.wg.weight
    with torch.no_grad():
        def logit_std() -> float:
            std = (model.w_down(x).float() @ wg.float().t()).std().reshape(1).double()
            dist.all_reduce(std)
            return float(std) / world
        std0 = logit_std()
        if gate_std is not None:
            wg.mul_(gate_std / std0)
        std1 = logit_std()

    def step() -> None:
        out = model(x)
        loss = out.float().square().mean()
        loss.backward()

    def clear_grads() -> None:
        model.zero_grad(set_to_none=True)
        x.grad = None

    for _ in range(warmup):
        clear_grads()
        step()
    if on_cuda:
        torch.cuda.synchronize(device)
    dist.barrier()

    times: list[float] = []
    for _ in range(iters):
        clear_grads()
        if on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    if applied[0] == 0:
        raise RuntimeError("the gate-bias hook never ran: this DeepSpeed version computes gating differently")

    # Routing of the last step (weights never change, so every step routes alike):
    # exp_counts = tokens this rank sends to each expert, before any capacity cut.
    counts = torch.zeros(world, n_experts, dtype=torch.float64, device=device)
    counts[rank] = model.moe.deepspeed_moe.exp_counts.to(device=device, dtype=torch.float64)
    stats = torch.tensor([statistics.median(times), -statistics.median(times)], dtype=torch.float64,
                         device=device)
    dist.all_reduce(counts)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    ms_max, ms_min = float(stats[0]), -float(stats[1])
    per_expert = counts.sum(0)                          # global tokens per expert
    per_rank = per_expert.view(ep, n_local).sum(1)      # global tokens each rank's experts get
    capacity = int(counts.max())                        # what sharded_moe's no-drop path all-reduces
    routed = tokens * ep * top_k
    return {
        "ms_median": ms_max,                             # slowest rank's median
        "ms_median_fastest_rank": ms_min,
        "ms_per_iter_rank0": times if rank == 0 else None,
        "tokens_per_s": tokens * ep / (ms_max / 1e3),
        "max_rank_tokens_over_mean": float(per_rank.max() / per_rank.mean()),
        "max_expert_tokens_over_mean": float(per_expert.max() / per_expert.mean()),
        "capacity": capacity,
        # rows every rank's experts compute (incl. zero padding) over the useful routed rows
        "padded_rows_over_routed": n_experts * capacity * ep / routed,
        "logit_std": std1,                               # of wg(h) before the zipf bias
        "deepspeed_version": deepspeed.__version__,
    }


# ----------------------------------------------------------------------------- launcher

def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    on_cuda = args.device.startswith("cuda")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.ep), LOCAL_RANK=str(rank), LOCAL_SIZE=str(args.ep),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_cuda else "cpu")
    os.environ.setdefault("DS_BUILD_OPS", "0")
    if on_cuda:
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        device = "cpu"
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ep, **({"device_id": torch.device(device)} if on_cuda else {}))
    try:
        import logging

        from deepspeed.utils import logger as ds_logger
        ds_logger.setLevel(logging.WARNING)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
            args.dtype or ("bf16" if on_cuda else "fp32")]
        rows = []
        for zipf in args.zipf:
            r = deepspeed_moe_layer_ms(args.tokens, args.d_model, args.d_latent, args.inner, args.experts,
                                       args.top_k, args.ep, zipf, args.iters, args.warmup, device, dtype,
                                       gate_std=args.gate_std)
            rows.append((zipf, r))
            if rank == 0:
                print(f"zipf={zipf}: {r}", flush=True)
        if rank == 0:
            ver = rows[0][1]["deepspeed_version"]
            print(f"\nDeepSpeed {ver} MoE (drop_tokens=False), {args.ep} x {args.device}, {dtype}, "
                  f"tokens/rank={args.tokens} d_model={args.d_model} d_latent={args.d_latent} inner={args.inner} "
                  f"E={args.experts} top-{args.top_k}, fwd+bwd, median of {args.iters}, "
                  f"gate logit std {rows[0][1]['logit_std']:.2f}"
                  f"{'' if args.gate_std is not None else ' (default init)'}\n")
            print("| zipf | ms (median) | Mtok/s (global) | max rank load / mean | max expert load / mean "
                  "| capacity C | padded rows / routed |")
            print("|---:|---:|---:|---:|---:|---:|---:|")
            for zipf, r in rows:
                print(f"| {zipf:g} | {r['ms_median']:.2f} | {r['tokens_per_s'] / 1e6:.3f} "
                      f"| {r['max_rank_tokens_over_mean']:.2f} | {r['max_expert_tokens_over_mean']:.2f} "
                      f"| {r['capacity']} | {r['padded_rows_over_routed']:.2f} |", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without running interpreter/static teardown: gloo's threads sometimes abort
    # there ("terminate called without an active exception") after all the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--d-latent", type=int, default=2048)
    p.add_argument("--inner", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--ep", type=int, default=2, help="expert-parallel ranks = processes (one per GPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"), help="default: bf16 cuda, fp32 cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=None, help="default: min(5, iters)")
    p.add_argument("--zipf", type=float, nargs="+", default=list(ZIPFS))
    p.add_argument("--gate-std", type=float, default=None,
                   help="rescale the gate so its unbiased logits have this std (default: keep nn.Linear init)")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = min(5, args.iters)
    if args.device == "cuda" and torch.cuda.device_count() < args.ep:
        sys.exit(f"--ep {args.ep} needs {args.ep} GPUs, found {torch.cuda.device_count()}")
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(args, free_port()), nprocs=args.ep, join=True)


if __name__ == "__main__":
    main()
