"""Whether one training micro-batch (forward, loss, backward) can be held in a CUDA graph on one GPU, and what the
replay saves against running it: the engine as a k3ray worker builds it (StageEngine at ep=1, its blocks compiled as
the default on CUDA), warmed by two training steps, then one micro-batch of fixed tokens run eagerly, captured, and
replayed. A probe for the step's launch-bound share (the profile's device idle and the host's launch time), not a
path of the trainer.

    . benchmarks/released.sh
    python benchmarks/graph_step_gpu.py --config configs/gpu2.yaml --set parallel.ep=1 $RELEASED \
        --set model.n_layers=6 --set model.vocab_size=16384 --set data.micro_batch_size=2

Prints the micro-batch's median seconds run eagerly and replayed (each synchronized), the loss of each on the same
tokens, and where the capture failed (its first line) if it did.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3ray.config import load_config, parse_assignments  # noqa: E402


def timed(fn, runs: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/gpu2.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    cfg = load_config(args.config, parse_assignments(args.set + ["parallel.ep=1", "parallel.pp=1",
                                                                 "parallel.device=cuda"]))
    from k3ray.control.local_nodes import free_port
    from k3ray.kernels import adding_into_grads
    from k3ray.parallel.engine import StageEngine
    from k3ray.parallel.step import lm_loss

    torch.cuda.set_device(0)
    engine = StageEngine(cfg, 0, 0, [0] * cfg.model.n_experts, 1, "cuda")
    engine.init_process_groups(f"tcp://127.0.0.1:{free_port()}", "nccl")
    for step in range(2):  # compiled blocks, autotuned kernels, the optimizer's state
        engine.train_step(step, step)
    stage = engine.stage
    tokens = engine.batches.micro_batch(0, 0).clone()
    documents = engine.batches.documents(tokens)

    def micro_batch() -> torch.Tensor:
        out = stage(tokens[:, :-1], documents=documents)
        loss = lm_loss(out, tokens, 1.0)
        with adding_into_grads():
            loss.backward()
        return loss.detach()

    micro_batch()  # every gradient exists: backward adds into it, as in a step's later micro-batches
    eager_s, eager_loss = timed(micro_batch, args.runs)
    print(f"[graph] {cfg.name}, {cfg.model.n_layers} layers, micro-batch {tuple(tokens.shape)}: eager "
          f"{eager_s * 1e3:.1f} ms, loss {float(eager_loss):.6f}", flush=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):  # the warm-up torch.cuda.graph asks for, on a side stream
            for _ in range(2):
                micro_batch()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        with torch.cuda.graph(graph):
            graph_loss = micro_batch()
        capture_s = time.perf_counter() - t0
    except Exception as err:  # noqa: BLE001  (what the probe is for: the first op that a capture refuses)
        first = (str(err).splitlines() or [""])[0]
        print(f"[graph] capture failed: {type(err).__name__}: {first[:300]}", flush=True)
        import traceback

        traceback.print_exc()
        return
    replay_s, _ = timed(graph.replay, args.runs)
    print(f"[graph] captured in {capture_s:.1f} s; replay {replay_s * 1e3:.1f} ms ({eager_s / replay_s:.3f}x eager), "
          f"loss {float(graph_loss):.6f}; reserved {torch.cuda.max_memory_reserved() / 2**30:.1f} GiB", flush=True)


if __name__ == "__main__":
    main()
