"""Throughput and peak memory of the released-format conversions on this machine: a synthetic release folder
(bf16, K3's structure at a reduced size, ~1.3 GB) -> `k3ray convert` -> `k3ray export --hf` -> `k3ray export
--weights-only`, each in its own process (peak RSS from the OS: ru_maxrss of the child), with the baseline RSS of a
process that only imports them.

    python benchmarks/hf_convert.py [--dir /tmp/k3ray-hfbench] [--ep 4] (EP ranks of the written grid; more
    make smaller parts, and convert holds one part)

GB/s = bytes of weights read and written once (the folder's tensor bytes) / wall seconds of the command's work
(the "seconds" it reports: after its imports). Files are written to disk and read back from the page cache.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from k3ray.formats.hf import keys as hf_keys
from k3ray.formats.hf.files import ShardWriter

MODEL = {  # K3's structure (q-LoRA MLA without RoPE, KDA with convolution, dense first layer, AttnRes), reduced
    "vocab_size": 32768, "d_model": 1024, "n_layers": 6, "n_heads": 8, "head_dim": 128, "kv_rank": 256,
    "q_lora_rank": 384, "mla_rope_dim": 64, "d_latent": 512, "n_experts": 128, "top_k": 8, "expert_inner": 512,
    "n_shared": 1, "shared_inner": 1024, "first_dense_layers": 1, "dense_inner": 4096, "mla_layers": [3, 5],
    "kda_head_dim": 128, "kda_conv_size": 4, "kda_gate_lower_bound": -5.0, "kda_scaled_read": True,
    "attn_res_block_size": 2, "norm_eps": 1e-5, "max_seq_len": 4096, "dtype": "bfloat16"}


def synthesize(out: Path) -> int:
    """A release folder of MODEL with random bf16 weights, streamed tensor by tensor; returns its tensor bytes."""
    from k3ray.config import ModelConfig
    from k3ray.formats.hf.convert import model_layout

    cfg = ModelConfig.model_validate(MODEL)
    layout = model_layout(cfg)
    entries = []
    for g in layout.groups:
        for h, shape in zip(g.hf, layout.hf_shapes(g)):
            entries.append((h, tuple(shape), torch.float32 if h.endswith("bias") else torch.bfloat16))
    one = [t.shape for t in hf_keys.expert_to_hf(*(torch.empty(s, device="meta") for s in layout.expert_shapes))]
    for layer in layout.moe_layers:
        for e in range(cfg.n_experts):
            entries += [(n, tuple(s), torch.bfloat16) for n, s in zip(hf_keys.expert_names(layer, e), one)]
    writer = ShardWriter(out, entries, max_shard_bytes=200 * 10**6)
    noise = torch.randn(1 << 21, generator=torch.Generator().manual_seed(0)).mul_(0.02).to(torch.bfloat16)
    for i, (name, shape, dtype) in enumerate(entries):  # cheap to make: windows of one noise buffer
        n = int(torch.Size(shape).numel())
        start = (i * 7919) % (1 << 20)
        t = noise[start:start + n] if n <= 1 << 20 else noise.repeat(-(-n // noise.numel()))[:n]
        writer.write(name, t.view(shape).to(dtype))
    writer.finish(hf_keys.config_to_hf(cfg))
    return writer.total


def run(*argv: str) -> tuple[dict, float, float]:
    """A k3ray command in a fresh process: (its JSON line, that process's peak RSS in MB and CPU seconds, from
    wait4)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, *argv], stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if proc.returncode:
            raise SystemExit(f"{argv}: {err.read().strip().splitlines()[-1:]}")
        return json.loads(out.read().strip().splitlines()[-1]), usage.ru_maxrss / 1024, \
            usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/k3ray-hfbench")
    ap.add_argument("--ep", type=int, nargs="+", default=[4])
    args = ap.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    t0 = time.perf_counter()
    nbytes = synthesize(root / "hf")
    print(f"synthetic release folder: {nbytes / 1e9:.2f} GB of tensors, {time.perf_counter() - t0:.1f} s to write")
    cli = ["-m", "k3ray.control.cli"]
    _, base, base_cpu = run("-c", "import k3ray.control.cli, k3ray.formats.hf.convert; print('{}')")
    rows = [("imports only (baseline)", "", None, base, base_cpu)]
    for ep in args.ep:
        info, rss, cpu = run(*cli, "convert", "--from-hf", str(root / "hf"), "--to", str(root / f"k3-ep{ep}"),
                             "--ep", str(ep))
        rows.append((f"convert --ep {ep}", f"{info['parts']} parts", info["seconds"], rss, cpu))
    for ep in args.ep:
        info, rss, cpu = run(*cli, "export", "--hf", str(root / f"k3-ep{ep}"), str(root / f"back-ep{ep}"),
                             "--max-shard-size", "500MB")
        rows.append((f"export --hf (from ep {ep})", f"{info['shards']} shards", info["seconds"], rss, cpu))
    info, rss, cpu = run(*cli, "export", "--weights-only", str(root / f"k3-ep{args.ep[-1]}"), str(root / "weights"))
    rows.append((f"export --weights-only (ep {args.ep[-1]})", f"{info['parts']} parts", info["seconds"], rss, cpu))
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("\n| command | output | wall s | GB/s (wall) | CPU s (process) | peak RSS (MB) |\n|---|---|---|---|---|---|")
    for what, out, sec, mb, cpu in rows:
        rate = f"{nbytes / 1e9 / sec:.2f}" if sec else ""
        print(f"| {what} | {out} | {sec if sec is not None else ''} | {rate} | {cpu:.1f} | {mb:.0f} |")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
