"""What makes a folder a released (Hugging Face) checkpoint: its file names and `is_hf_folder`. Apart from
k3ray.formats.hf, which imports torch and the model code, so that `k3ray serve` tells a release from a k3ray
checkpoint before Ray starts without importing either."""
from __future__ import annotations

import os
from pathlib import Path

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"


def is_hf_folder(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / CONFIG).is_file() and ((p / INDEX).is_file() or (p / SINGLE).is_file())
