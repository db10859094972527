"""The single-process reference trainer (the ground truth the distributed runtime must reproduce) and the training
loop shared by `k3ray train` in both modes: progress bar, a log line per step, evaluation, a final summary."""
from __future__ import annotations

import json
import logging
import time
from typing import Protocol

import torch
from tqdm import tqdm

from k3ray.config import JobConfig
from k3ray.data import TokenData
from k3ray.model.decoder import build_stage
from k3ray.optim import AdamW, clip_coefficient, lr_at
from k3ray.runtime.step import StepReport, activation_stats, layer_maxvio, lm_loss, update_router_bias

log = logging.getLogger("k3ray")


class ReferenceTrainer:
    """The whole model in one process. A step runs the same global batch as the distributed runtime:
    ep x micro_batches micro-batches, addressed by (batch_index, dp_rank, micro)."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        torch.manual_seed(cfg.train.seed)
        self.model = build_stage(cfg.model, range(cfg.model.n_layers), seed=cfg.train.seed)
        self.params = dict(self.model.named_parameters())
        self.opt = AdamW(cfg.optimizer)
        self.data = TokenData(cfg.data, cfg.train.seed)

    def train_step(self, step: int, batch_index: int) -> StepReport:
        cfg, model = self.cfg, self.model
        t0 = time.perf_counter()
        model.reset_stats()
        for p in self.params.values():
            p.grad = None
        ep, micro = cfg.parallel.ep, cfg.parallel.micro_batches
        loss_sum = torch.zeros((), dtype=torch.float64)
        for e in range(ep):
            for m in range(micro):
                tokens = self.data.batch(batch_index, e, m)
                loss = lm_loss(model(tokens[:, :-1]), tokens, 1.0 / (ep * micro))
                loss.backward()
                loss_sum += loss.detach()
        t1 = time.perf_counter()
        sq = sum(float(p.grad.float().square().sum()) for p in self.params.values() if p.grad is not None)
        lr = lr_at(cfg.optimizer, step, cfg.train.steps)
        self.opt.step(self.params, lr, clip_coefficient(sq, cfg.optimizer.grad_clip))
        tpe, maxvio = {}, {}
        for layer, moe in model.moe_layers().items():
            update_router_bias(cfg.model, moe, moe.stats.histogram, moe.stats.tokens_per_expert)
            tpe[layer] = [moe.stats.tokens_per_expert.tolist()]
            maxvio[layer] = layer_maxvio(tpe[layer])
        t2 = time.perf_counter()
        return StepReport(step=step, batch_index=batch_index, loss=float(loss_sum), grad_norm=sq ** 0.5, lr=lr,
                          tokens=ep * micro * cfg.data.micro_batch_size * cfg.data.seq_len,
                          tokens_per_expert=tpe, maxvio=maxvio, activations=activation_stats(model),
                          timings={"compute": t1 - t0, "optimizer": t2 - t1})

    @torch.no_grad()
    def evaluate(self) -> float:
        losses = []
        for i in range(self.cfg.train.eval_batches):
            tokens = self.data.val_batch(i)
            losses.append(float(lm_loss(self.model(tokens[:, :-1]), tokens, 1.0)))
        self.model.reset_stats()
        return sum(losses) / len(losses)


class Backend(Protocol):
    def train_step(self, step: int, batch_index: int) -> StepReport: ...
    def evaluate(self) -> float: ...


def run_training(backend: Backend, cfg: JobConfig, steps: int | None = None, start_step: int = 0,
                 progress: bool = True, log_json: bool = False) -> dict:
    """Drive `steps` steps through a backend (reference trainer or the Ray controller) and summarise."""
    steps = cfg.train.steps if steps is None else steps
    history: list[StepReport] = []
    evals: dict[int, float] = {}
    t_start = time.perf_counter()
    if cfg.train.eval_every:
        evals[start_step] = backend.evaluate()
    bar = tqdm(range(start_step, start_step + steps), desc=cfg.name, disable=not progress, dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        report = backend.train_step(step, step)
        dt = time.perf_counter() - t0
        history.append(report)
        bar.set_postfix(loss=f"{report.loss:.3f}", tok_s=f"{report.tokens / dt:,.0f}", maxvio=f"{report.mean_maxvio:.3f}")
        if step % cfg.train.log_every == 0:
            line = {"step": step, "loss": round(report.loss, 5), "grad_norm": round(report.grad_norm, 4),
                    "lr": float(f"{report.lr:.4g}"), "tokens_per_s": round(report.tokens / dt, 1),
                    "maxvio": round(report.mean_maxvio, 4), **{k: round(v, 4) for k, v in report.timings.items()}}
            msg = json.dumps(line) if log_json else " ".join(f"{k}={v}" for k, v in line.items())
            (tqdm.write(msg) if progress else log.info(msg))
        done = step + 1 - start_step
        if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == steps):
            evals[step + 1] = backend.evaluate()
    elapsed = time.perf_counter() - t_start
    tokens = sum(r.tokens for r in history)
    return {
        "steps": steps,
        "final_loss": history[-1].loss if history else None,
        "val_loss": evals,
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed else 0.0,
        "final_maxvio": history[-1].mean_maxvio if history else None,
        "losses": [r.loss for r in history],
    }
