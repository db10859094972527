"""The reference trainer learns on the tiny config, and batches are addressed (replayable), not streamed."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3ray.config import load_config
from k3ray.data import TokenData
from k3ray.parallel.reference import ReferenceTrainer

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


def test_batches_are_replayable_and_distinct():
    cfg = load_config(TINY, {"parallel.ep": 1})
    data = TokenData(cfg.data, cfg.train.seed)
    first = data.batch(7, 0, 1)
    assert first.shape == (cfg.data.micro_batch_size, cfg.data.seq_len + 1) and first.dtype == torch.int64
    assert torch.equal(first, data.batch(7, 0, 1))
    assert torch.equal(first, TokenData(cfg.data, cfg.train.seed).batch(7, 0, 1))  # a fresh reader agrees
    for other in [(8, 0, 1), (7, 1, 1), (7, 0, 0)]:
        assert not torch.equal(first, data.batch(*other)), other
    assert torch.equal(data.val_batch(0), data.val_batch(0))
    assert not torch.equal(data.val_batch(0), data.val_batch(1))


def test_tiny_training_lowers_validation_loss_by_30_percent(one_thread):
    # 60 steps of 4 sequences: ~0.45x (100 steps of 8: ~0.42x, 200: ~0.37x)
    cfg = load_config(TINY, {"train.steps": 60, "parallel.ep": 1, "data.micro_batch_size": 4})
    trainer = ReferenceTrainer(cfg)
    before = trainer.evaluate()
    losses = [trainer.train_step(step, step).loss for step in range(cfg.train.steps)]
    after = trainer.evaluate()
    assert all(map(lambda x: x == x, losses))  # no NaN along the way
    assert after <= 0.7 * before, (before, after)
