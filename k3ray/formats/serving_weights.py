"""The weights serving loads, read from a durable k3ray checkpoint (merged out of the grid it was written on) or
from a released (Hugging Face) folder: `serving_weights(root)`. Weights only, no optimizer state; the grid that
serves them may be any pp x ep."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from k3ray.formats.hf import hf_serving_state, is_hf_folder
from k3ray.io import checkpoint as ckpt


@dataclass
class ServingWeights:
    """The weights of a durable checkpoint merged out of its grid, for serving on any pp x ep: every stage's dense
    parameters and router biases by name, every layer's experts in one payload (no optimizer state). Workers keep
    the names of their stage and the experts homed on them (`shards.load_weights`)."""
    path: str
    step: int
    config: dict  # the training job's config
    state: dict


def serving_weights(root: str) -> ServingWeights:
    """From a durable checkpoint's root, or from a released (Hugging Face) folder (config.json + safetensors). A
    checkpoint's newest step is read while its sha256 is checked beside (parts memory-mapped: one pass over the files,
    the hashing's, and the copies the caller makes); a newest step that fails verification falls back to the newest
    that passes (`ckpt.latest_verified`, which says why)."""
    if is_hf_folder(root):
        config, state = hf_serving_state(root)
        return ServingWeights(str(root), 0, config, state)
    committed = ckpt.list_committed(root)
    if committed:
        with ThreadPoolExecutor(1) as pool:
            verified = pool.submit(ckpt.verify, root, committed[-1])
            try:
                weights = _merged_weights(root, ckpt.read_manifest(root, committed[-1]), mmap=True)
                verified.result()
                return weights
            except ckpt.CheckpointError:
                pass  # the fallback below says what is wrong with it
    manifest = ckpt.latest_verified(root)
    if manifest is None:
        raise ckpt.CheckpointError(f"{root}: no verified checkpoint (train with checkpoint.every_n_steps, or "
                                   f"`k3ray checkpoint` on a running job)")
    return _merged_weights(root, manifest, mmap=False)


def _merged_weights(root: str, manifest: ckpt.Manifest, mmap: bool) -> ServingWeights:
    """Every part of `manifest`'s step merged out of its grid: experts sorted by id (a part that holds them in order
    alone is taken as it is, no copy)."""
    meta = manifest.meta
    state = {"dense": {}, "opt_dense": {}, "router_bias": {}, "experts": {}, "opt_steps": 0, "lr_scale": 1.0}
    for r in range(meta["pp"] * meta["ep"]):
        part = ckpt.load_part(root, manifest.step, ckpt.part_name(r), mmap=mmap)
        state["dense"].update(part["dense"])
        state["router_bias"].update(part["router_bias"])
        for layer, payload in part["experts"].items():
            state["experts"].setdefault(layer, []).append(payload)
    for layer, payloads in state["experts"].items():
        ids = [e for p in payloads for e in p["expert_ids"]]
        order = sorted(range(len(ids)), key=ids.__getitem__)
        in_order = len(payloads) == 1 and order == list(range(len(ids)))
        state["experts"][layer] = {"expert_ids": sorted(ids), "opt": {"w1": None, "w2": None},
                                   **{w: payloads[0][w] if in_order else torch.cat([p[w] for p in payloads])[order]
                                      for w in ("w1", "w2")}}
    return ServingWeights(str(manifest.path), manifest.step, meta["config"], state)
