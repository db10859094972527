"""The single-process references: the trainer (the whole model in one process, the ground truth the distributed
runtime must reproduce, `k3ray train --single-process`) and generation (what serving must reproduce)."""
from __future__ import annotations

import time

import torch

from k3ray.config import JobConfig
from k3ray.data import EOS, open_token_data
from k3ray.model.decoder import K3Stage, build_stage
from k3ray.model.layers import Documents
from k3ray.model.sampling import SamplingParams, finish_reason, next_token
from k3ray.optim import AdamW, clip_coefficient, lr_at
from k3ray.parallel.step import StepReport, activation_stats, balance_diagnostics, lm_loss, update_router_bias


class ReferenceTrainer:
    """The whole model in one process. A step runs the same global batch as the distributed runtime:
    ep x micro_batches micro-batches, addressed by (batch_index, dp_rank, micro)."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        torch.manual_seed(cfg.train.seed)
        self.model = build_stage(cfg.model, range(cfg.model.n_layers), seed=cfg.train.seed).train()
        self.params = dict(self.model.named_parameters())
        self.opt = AdamW(cfg.optimizer)
        self.data = open_token_data(cfg)

    def _documents(self, tokens: torch.Tensor) -> Documents | None:
        return Documents(tokens[:, :-1], self.data.eos_id) if self.cfg.data.document_masking else None

    def train_step(self, step: int, batch_index: int, ahead: bool = False) -> StepReport:
        """One step (`ahead` changes nothing: one process steps synchronously)."""
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
                loss = lm_loss(model(tokens[:, :-1], documents=self._documents(tokens)), tokens, 1.0 / (ep * micro))
                loss.backward()
                loss_sum += loss.detach()
        t1 = time.perf_counter()
        sq = sum(float(p.grad.float().square().sum()) for p in self.params.values() if p.grad is not None)
        lr = lr_at(cfg.optimizer, step, cfg.train.steps)
        self.opt.step(self.params, lr, clip_coefficient(torch.tensor(sq, dtype=torch.float64), cfg.optimizer.grad_clip))
        tpe, balance = {}, {}
        for layer, moe in model.moe_layers().items():
            update_router_bias(cfg.model, moe, moe.stats.histogram, moe.stats.tokens_per_expert)
            tpe[layer] = [moe.stats.tokens_per_expert.tolist()]
            if moe.stats.balance is not None:
                balance[layer] = balance_diagnostics(moe.stats.balance, cfg.model.n_experts)
        t2 = time.perf_counter()
        return StepReport(step=step, batch_index=batch_index, loss=float(loss_sum), grad_norm=sq ** 0.5, lr=lr,
                          tokens=cfg.step_tokens(), tokens_per_expert=tpe, activations=activation_stats(model),
                          timings={"compute": t1 - t0, "optimizer": t2 - t1}, balance=balance)

    @torch.no_grad()
    def evaluate(self) -> float:
        losses = []
        for i in range(self.cfg.train.eval_batches):
            tokens = self.data.val_batch(i)
            losses.append(float(lm_loss(self.model(tokens[:, :-1], documents=self._documents(tokens)), tokens, 1.0)))
        self.model.reset_stats()
        return sum(losses) / len(losses)


@torch.no_grad()
def generate_reference(model: K3Stage, prompt_ids: list[int], params: SamplingParams,
                       eos: int = EOS) -> tuple[list[int], str]:
    """The ground truth of serving: one request alone, the plain full-sequence forward for every token (no cache).
    Returns the generated ids (as sampled, end-of-text and stop bytes included) and the finish reason. Stop strings
    are met on the bytes (byte tokens); `eos`: the tokenizer's end-of-text id."""
    out: list[int] = []
    seed = params.resolved_seed()
    while True:
        logits = model(torch.tensor([prompt_ids + out], device=model.embed.weight.device))[0, -1]
        out.append(next_token(logits, params, seed, len(out)))
        reason = finish_reason(out, params, eos, model.cfg.max_seq_len - len(prompt_ids) - len(out))
        if reason is not None:
            model.reset_stats()
            return out, reason
