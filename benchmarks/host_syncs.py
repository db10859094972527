"""Where a training step waits for the device, found on CPU: one step of the plain engine (StageEngine, as a k3ray
worker runs it) at a small shape of a config (gpu2's layout and features by default) under a dispatch mode that
counts every aten op (on a GPU, about one kernel launch each), by op and by the innermost k3ray frame that called
it, and names the ops that make the host wait for the device there, each with that frame.

    python benchmarks/host_syncs.py --config configs/gpu2.yaml $RELEASED [--set model.d_model=256 ...]
    python benchmarks/host_syncs.py --device cuda --config configs/gpu2.yaml $RELEASED   # the config's own shapes

On CPU (a small shape of the config, float32) the host waits counted are `.item()` / `.tolist()` / `bool()` /
`int()` / `float()` on a tensor (Python-level, wrapped) and the aten ops whose output size depends on the data
(`nonzero`, `masked_select`, `unique`, boolean indexing, `repeat_interleave` without output_size, `bincount`, ...);
ops of the torch references that stand in for GPU kernels on CPU (fla's KDA, Triton experts) are counted too, their
GPU kernels run instead there. On CUDA every synchronizing call is caught by torch's sync debug mode, fla's and
Triton's included, each named by its k3ray caller.
"""
from __future__ import annotations

import argparse
import collections
import sys
import traceback
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3ray.config import load_config, parse_assignments  # noqa: E402

SMALL = ["model.d_model=256", "model.n_heads=4", "model.head_dim=32", "model.kv_rank=64", "model.d_latent=128",
         "model.expert_inner=64", "model.shared_inner=128", "model.kda_head_dim=32", "model.dense_inner=512",
         "model.q_lora_rank=64", "model.mla_rope_dim=16", "model.max_seq_len=256", "data.seq_len=256",
         "model.dtype=float32", "parallel.device=cpu", "parallel.ep=1", "parallel.pp=1"]
SYNC_OPS = {"aten::nonzero", "aten::masked_select", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive",
            "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::bincount", "aten::masked_scatter",
            "aten::nonzero_static", "aten::histc", "aten::_assert_async"}
ROOT = str(Path(__file__).resolve().parents[1] / "k3ray")


def caller() -> str:
    """The innermost k3ray frame of the current Python stack (file:line function)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(ROOT):
            return f"{frame.filename[len(ROOT) - 5:]}:{frame.lineno} {frame.name}"
    return "(outside k3ray)"


class Counter(TorchDispatchMode):
    def __init__(self, device_only: bool = False):
        super().__init__()
        self.device_only = device_only  # on a GPU, data-dependent ops on CPU tensors make nothing wait
        self.ops = collections.Counter()
        self.callers = collections.Counter()  # ops by their innermost k3ray frame (autograd's backward: outside)
        self.syncs = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"aten::{func._schema.name.split('::')[-1]}"
        where = caller()
        self.ops[name] += 1
        self.callers[where] += 1
        if self._waits(name, args, kwargs or {}):
            self.syncs[(name, where)] += 1
        return func(*args, **(kwargs or {}))

    def _waits(self, name: str, args: tuple, kwargs: dict) -> bool:
        """Whether the op's output size or value depends on data the host must read first."""
        if self.device_only and all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor)):
            return False
        if name in SYNC_OPS:
            return True
        if name == "aten::repeat_interleave":
            return kwargs.get("output_size") is None and len(args) >= 2 and isinstance(args[1], torch.Tensor)
        if name == "aten::index":
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                       for i in (args[1] if len(args) > 1 else []) if i is not None)
        return False

def wrap_host_reads(counter: Counter) -> None:
    """Count the Python-level reads of tensor values (on a GPU each waits for the device)."""
    for attr in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        original = getattr(torch.Tensor, attr)

        def wrapped(self, *a, _original=original, _attr=attr, **k):
            if not isinstance(self, torch.nn.Parameter) and self.device.type != "meta":
                counter.syncs[(f".{_attr}()", caller())] += 1
            return _original(self, *a, **k)

        setattr(torch.Tensor, attr, wrapped)


def catch_device_syncs(counter: Counter) -> None:
    """Count every call that synchronizes with a CUDA device (torch's sync debug mode warns on each), by caller."""
    def record(*_):
        counter.syncs[("device sync", caller())] += 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/gpu2.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    shape = ["parallel.ep=1", "parallel.pp=1", "parallel.device=cuda"] if cuda else SMALL
    cfg = load_config(args.config, parse_assignments(shape + args.set))
    from k3ray.control.local_nodes import free_port
    from k3ray.parallel.engine import StageEngine

    torch.manual_seed(0)
    engine = StageEngine(cfg, 0, 0, [0] * cfg.model.n_experts, 1, args.device)
    engine.init_process_groups(f"tcp://127.0.0.1:{free_port()}", "nccl" if cuda else "gloo")
    for step in range(2):  # the first steps make the optimizer state, caches, compiled and autotuned kernels
        engine.train_step(step, step)
    counter = Counter(device_only=cuda)
    if cuda:
        torch.cuda.synchronize()
        catch_device_syncs(counter)
    else:
        wrap_host_reads(counter)
    with counter:
        engine.train_step(2, 2)
    if cuda:
        torch.cuda.set_sync_debug_mode("default")
    print(f"{cfg.name}: {cfg.model.n_layers} layers {cfg.model.attention_pattern}, {cfg.parallel.micro_batches} "
          f"micro-batches; one training step: {sum(counter.ops.values()):,} aten ops, "
          f"{sum(counter.syncs.values())} host waits on a GPU")
    print("\n| host waits | op | first k3ray caller |\n|---|---|---|")
    for (op, where), n in counter.syncs.most_common():
        print(f"| {n} | {op} | {where} |")
    print(f"\n| ops | aten op |\n|---|---|")
    for op, n in counter.ops.most_common(args.top):
        print(f"| {n} | {op} |")
    print(f"\n| ops | innermost k3ray caller (outside k3ray: autograd's formulas, torch's own) |\n|---|---|")
    for where, n in counter.callers.most_common(args.top):
        print(f"| {n} | {where} |")


if __name__ == "__main__":
    main()
