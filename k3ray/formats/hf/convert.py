"""k3ray checkpoints <-> the released (Hugging Face) format, one tensor at a time.

`convert_from_hf` reads a release folder (k3ray.formats.hf.files) and writes a verified k3ray checkpoint
(k3ray.io.checkpoint: one part per worker of a pp x ep grid, as training writes them, no optimizer state) that
`k3ray train --resume` restores onto any EP size (pp as written) and `k3ray serve` onto any pp x ep. `export_hf`
writes a k3ray checkpoint back in the release's format; `export_weights_only` keeps k3ray's format and drops the
optimizer state. `hf_serving_state` gives serving the merged weights of a release folder directly. The names are
k3ray.formats.hf.keys'; the tensor shapes come from the model itself, built on the meta device.

Memory: convert holds one part at a time (dense layers of a stage, the experts of one EP rank of it) and the source
pages of one layer; export maps one part at a time from disk and holds one tensor more.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import yaml
from pydantic import ValidationError

from k3ray.config import ConfigError, JobConfig, ModelConfig, parse_config
from k3ray.io import checkpoint as ckpt
from k3ray.formats.hf import keys
from k3ray.formats.hf.files import DTYPES, HFFolder, HFFormatError, ShardWriter
from k3ray.model.decoder import build_stage, is_expert_param
from k3ray.policies.guards import GuardState
from k3ray.policies.moonep import default_home

WEIGHTS_DTYPE = torch.bfloat16  # the release's


@dataclass
class ModelLayout:
    """What a ModelConfig's model holds, without memory: dense groups (k3ray.formats.hf.keys.Group) in model order, the
    k3ray shape and dtype of every dense tensor, the layers that have routed experts, one expert's w1/w2 shapes."""
    cfg: ModelConfig
    groups: list[keys.Group]
    shapes: dict[str, tuple[torch.Size, torch.dtype]]
    moe_layers: list[int]
    expert_shapes: tuple[torch.Size, torch.Size]

    def stage_groups(self, layers: range) -> list[keys.Group]:
        def layer_of(name):
            if name.startswith("blocks."):
                return int(name.split(".")[1])
            return 0 if name == "embed.weight" else self.cfg.n_layers - 1
        return [g for g in self.groups if layer_of(g.k3ray[0]) in layers]

    def hf_shapes(self, group: keys.Group) -> list[torch.Size]:
        return [t.shape for t in group.to_hf([torch.empty(self.shapes[n][0], device="meta") for n in group.k3ray])]


def model_layout(cfg: ModelConfig) -> ModelLayout:
    with torch.device("meta"):
        stage = build_stage(cfg, range(cfg.n_layers), expert_ids=[0], init=False)
    tensors = {n: p for n, p in stage.named_parameters() if not is_expert_param(n)}
    for i, moe in stage.moe_layers().items():
        tensors[f"blocks.{i}.moe.router.bias"] = moe.router.bias
    # one expert's rows of ExpertShard's w1 [d_latent, 2I] (gate | up) and w2 [I, d_latent]
    return ModelLayout(cfg, keys.dense_groups(cfg, tensors), {n: (t.shape, t.dtype) for n, t in tensors.items()},
                       sorted(stage.expert_shards()),
                       (torch.Size([cfg.d_latent, 2 * cfg.expert_inner]), torch.Size([cfg.expert_inner, cfg.d_latent])))


def _is_bias(name: str) -> bool:
    return name.endswith("moe.router.bias")


