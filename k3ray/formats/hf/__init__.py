"""The released (Hugging Face) format as one adapter: what the rest of k3ray imports of it (the CLI's convert,
export and serve, serving's weights). The parts behind it:

    keys     k3ray's tensor names <-> the release's, config.json <-> ModelConfig
    files    a release folder read (`HFFolder`) and written (`ShardWriter`) one tensor at a time
    convert  a release folder -> a k3ray checkpoint and back, or straight into serving's merged weights

Names: `to_layout`/`from_layout` (a text-model name <-> the "text" or "release" spelling), `config_to_hf`,
`config_from_hf`. Folders: `is_hf_folder`, `read_release` (open and check whole), `HFFolder`, `ShardWriter`.
Checkpoints: `convert_from_hf`, `export_hf`, `export_weights_only`, `hf_serving_state`. Bad input raises one of
`FORMAT_ERRORS`, each a one-line message naming the tensor or file.
"""
from __future__ import annotations

from k3ray.formats.hf.convert import convert_from_hf, export_hf, export_weights_only, hf_serving_state, read_release
from k3ray.formats.hf.files import HFFolder, HFFormatError, ShardWriter, is_hf_folder
from k3ray.formats.hf.keys import UnmappedName, config_from_hf, config_to_hf, from_layout, to_layout

FORMAT_ERRORS = (HFFormatError, UnmappedName)  # a folder or tensor k3ray cannot take: one line for the user

__all__ = ["FORMAT_ERRORS", "HFFolder", "HFFormatError", "ShardWriter", "UnmappedName", "config_from_hf",
           "config_to_hf", "convert_from_hf", "export_hf", "export_weights_only", "from_layout", "hf_serving_state",
           "is_hf_folder", "read_release", "to_layout"]
