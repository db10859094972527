"""The batches one EP rank of a stage runs, addressed by batch index (any step can be replayed exactly).

The data-parallel width stays cfg.parallel.ep whatever the live EP size: EP rank e runs the micro-batches of every
DP rank d with d % ep_size == e (`dp_ranks`), so a shrunk job trains on the same global batch as the full one."""
from __future__ import annotations

import torch

from k3ray.config import JobConfig
from k3ray.data import open_token_data
from k3ray.model.layers import Documents
from k3ray.policies import recovery


class StageBatches:
    def __init__(self, cfg: JobConfig, ep_rank: int, ep_size: int, device: torch.device):
        self.cfg, self.ep_rank, self.ep_size, self.device = cfg, ep_rank, ep_size, device
        self.data = open_token_data(cfg)

    @property
    def dp_ranks(self) -> list[int]:
        """The data-parallel ranks whose micro-batches this EP rank runs: its own at full size; while shrunk, also
        those of lost ranks. Their micro-batch m is run as one micro-batch (rows concatenated), so every EP rank of
        a stage still runs M micro-batches and issues the same MoE collectives."""
        return recovery.dp_ranks_of(self.ep_rank, self.ep_size, self.cfg.parallel.ep)

    def micro_batch(self, batch_index: int, micro: int) -> torch.Tensor:
        """The rows [B * len(dp_ranks), L + 1] of micro-batch `micro` of batch `batch_index`, on the device."""
        parts = [self.data.batch(batch_index, d, micro) for d in self.dp_ranks]
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.device.type != "cuda":
            return rows.to(self.device)
        # from pinned memory, queued behind the work already launched: a copy from pageable memory would make the host
        # wait for the device to drain first (torch's pinned-memory pool keeps the buffer until the copy is done)
        return rows.pin_memory().to(self.device, non_blocking=True)

    def validation(self, index: int) -> torch.Tensor:
        """Validation batch `index` [B, L + 1], on the device."""
        return self.data.val_batch(index).to(self.device)

    def documents(self, tokens: torch.Tensor) -> Documents | None:
        """With data.document_masking, where the documents of the rows [B, L + 1] begin (every stage derives it from
        the batch's tokens, which every stage can address)."""
        return Documents(tokens[:, :-1], self.data.eos_id) if self.cfg.data.document_masking else None