# -- reading the release ----------------------------------------------------------------------------------------
def read_release(src: str | os.PathLike, dtype: str | None = None) -> tuple[HFFolder, ModelLayout]:
    """Open a release folder and check it whole before anything is converted: its config describes a model k3ray
    holds, and its tensors are exactly that model's (names, shapes, dtypes). Raises HFFormatError."""
    folder = HFFolder(src)
    try:
        fields = keys.config_from_hf(folder.config, dtype or _dtype_of(folder))
        cfg = ModelConfig.model_validate(fields)
    except (ValueError, ValidationError) as e:
        first = str(e).strip().splitlines()
        raise HFFormatError(f"{folder.path / 'config.json'}: {' '.join(first[:3]) if first else e}") from None
    layout = model_layout(cfg)
    expected: dict[str, torch.Size] = {}
    for g in layout.groups:
        expected.update(zip(g.hf, layout.hf_shapes(g)))
    w1, w2 = layout.expert_shapes
    one = [t.shape for t in keys.expert_to_hf(torch.empty(w1, device="meta"), torch.empty(w2, device="meta"))]
    for layer in layout.moe_layers:
        for e in range(cfg.n_experts):
            expected.update(zip(keys.expert_names(layer, e), one))
    text = {keys.from_layout(n): info for n, info in folder.tensors.items() if not keys.is_vision(n)}
    for name in sorted(text):
        info = text[name]
        where = f"{info.name} ({folder.path / info.file})"
        if name not in expected:
            raise HFFormatError(f"{where}: unknown tensor: the model config.json describes has no place for it")
        if info.dtype not in DTYPES:
            raise HFFormatError(f"{where}: dtype {info.dtype}: k3ray holds {'/'.join(DTYPES)} weights")
        if tuple(info.shape) != tuple(expected[name]):
            raise HFFormatError(f"{where}: shape {list(info.shape)}, config.json gives {list(expected[name])}")
    missing = [n for n in expected if n not in text]
    if missing:
        raise HFFormatError(f"{keys.to_layout(missing[0], keys.layout_of(folder.tensors))}: missing from "
                            f"{folder.path} ({len(missing)} tensors missing)")
    return folder, layout


def _dtype_of(folder: HFFolder) -> str:
    """The model dtype a release folder's weights ask for: that of its largest tensor kind, as k3ray names it."""
    counts: dict[str, int] = {}
    for info in folder.tensors.values():
        counts[info.dtype] = counts.get(info.dtype, 0) + 1
    top = max(counts, key=counts.get)
    return {"F64": "float64", "F32": "float32", "BF16": "bfloat16"}.get(top, "float32")


def _read(folder: HFFolder, layout_name: str, name: str) -> torch.Tensor:
    return folder.get(keys.to_layout(name, layout_name))


def _own(t: torch.Tensor) -> torch.Tensor:
    """t with storage of its own: torch.save writes a view's whole storage (a chunk of a fused tensor would carry
    the rest along)."""
    return t if t.untyped_storage().nbytes() == t.nbytes and t.is_contiguous() else t.clone()


def rank_state(folder: HFFolder, layout: ModelLayout, layers: range, expert_ids: list[int], dense: bool) -> dict:
    """One worker's checkpoint part (the layout `StageEngine.state_dict` writes) from a release folder: the stage's
    dense tensors (if `dense`) and router biases, its layers' experts `expert_ids`, no optimizer state."""
    cfg, spelled = layout.cfg, keys.layout_of(folder.tensors)
    dtype = getattr(torch, cfg.dtype)
    state = {"stage": None, "layers": list(layers), "dense": {}, "opt_dense": {}, "experts": {}, "router_bias": {},
             "opt_steps": 0, "lr_scale": 1.0}
    for g in layout.stage_groups(layers):
        if not dense and not all(_is_bias(n) for n in g.k3ray):
            continue
        for name, t in zip(g.k3ray, g.from_hf([_read(folder, spelled, h) for h in g.hf])):
            if _is_bias(name):
                state["router_bias"][int(name.split(".")[1])] = _own(t.to(torch.float32))
            else:
                state["dense"][name] = _own(t.to(dtype))
    w1_shape, w2_shape = layout.expert_shapes
    for layer in (i for i in layout.moe_layers if i in layers):
        w1 = torch.empty((len(expert_ids), *w1_shape), dtype=dtype)
        w2 = torch.empty((len(expert_ids), *w2_shape), dtype=dtype)
        for row, e in enumerate(expert_ids):
            keys.expert_into(w1[row], w2[row], *(_read(folder, spelled, n) for n in keys.expert_names(layer, e)))
        folder.release()  # the pages read for this layer stop counting: a part holds layers, the source need not
        state["experts"][layer] = {"expert_ids": list(expert_ids), "w1": w1, "w2": w2,
                                   "opt": {"w1": None, "w2": None}}
    return state


