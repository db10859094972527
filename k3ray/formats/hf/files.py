"""Hugging Face checkpoint folders: config.json, safetensors shards and their index, read and written one tensor at
a time (never a whole checkpoint, nor a whole shard, in memory).

Reading uses the `safetensors` library (`safe_open`: the headers first, to check every name, shape and dtype before
anything is converted, then single tensors). Writing streams: a shard's header is known from the plan (names,
shapes, dtypes), so it is written first and each tensor's bytes follow as they are produced; files land through
`.tmp` + rename, the index and config.json last. Shards are named as the release names them,
`model-00001-of-000NN.safetensors`, each at most `max_shard_bytes` (or one tensor larger than that).
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from k3ray.formats.release_folder import CONFIG, INDEX, SINGLE, is_hf_folder
from k3ray.io.json_object import read_json_object

__all__ = ["HFFormatError", "TensorInfo", "HFFolder", "ShardWriter", "is_hf_folder", "DTYPES", "INDEX", "CONFIG"]

DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}
DEFAULT_SHARD_BYTES = 5 * 10**9  # the release's shards are ~5 GB


class HFFormatError(ValueError):
    """A Hugging Face folder k3ray cannot read: one line naming the tensor (if any) and the file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # shard file name inside the folder
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: BF16, F32, ...


class HFFolder:
    """A checkpoint folder in the release's format. `config` is config.json; `tensors` maps every tensor name to its
    TensorInfo (from the index and the shards' headers, which must agree)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.config = self._json(CONFIG)
        if (self.path / INDEX).is_file():
            weight_map = self._json(INDEX).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise HFFormatError(f"{self.path / INDEX}: no weight_map")
        elif (self.path / SINGLE).is_file():
            weight_map = None
        else:
            raise HFFormatError(f"{self.path}: neither {INDEX} nor {SINGLE}")
        self._open: dict[str, object] = {}
        self.tensors: dict[str, TensorInfo] = {}
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        listed = {}
        for name, file in (weight_map or {}).items():
            listed.setdefault(file, []).append(name)
        for file in files:
            if not (self.path / file).is_file():
                raise HFFormatError(f"{sorted(listed[file])[0]}: shard {self.path / file} is missing (listed in "
                                    f"{INDEX})")
            handle = self._handle(file)
            for name in handle.keys():
                s = handle.get_slice(name)
                self.tensors[name] = TensorInfo(name, file, tuple(s.get_shape()), s.get_dtype())
        for name, file in (weight_map or {}).items():
            info = self.tensors.get(name)
            if info is None or info.file != file:
                raise HFFormatError(f"{name}: {INDEX} places it in {self.path / file}, which does not hold it")

    def _json(self, name: str) -> dict:
        return read_json_object(self.path / name, HFFormatError)

    def _handle(self, file: str):
        if file not in self._open:
            try:
                self._open[file] = safe_open(str(self.path / file), framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for damaged files
                raise HFFormatError(f"{self.path / file}: not a safetensors file ({e})") from None
        return self._open[file]

    def release(self) -> None:
        """Unmap the shards (reading again reopens them): the pages read so far stop counting in this process."""
        self._open = {}

    def where(self, name: str) -> str:
        return str(self.path / self.tensors[name].file)

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read from its shard (a copy in memory; the shard is not read otherwise)."""
        info = self.tensors[name]
        if info.dtype not in DTYPES:
            raise HFFormatError(f"{name} ({self.where(name)}): dtype {info.dtype}: k3ray holds {'/'.join(DTYPES)}")
        return self._handle(info.file).get_tensor(name)


def _header(entries: list[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[bytes, list[int]]:
    """The safetensors header of a shard holding `entries` in order, and each entry's byte size."""
    doc, offset, sizes = {"__metadata__": {"format": "pt"}}, 0, []
    for name, shape, dtype in entries:
        n = dtype.itemsize
        for d in shape:
            n *= d
        doc[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
        sizes.append(n)
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, sizes


class ShardWriter:
    """Writes a folder's shards from a plan: `entries` [(name, shape, dtype)] in the order `write` will be called.

    `write(name, tensor)` for each entry in order, then `finish(config)` writes the index and config.json."""

    def __init__(self, out: str | os.PathLike, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        shards, size = [[]], 0
        for e in entries:
            n = e[2].itemsize * int(torch.Size(e[1]).numel())
            if shards[-1] and size + n > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(e)
            size += n
        self.shards = shards
        self.files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        self.queue = [(i, e) for i, shard in enumerate(shards) for e in shard]
        self.pos, self.f, self.total = 0, None, 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shard, (want, shape, dtype) = self.queue[self.pos]
        if name != want or tuple(tensor.shape) != tuple(shape):
            raise HFFormatError(f"{name}: written out of plan (expected {want} {list(shape)}, got "
                                f"{list(tensor.shape)})")
        if self.f is None or self.f[0] != shard:
            self._close_file()
            tmp = self.out / (self.files[shard] + ".tmp")
            fh = open(tmp, "wb")
            header, _ = _header(self.shards[shard])
            fh.write(header)
            self.f = (shard, fh, tmp)
        data = tensor.detach().to(dtype).contiguous().view(torch.uint8).reshape(-1)
        self.f[1].write(memoryview(data.numpy()))
        self.total += data.numel()
        self.pos += 1

    def _close_file(self) -> None:
        if self.f is not None:
            shard, fh, tmp = self.f
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
            os.replace(tmp, self.out / self.files[shard])
            self.f = None

    def finish(self, config: dict) -> list[str]:
        """Close the last shard; write the index and config.json. Returns the shard file names."""
        if self.pos != len(self.queue):
            raise HFFormatError(f"{self.out}: {len(self.queue) - self.pos} planned tensors were not written, the "
                                f"first {self.queue[self.pos][1][0]}")
        self._close_file()
        index = {"metadata": {"total_size": self.total},
                 "weight_map": {e[0]: self.files[i] for i, e in self.queue}}
        for name, doc in ((INDEX, index), (CONFIG, config)):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(json.dumps(doc, indent=2) + "\n")
            os.replace(tmp, self.out / name)
        return self.files

    def abort(self) -> None:
        if self.f is not None:
            self.f[1].close()
            self.f[2].unlink(missing_ok=True)
            self.f = None
