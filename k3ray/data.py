"""Token data. Byte-level: the default corpus: the Python standard library's own .py sources, present on every machine,
read in a fixed (sorted) order; or every file under a directory. The last `val_fraction` of the bytes is the
held-out validation split. Prepared shards (`k3ray data prepare`, a folder with a manifest): k3ray.shard_data.

Batches are addressed, never streamed: batch(batch_index, dp_rank, micro) is a pure function of the corpus, the
seed and those three numbers, so any step can be replayed exactly and a skipped batch is just an index not used.
"""
from __future__ import annotations

import os
import sysconfig
import zlib
from functools import lru_cache
from pathlib import Path

import torch

from k3ray.config import ConfigError, DataConfig, JobConfig
from k3ray.io import shards
from k3ray.io.shards import MANIFEST
from k3ray.shard_data import ShardData
from k3ray.tokenizer import BYTE_EOS, ByteTokenizer, load_tokenizer


def corpus_files(source: str) -> list[Path]:
    """The corpus's files in their fixed order (sorted as paths). Listed with os.walk: Path.rglob took 0.5 s for the
    stdlib, os.walk 0.01 s, and every worker lists the corpus when it starts."""
    if source == "stdlib":
        return sorted(_walk(Path(sysconfig.get_paths()["stdlib"]), suffix=".py", skip_folder="site-packages"))
    root = Path(source)
    if not root.is_dir():
        raise ConfigError(f"data.source={source!r} is neither 'stdlib' nor a directory")
    return sorted(p for p in _walk(root) if p.is_file())


def _walk(root: Path, suffix: str = "", skip_folder: str | None = None):
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [f for f in subfolders if f != skip_folder]
        yield from (Path(folder, name) for name in names if name.endswith(suffix))


@lru_cache(maxsize=4)
def load_corpus(source: str, max_bytes: int) -> torch.Tensor:
    """All bytes of the corpus (uint8 [N]), files separated by a NUL byte, capped at max_bytes."""
    chunks, size = [], 0
    for path in corpus_files(source):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data + b"\0")
        size += len(data) + 1
        if size >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if len(blob) < 1024:
        raise ConfigError(f"data.source={source!r}: corpus too small ({len(blob)} bytes)")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class TokenData:
    """Train/validation token windows of seq_len + 1 bytes (inputs and shifted targets). Files are separated by the
    end-of-text byte (`eos_id`)."""

    def __init__(self, cfg: DataConfig, seed: int):
        self.cfg, self.seed = cfg, seed
        self.eos_id = EOS
        tokens = load_corpus(cfg.source, cfg.max_bytes)
        split = int(len(tokens) * (1 - cfg.val_fraction))
        self.train, self.val = tokens[:split], tokens[split:]
        if len(self.val) <= cfg.seq_len + 1:
            raise ConfigError(f"data: validation split ({len(self.val)} bytes) shorter than seq_len+1")

    def _windows(self, tokens: torch.Tensor, key: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()) + (self.seed << 32))
        n = self.cfg.micro_batch_size
        starts = torch.randint(0, len(tokens) - self.cfg.seq_len - 1, (n,), generator=g)
        idx = starts[:, None] + torch.arange(self.cfg.seq_len + 1)
        return tokens[idx].long()

    def batch(self, batch_index: int, dp_rank: int, micro: int) -> torch.Tensor:
        """[micro_batch_size, seq_len + 1] int64 token ids."""
        return self._windows(self.train, f"train/{batch_index}/{dp_rank}/{micro}")

    def val_batch(self, i: int) -> torch.Tensor:
        return self._windows(self.val, f"val/{i}")


def is_prepared(source: str) -> bool:
    """A folder written by `k3ray data prepare` (it has a manifest)."""
    return source != "stdlib" and (Path(source) / MANIFEST).is_file()


def open_token_data(cfg: JobConfig):
    """The job's batches: TokenData over bytes, or ShardData over prepared shards (same interface)."""
    if is_prepared(cfg.data.source):
        return ShardData(cfg.data, cfg.train.seed, cfg.parallel.ep, cfg.parallel.micro_batches)
    return TokenData(cfg.data, cfg.train.seed)


def warm(cfg: DataConfig) -> None:
    """What a worker reads once when it starts: the byte corpus (cached), or the shard manifest."""
    if is_prepared(cfg.source):
        shards.read_manifest(cfg.source)
    else:
        load_corpus(cfg.source, cfg.max_bytes)


def check_data(cfg: JobConfig) -> None:
    """Before any worker starts: the tokenizer loads and fits model.vocab_size; a shard folder is complete (sizes
    against its manifest), was made with this tokenizer and has enough tokens. ConfigError naming the file."""
    tok = load_tokenizer(cfg.data.tokenizer)
    where = "data.tokenizer" if cfg.data.tokenizer == "bytes" else cfg.data.tokenizer
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"{where}: vocabulary of {tok.vocab_size} tokens is larger than model.vocab_size="
                          f"{cfg.model.vocab_size}")
    if not is_prepared(cfg.data.source):
        if tok.fingerprint != "bytes":
            raise ConfigError(f"data.source={cfg.data.source!r}: byte corpora train with data.tokenizer=bytes; "
                              f"prepare the text with `k3ray data prepare --tokenizer {cfg.data.tokenizer}`")
        return
    manifest = shards.verify(cfg.data.source)
    made_with = manifest["tokenizer"]
    if made_with.get("fingerprint") != tok.fingerprint:
        raise ConfigError(f"{Path(cfg.data.source) / MANIFEST}: prepared with tokenizer {made_with.get('name')!r}, "
                          f"not data.tokenizer={cfg.data.tokenizer!r}")
    if made_with["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(f"{Path(cfg.data.source) / MANIFEST}: vocabulary of {made_with['vocab_size']} tokens is "
                          f"larger than model.vocab_size={cfg.model.vocab_size}")
    open_token_data(cfg)


# -- the byte tokenizer (k3ray.tokenizer has the others) -------------------------------------------------------------
EOS = BYTE_EOS
"""The NUL byte that separates files in the corpus ends a generation (finish_reason "stop")."""
_BYTES = ByteTokenizer()
encode, decode = _BYTES.encode, _BYTES.decode


def chat_prompt(messages: list[tuple[str, str]]) -> str:
    """The byte chat template (k3ray.tokenizer.Tokenizer.chat_prompt): "### role\\ncontent\\n" per message, then
    "### assistant\\n"; "\\n### " (pass it in `stop`) ends the reply where the next turn would begin."""
    return _BYTES.chat_prompt([{"role": role, "content": content} for role, content in messages])
