"""Train with the reference trainer and dump every MoE layer's real router inputs and updates, for
benchmarks/quantile_balance.py to replay the balancing policies on (CPU or one GPU).

    python benchmarks/balance_dump.py --config configs/tiny.yaml --set model.n_experts=64 --steps 100 --out DUMP.pt

Per step and MoE layer it keeps the router logits z = x W_r^T of every micro-batch [M, T, E] under the weights the
step ran with, the logits of the same inputs under the weights after the optimizer step (what a bias computed after
the update would see), the bias the step routed with, and the logits of `--heldout-batches` validation batches under
the model after the step (what evaluation and serving route until the next step), with the router inputs [M, T, d]
(float16) and the router weights after the step, to score older steps' inputs under a newer router. Logits are stored
as float16 (saturation at |z| ~ 17 and the score ties it makes survive the rounding). Also the step's loss and the
data's most frequent token share. About 10 MB per step at tiny's size with 64 experts.
"""
from __future__ import annotations

import argparse
import time

import torch

from k3ray.config import load_config, parse_assignments
from k3ray.parallel.reference import ReferenceTrainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--layers", default="", help="comma-separated MoE layers to dump (default: all)")
    ap.add_argument("--heldout-batches", type=int, default=8, help="validation batches routed after every step")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = load_config(args.config, {"train.steps": args.steps, **parse_assignments(args.set)})
    trainer = ReferenceTrainer(cfg)
    moes = trainer.model.moe_layers()
    if args.layers:
        moes = {i: moes[i] for i in map(int, args.layers.split(","))}
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in moes}
    heldout: dict[int, list[torch.Tensor]] = {i: [] for i in moes}

    def hook(layer):
        def grab(module, args_, output):
            kept = inputs if torch.is_grad_enabled() else heldout  # training forwards, or the held-out batches
            kept[layer].append(args_[0].detach().float().reshape(-1, args_[0].shape[-1]))
        return grab

    for layer, moe in moes.items():
        moe.router.register_forward_hook(hook(layer))
    dump = {"config": cfg.model_dump(), "layers": list(moes), "steps": []}
    first_tokens = trainer.data.batch(0, 0, 0).reshape(-1)
    dump["top_token_share"] = float(torch.bincount(first_tokens).max() / first_tokens.numel())
    t0 = time.perf_counter()
    for step in range(args.steps):
        for xs in (*inputs.values(), *heldout.values()):
            xs.clear()
        bias = {i: moe.router.bias.clone() for i, moe in moes.items()}
        weight = {i: moe.router.weight.detach().float().clone() for i, moe in moes.items()}
        report = trainer.train_step(step, step)
        with torch.no_grad():
            for b in range(args.heldout_batches):
                tokens = trainer.data.val_batch(b)
                trainer.model(tokens[:, :-1], documents=trainer._documents(tokens))
            trainer.model.reset_stats()
        rec = {"loss": report.loss, "maxvio": {i: report.maxvio[i] for i in moes}, "layers": {}}
        for i, moe in moes.items():
            x = torch.stack(inputs[i])  # [M, T, d]
            rec["layers"][i] = {
                "logits": (x @ weight[i].t()).half(),
                "logits_after": (x @ moe.router.weight.detach().float().t()).half(),
                "bias": bias[i],
                "inputs": x.half(),  # [M, T, d]: to score a step's inputs under a later step's router
                "weight_after": moe.router.weight.detach().float().clone(),  # [E, d]
                "heldout_logits": (torch.cat(heldout[i]) @ moe.router.weight.detach().float().t()).half(),
            }
        dump["steps"].append(rec)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step} loss {report.loss:.3f} MaxVio {report.mean_maxvio:.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    torch.save(dump, args.out)


if __name__ == "__main__":
    main()
