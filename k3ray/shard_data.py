"""Training batches from prepared token shards (`k3ray data prepare`; format in k3ray.io.shards), memory-mapped.

Samples: documents (each ending with end-of-text) are packed end to end; training sample j is the L + 1 tokens from
j * L of the training region (L = seq_len; inputs and shifted targets, neighbours overlap by one token, as
Megatron's). Validation is split by documents: the last `val_fraction` of the documents, never trained on.

Order: the global sample number of row k of micro-batch `micro` of DP rank `dp_rank` in batch b is

    n = b * G + (dp_rank * M + micro) * B + k        (G = R * M * B: R DP ranks, M micro-batches, B rows)

and it reads training sample perm_epoch(n mod N), epoch = n // N, where perm is a seeded bijection of [0, N) (a
Feistel network with cycle walking: O(1) memory, any index in O(1)). So batch(b, dp_rank, micro) is a pure
function: a replay after a rollback, a lost worker's micro-batches run by a survivor, or a resumed job all read the
same tokens. The first b * G samples are what b batches consumed.
"""
from __future__ import annotations

import numpy as np
import torch

from k3ray.config import ConfigError, DataConfig
from k3ray.io.shards import ShardSet

M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 arrays (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(index: np.ndarray, n: int, key: np.ndarray, rounds: int = 4) -> np.ndarray:
    """A bijection of [0, n) per key: index int64 [S] in [0, n), key uint64 [S] (or scalar) -> int64 [S]."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    keys = [_mix(np.asarray(key, dtype=np.uint64) + np.uint64(r)) for r in range(rounds)]
    x = np.asarray(index, dtype=np.uint64).copy()
    todo = np.ones(len(x), dtype=bool)
    while todo.any():  # cycle walking: a value outside [0, n) goes round again; the domain is < 4n, so few rounds
        left, right = x[todo] >> shift, x[todo] & mask
        for k in keys:
            kk = k[todo] if k.ndim else k
            left, right = right, left ^ (_mix(right ^ kk) & mask)
        x[todo] = (left << shift) | right
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


class ShardData:
    """Same interface as k3ray.data.TokenData: batch(b, dp_rank, micro), val_batch(i) -> int64 [B, L + 1]."""

    def __init__(self, cfg: DataConfig, seed: int, dp_ranks: int, micro_batches: int):
        self.cfg, self.seed = cfg, seed
        self.shards = ShardSet.open(cfg.source)
        self.eos_id = int(self.shards.manifest["tokenizer"]["eos_id"])
        L, ends = cfg.seq_len, self.shards.doc_ends
        n_val_docs = max(1, round(len(ends) * cfg.val_fraction))
        if len(ends) <= n_val_docs:
            raise ConfigError(f"data.source={cfg.source}: {len(ends)} documents, too few for a validation split")
        self.val_start = int(ends[-n_val_docs - 1])  # the first token of the first validation document
        self.n_train = (self.val_start - 1) // L
        self.n_val = (self.shards.n_tokens - self.val_start - 1) // L
        if self.n_train < 1 or self.n_val < 1:
            raise ConfigError(f"data.source={cfg.source}: {self.val_start} training and "
                              f"{self.shards.n_tokens - self.val_start} validation tokens; each needs more than "
                              f"seq_len={L}")
        self.rows, self.micro_batches = cfg.micro_batch_size, micro_batches
        self.samples_per_batch = dp_ranks * micro_batches * cfg.micro_batch_size

    def sample_numbers(self, batch_index: int, dp_rank: int, micro: int) -> np.ndarray:
        first = batch_index * self.samples_per_batch + (dp_rank * self.micro_batches + micro) * self.rows
        return first + np.arange(self.rows, dtype=np.int64)

    def train_samples(self, numbers: np.ndarray) -> np.ndarray:
        """Which training samples global sample numbers read (int64 [S] -> int64 [S])."""
        epoch = numbers // self.n_train
        key = (np.uint64(self.seed) << np.uint64(32)) ^ epoch.astype(np.uint64) * np.uint64(0x100000001B3)
        return permute(numbers % self.n_train, self.n_train, key)

    def _rows(self, starts: np.ndarray) -> torch.Tensor:
        L = self.cfg.seq_len
        return torch.from_numpy(np.stack([self.shards.read(int(s), L + 1) for s in starts]))

    def batch(self, batch_index: int, dp_rank: int, micro: int) -> torch.Tensor:
        """[micro_batch_size, seq_len + 1] int64 token ids."""
        samples = self.train_samples(self.sample_numbers(batch_index, dp_rank, micro))
        return self._rows(samples * self.cfg.seq_len)

    def val_batch(self, i: int) -> torch.Tensor:
        """Validation rows in order: batch i holds samples i * B ... (i + 1) * B - 1 (mod their number)."""
        samples = (i * self.rows + np.arange(self.rows)) % self.n_val
        return self._rows(self.val_start + samples * self.cfg.seq_len)