def job_config(model: ModelConfig, base: JobConfig | None, pp: int, ep: int, ckpt_dir: str, name: str) -> JobConfig:
    """The job config a converted checkpoint records: `base`'s sections (or defaults) with the release's model."""
    doc = base.model_dump(mode="json") if base is not None else {
        "name": name, "data": {"seq_len": min(model.max_seq_len, 2048), "micro_batch_size": 1}}
    doc["model"] = model.model_dump(mode="json")
    doc.setdefault("parallel", {}).update({"pp": pp, "ep": ep})
    doc.setdefault("checkpoint", {})["dir"] = str(ckpt_dir)
    try:
        return parse_config(doc, f"{ckpt_dir} (the converted job's config)")
    except ConfigError as e:
        raise HFFormatError(" ".join(line.strip() for line in str(e).strip().splitlines())) from None


def _fresh_dir(path: Path) -> None:
    if ckpt.list_committed(path) or (path.exists() and any(path.iterdir())):
        raise HFFormatError(f"{path}: not empty; convert and export into a new directory")


def convert_from_hf(src: str, dst: str, pp: int = 1, ep: int = 1, dtype: str | None = None,
                    base: JobConfig | None = None) -> dict:
    """Write the release folder `src` as a k3ray checkpoint (step 0) of a pp x ep grid under `dst`, and the job
    config it records as `dst`/config.yaml (`k3ray train --config dst/config.yaml --resume`)."""
    folder, layout = read_release(src, dtype)
    root = Path(dst)
    _fresh_dir(root)
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", Path(src).resolve().name)[:64].lstrip("_.-") or "converted"
    job = job_config(layout.cfg, base, pp, ep, dst, name)
    home = default_home(layout.cfg.n_experts, ep).tolist()  # what a fresh job of this grid places
    parts = []
    for p in range(pp):
        layers = layout.cfg.stage_layers(pp, p)
        for e in range(ep):
            state = rank_state(folder, layout, layers, [x for x in range(len(home)) if home[x] == e], dense=e == 0)
            state["stage"] = p
            parts.append(ckpt.write_part(root, 0, ckpt.part_name(p * ep + e), state))
            del state
            folder.release()
    meta = {"pp": pp, "ep": ep, "home": home, "last_batch": None, "skip": [], "lr_scale": 1.0,
            "guard_state": {k: v for k, v in vars(GuardState()).items() if k != "history"}, "job": job.name,
            "config": job.model_dump(mode="json"),
            "source": {"hf": str(Path(src).resolve()), "layout": keys.layout_of(folder.tensors),
                       "config_json": folder.config}}
    path = ckpt.commit(root, 0, parts, meta, keep=1)
    (root / "config.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    vision = sum(keys.is_vision(n) for n in folder.tensors)
    return {"checkpoint": str(path), "pp": pp, "ep": ep, "parts": len(parts), "tensors": len(folder.tensors) - vision,
            "vision_tensors_left_out": vision,
            "bytes": sum(p.bytes for p in parts), "config": str(root / "config.yaml")}


def hf_serving_state(src: str) -> tuple[dict, dict]:
    """(job config dump, merged weights as `serving_weights` gives them) of a release folder."""
    folder, layout = read_release(src)
    job = job_config(layout.cfg, None, 1, 1, "runs/checkpoints", "hf")
    state = rank_state(folder, layout, range(layout.cfg.n_layers), list(range(layout.cfg.n_experts)), dense=True)
    return job.model_dump(mode="json"), state


# -- writing the release ----------------------------------------------------------------------------------------
def _parts(root: str, manifest: ckpt.Manifest) -> Iterator[tuple[int, int, dict]]:
    """(stage, EP rank, part) one at a time, memory-mapped from disk."""
    meta = manifest.meta
    for p in range(meta["pp"]):
        for e in range(meta["ep"]):
            yield p, e, ckpt.load_part(root, manifest.step, ckpt.part_name(p * meta["ep"] + e), mmap=True)


def _planned(layout: ModelLayout, meta: dict, weights: torch.dtype) -> list[tuple[str, tuple, torch.dtype]]:
    """Every release tensor (text names) in the order export writes them: part by part."""
    out = []
    one = [t.shape for t in keys.expert_to_hf(*(torch.empty(s, device="meta") for s in layout.expert_shapes))]
    for p in range(meta["pp"]):
        layers = layout.cfg.stage_layers(meta["pp"], p)
        for e in range(meta["ep"]):
            if e == 0:
                for g in layout.stage_groups(layers):
                    for h, shape in zip(g.hf, layout.hf_shapes(g)):
                        out.append((h, tuple(shape), torch.float32 if h.endswith("e_score_correction_bias")
                                    else weights))
            mine = [x for x, r in enumerate(meta["home"]) if r == e]
            for layer in (i for i in layout.moe_layers if i in layers):
                for x in mine:
                    out += [(n, tuple(s), weights) for n, s in zip(keys.expert_names(layer, x), one)]
    return out


def _stored(root: str) -> tuple[ckpt.Manifest, ModelLayout]:
    manifest = ckpt.latest_verified(root)
    if manifest is None:
        raise HFFormatError(f"{root}: no verified k3ray checkpoint")
    return manifest, model_layout(JobConfig.model_validate(manifest.meta["config"]).model)


def export_hf(root: str, out: str, max_shard_bytes: int, layout_name: str | None = None,
              weights: torch.dtype = WEIGHTS_DTYPE) -> dict:
    """Write the newest verified checkpoint under `root` in the release's format to `out`: weights in `weights`
    (router biases in float32), config.json, the index, shards of at most `max_shard_bytes`. The spelling (text or
    release) and config.json's other fields are those of the folder it was converted from, if it was."""
    manifest, layout = _stored(root)
    meta, source = manifest.meta, manifest.meta.get("source", {})
    spelled = layout_name or source.get("layout", "text")
    _fresh_dir(Path(out))
    plan = _planned(layout, meta, weights)
    writer = ShardWriter(out, [(keys.to_layout(n, spelled), s, d) for n, s, d in plan], max_shard_bytes)
    try:
        for p, e, part in _parts(root, manifest):
            layers = layout.cfg.stage_layers(meta["pp"], p)
            if e == 0:
                for g in layout.stage_groups(layers):
                    ts = [part["router_bias"][int(n.split(".")[1])] if _is_bias(n) else part["dense"][n]
                          for n in g.k3ray]
                    for h, t in zip(g.hf, g.to_hf(ts)):
                        writer.write(keys.to_layout(h, spelled), t)
            for layer in (i for i in layout.moe_layers if i in layers):
                payload = part["experts"][layer]
                for row, x in enumerate(payload["expert_ids"]):
                    for n, t in zip(keys.expert_names(layer, x),
                                    keys.expert_to_hf(payload["w1"][row], payload["w2"][row])):
                        writer.write(keys.to_layout(n, spelled), t)
            del part
        base = source.get("config_json")
        text = keys.config_to_hf(layout.cfg, keys.text_config(base) if base else None)
        text["torch_dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32",
                               torch.float64: "float64", torch.float16: "float16"}[weights]
        if spelled == "release":
            config = {**(base or {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"]}),
                      "text_config": text}
        else:
            config = text
        files = writer.finish(config)
    except BaseException:
        writer.abort()
        raise
    return {"out": out, "step": manifest.step, "shards": len(files), "tensors": len(plan), "bytes": writer.total,
            "layout": spelled}


def export_weights_only(root: str, out: str, weights: torch.dtype = WEIGHTS_DTYPE) -> dict:
    """The newest verified checkpoint under `root` as a k3ray checkpoint of the same grid under `out`, weights in
    `weights` (router biases float32), no optimizer state: what `k3ray serve --checkpoint` needs."""
    manifest, layout = _stored(root)
    _fresh_dir(Path(out))
    meta = dict(manifest.meta)
    cfg = JobConfig.model_validate(meta["config"])
    name = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}[weights]
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": name})})
    meta["config"] = cfg.model_dump(mode="json")
    parts = []
    for p, e, part in _parts(root, manifest):
        state = {"stage": part["stage"], "layers": part["layers"],
                 # tensors already in `weights` are written straight from the mapped part, the others converted
                 "dense": {n: t.to(weights) for n, t in part["dense"].items()}, "opt_dense": {},
                 "experts": {i: {"expert_ids": list(x["expert_ids"]), "w1": x["w1"].to(weights),
                                 "w2": x["w2"].to(weights), "opt": {"w1": None, "w2": None}}
                             for i, x in part["experts"].items()},
                 "router_bias": {i: b.to(torch.float32) for i, b in part["router_bias"].items()},
                 "opt_steps": 0, "lr_scale": 1.0}
        parts.append(ckpt.write_part(out, manifest.step, ckpt.part_name(p * meta["ep"] + e), state))
        del part, state
    path = ckpt.commit(out, manifest.step, parts, meta, keep=1)
    return {"checkpoint": str(path), "step": manifest.step, "parts": len(parts), "bytes": sum(p.bytes for p in parts)}
