"""The released K3 checkpoint layout (Hugging Face): tensor names, config.json, and how k3ray's tensors map onto them.

Source: the Hugging Face implementation of Kimi Linear / Kimi K3 (`modeling_kimi`, and vLLM's `KimiLinearConfig`
schema for config.json), as transcribed by torchtitan's Kimi-K3 port (open pull requests:
`torchtitan/models/kimi_k3/hf_key_map.py` and `state_dict_adapter.py`). Names in the release:

    model.embed_tokens.weight, model.norm.weight, lm_head.weight
    model.layers.N.input_layernorm.weight / post_attention_layernorm.weight
    model.layers.N.self_attn.*        MLA: q_proj | q_a_proj, q_a_layernorm, q_b_proj; kv_a_proj_with_mqa,
                                      kv_a_layernorm, kv_b_proj, g_proj, o_proj
                                      KDA: q_proj, k_proj, v_proj, q_conv1d, k_conv1d, v_conv1d, f_a_proj, f_b_proj,
                                      dt_bias, A_log, b_proj, g_proj, o_norm, o_proj
    model.layers.N.mlp.{gate,up,down}_proj.weight                      the dense layers (first_k_dense_replace)
    model.layers.N.block_sparse_moe.gate.weight / gate.e_score_correction_bias
    model.layers.N.block_sparse_moe.routed_expert_{down_proj,norm,up_proj}.weight     Stable LatentMoE
    model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight        gate, up, down of routed expert E
    model.layers.N.block_sparse_moe.shared_experts.{gate,up,down}_proj.weight   all shared experts as one FFN

The release itself wraps the text model for its vision tower: `language_model.model.…` and
`language_model.lm_head.weight`, with config.json's text fields nested under `text_config`. Both spellings are read;
`layout` names which one a checkpoint used ("text" or "release") so that export writes the same one back.

Every mapping here is a `Group`: some k3ray tensors <-> some HF tensors, with the two pure functions between them
(weights are copied or sliced, never changed in value). Routed experts map per expert (`expert_to_hf`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from k3ray.config import ModelConfig

__all__ = ["Group", "UnmappedName", "RELEASE_PREFIX", "dense_groups", "expert_names", "expert_to_hf",
           "expert_from_hf", "to_layout", "from_layout", "config_to_hf", "config_from_hf", "layout_of"]

RELEASE_PREFIX = "language_model."  # the release's multimodal wrapper around the text model
EXPERT_KEY = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")


class UnmappedName(ValueError):
    """A tensor name with no counterpart on the other side (never skipped silently)."""


@dataclass(frozen=True)
class Group:
    """k3ray tensors <-> HF tensors (text-layout names), and the functions between them, in list order."""
    k3ray: tuple[str, ...]
    hf: tuple[str, ...]
    to_hf: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    from_hf: Callable[[list[torch.Tensor]], list[torch.Tensor]]


def _same(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(ts)


def _one(k3: str, hf: str) -> Group:
    return Group((k3,), (hf,), _same, _same)


def _kv_b(heads: int, nope: int, v_dim: int) -> tuple[Callable, Callable]:
    """kv_b_proj [H*(nope+v), r] holds each head's key rows, then its value rows; k3ray keeps keys (w_uk [H*nope, r])
    and values (w_uv [H*v, r]) apart."""
    def to_hf(ts):
        uk, uv = ts
        r = uk.shape[-1]
        return [torch.cat([uk.reshape(heads, nope, r), uv.reshape(heads, v_dim, r)], dim=1).reshape(-1, r)]

    def from_hf(ts):
        (kv,) = ts
        r = kv.shape[-1]
        per_head = kv.reshape(heads, nope + v_dim, r)
        return [per_head[:, :nope].reshape(-1, r), per_head[:, nope:].reshape(-1, r)]
    return to_hf, from_hf


def _shared(n_shared: int) -> tuple[Callable, Callable]:
    """k3ray's shared experts s = 0..n-1 (w_in [2I_s, d] = gate rows then up rows, w_out [d, I_s]) are the release's
    one shared FFN with the inner units side by side: a GLU's inner units are independent, so the sum of n FFNs is
    one FFN of width n*I_s."""
    def to_hf(ts):
        w_in, w_out = ts[:n_shared], ts[n_shared:]
        gates, ups = zip(*(w.chunk(2, dim=0) for w in w_in))
        return [torch.cat(gates), torch.cat(ups), torch.cat(w_out, dim=1)]

    def from_hf(ts):
        gate, up, down = ts
        g, u, d = gate.chunk(n_shared), up.chunk(n_shared), down.chunk(n_shared, dim=1)
        return [torch.cat([g[s], u[s]]) for s in range(n_shared)] + [d[s] for s in range(n_shared)]
    return to_hf, from_hf


# k3ray name inside a block -> release name inside `model.layers.N.`, per kind of layer.
_MLA = {"attn.w_q.weight": "self_attn.q_proj.weight",
        "attn.w_dkv.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn.w_g.weight": "self_attn.g_proj.weight",
        "attn.w_o.weight": "self_attn.o_proj.weight"}
_KDA = {"attn.w_q.weight": "self_attn.q_proj.weight",
        "attn.w_k.weight": "self_attn.k_proj.weight",
        "attn.w_v.weight": "self_attn.v_proj.weight",
        "attn.w_a_down.weight": "self_attn.f_a_proj.weight",
        "attn.w_a_up.weight": "self_attn.f_b_proj.weight",
        "attn.w_a_up.bias": "self_attn.dt_bias",
        "attn.w_b.weight": "self_attn.b_proj.weight",
        "attn.o_norm.weight": "self_attn.o_norm.weight",
        "attn.w_g.weight": "self_attn.g_proj.weight",
        "attn.w_o.weight": "self_attn.o_proj.weight"}
_BLOCK = {"attn_norm.weight": "input_layernorm.weight",
          "moe_norm.weight": "post_attention_layernorm.weight",
          "moe.w_down.weight": "block_sparse_moe.routed_expert_down_proj.weight",
          "moe.norm.weight": "block_sparse_moe.routed_expert_norm.weight",
          "moe.w_up.weight": "block_sparse_moe.routed_expert_up_proj.weight",
          "moe.router.weight": "block_sparse_moe.gate.weight",
          "moe.router.bias": "block_sparse_moe.gate.e_score_correction_bias"}
_TOP = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight"}


def dense_groups(cfg: ModelConfig, names: Iterable[str]) -> list[Group]:
    """The groups covering k3ray's non-expert tensors `names` (parameters and router biases, as the model names
    them: `blocks.N.…`, `embed.weight`, ...), in the order of `names`' first members. Raises UnmappedName for a
    name no group takes."""
    names = list(names)
    present = set(names)
    groups: dict[str, Group] = {}  # first k3ray name -> its group
    for name in names:
        if name in _TOP:
            groups[name] = _one(name, _TOP[name])
            continue
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
        if m is None:
            raise UnmappedName(f"{name}: no released name for it")
        layer, tail = int(m.group(1)), m.group(2)
        hf = f"model.layers.{layer}."
        own = {**_BLOCK, **(_MLA if cfg.layer_kind(layer) == "mla" else _KDA)}
        if tail in own:
            groups[name] = _one(name, hf + own[tail])
        elif tail == "attn.w_uk.weight" and cfg.layer_kind(layer) == "mla":
            pair = (name, f"blocks.{layer}.attn.w_uv.weight")
            groups[name] = Group(pair, (hf + "self_attn.kv_b_proj.weight",),
                                 *_kv_b(cfg.n_heads, cfg.head_dim, cfg.head_dim))
        elif tail == "moe.shared.0.w_in.weight":
            ins = tuple(f"blocks.{layer}.moe.shared.{s}.w_in.weight" for s in range(cfg.n_shared))
            outs = tuple(f"blocks.{layer}.moe.shared.{s}.w_out.weight" for s in range(cfg.n_shared))
            groups[name] = Group(ins + outs, tuple(hf + f"block_sparse_moe.shared_experts.{w}_proj.weight"
                                                   for w in ("gate", "up", "down")), *_shared(cfg.n_shared))
        elif not (tail == "attn.w_uv.weight" or re.fullmatch(r"moe\.shared\.\d+\.w_(in|out)\.weight", tail)):
            raise UnmappedName(f"{name}: no released name for it")
    covered = {n for g in groups.values() for n in g.k3ray}
    if covered != present:
        raise UnmappedName(f"{sorted(covered ^ present)[0]}: its group is incomplete")
    return list(groups.values())


def expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    """The release's gate, up and down weights of one routed expert (text layout)."""
    base = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
    return f"{base}.w1.weight", f"{base}.w3.weight", f"{base}.w2.weight"


def expert_to_hf(w1: torch.Tensor, w2: torch.Tensor) -> list[torch.Tensor]:
    """One expert's k3ray rows (w1 [d_latent, 2I] = gate | up, w2 [I, d_latent], input-major) -> the release's
    gate [I, d_latent], up [I, d_latent], down [d_latent, I] (nn.Linear's output-major), contiguous."""
    gate, up = w1.chunk(2, dim=1)
    return [gate.t().contiguous(), up.t().contiguous(), w2.t().contiguous()]


def expert_from_hf(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of expert_to_hf: (w1 [d_latent, 2I], w2 [I, d_latent])."""
    return torch.cat([gate.t(), up.t()], dim=1), down.t()


# -- the two spellings ------------------------------------------------------------------------------------------
def layout_of(names: Iterable[str]) -> str:
    """'release' when the names carry the multimodal wrapper (`language_model.`), else 'text'."""
    return "release" if any(n.startswith(RELEASE_PREFIX) for n in names) else "text"


def to_layout(name: str, layout: str) -> str:
    return RELEASE_PREFIX + name if layout == "release" else name


def from_layout(name: str) -> str:
    return name.removeprefix(RELEASE_PREFIX)


# -- config.json ------------------------------------------------------------------------------------------------
# Fields that exist only in k3ray travel in config.json under this key (loaders ignore unknown keys), so that a
# checkpoint exported and converted back has the same ModelConfig.
K3RAY_FIELDS = "k3ray"
_K3RAY_ONLY = ("balancing", "sign_update_rate", "quantile_bins", "quantile_window", "dtype", "rope_theta")


def _pattern(kinds: list[str]) -> list[str]:
    """The shortest attention pattern that, aligned to the end of the stack as ModelConfig.layer_kind reads it,
    gives these layer kinds."""
    n = len(kinds)
    for size in range(1, n + 1):
        pat = [kinds[(i - n) % n] for i in range(-size, 0)]  # the last `size` layers
        if all(kinds[i] == pat[(i - n) % size] for i in range(n)):
            return pat
    return kinds


def config_to_hf(cfg: ModelConfig, base: dict | None = None) -> dict:
    """config.json (text layout) for a k3ray model: `base` (the config.json a checkpoint was converted from, if
    any, text layout) with every field k3ray decides set from `cfg`."""
    shared_width = cfg.n_shared * cfg.shared_inner
    if cfg.n_shared and shared_width % cfg.expert_inner:
        raise UnmappedName(f"model: n_shared x shared_inner = {shared_width} is not a multiple of expert_inner="
                           f"{cfg.expert_inner}; the release states the shared width as num_shared_experts x "
                           f"moe_intermediate_size")
    kinds = [cfg.layer_kind(i) for i in range(cfg.n_layers)]
    out = dict(base or {})
    out.update({
        "model_type": out.get("model_type", "kimi_linear"),
        "architectures": out.get("architectures", ["KimiLinearForCausalLM"]),
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": None, "kv_lora_rank": cfg.kv_rank,
        "qk_nope_head_dim": cfg.head_dim, "qk_rope_head_dim": 0, "v_head_dim": cfg.head_dim,
        "mla_use_nope": False, "mla_use_output_gate": True,
        "num_experts": cfg.n_experts, "num_experts_per_token": cfg.top_k,
        "num_shared_experts": shared_width // cfg.expert_inner, "moe_intermediate_size": cfg.expert_inner,
        "routed_expert_hidden_size": cfg.d_latent, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": 0, "moe_layer_freq": 1,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "linear_attn_config": {**(out.get("linear_attn_config") or {}),
                               "num_heads": cfg.n_heads, "head_dim": cfg.kda_head_dim,
                               "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "kda"],
                               "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "mla"]},
        # how k3ray splits the shared width into experts (the release fuses them; the weights are the same)
        K3RAY_FIELDS: {k: getattr(cfg, k) for k in _K3RAY_ONLY + ("n_shared", "shared_inner")},
    })
    return out


def text_config(doc: dict) -> dict:
    """The text model's fields of a config.json in either layout."""
    return doc["text_config"] if isinstance(doc.get("text_config"), dict) else doc


def config_from_hf(doc: dict, dtype: str | None = None) -> dict:
    """ModelConfig fields from a config.json (either layout). Raises ValueError naming the field that k3ray's model
    cannot represent or that is missing."""
    t = text_config(doc)

    def need(key, where=t, prefix=""):
        if key not in where or where[key] is None:
            raise ValueError(f"config.json: {prefix}{key} is missing")
        return where[key]

    def require(key, want, default=None):
        got = t.get(key, default)
        if got != want:
            raise ValueError(f"config.json: {key}={got!r}: k3ray's model holds only {key}={want!r}")

    require("q_lora_rank", None)
    require("qk_rope_head_dim", 0, 0)
    require("first_k_dense_replace", 0, 0)
    if need("qk_nope_head_dim") != need("v_head_dim"):
        raise ValueError(f"config.json: qk_nope_head_dim={t['qk_nope_head_dim']} != v_head_dim={t['v_head_dim']}: "
                         f"k3ray's MLA uses one head width")
    la = need("linear_attn_config")
    n = need("num_hidden_layers")
    mla = {i - 1 for i in la.get("full_attn_layers") or []}
    kda = {i - 1 for i in la.get("kda_layers") or []}
    if mla & kda or (mla | kda) != set(range(n)):
        raise ValueError(f"config.json: linear_attn_config.kda_layers and full_attn_layers must split layers "
                         f"1..{n} between them")
    if kda and need("num_heads", la, "linear_attn_config.") != need("num_attention_heads"):
        raise ValueError(f"config.json: linear_attn_config.num_heads={la['num_heads']} != num_attention_heads="
                         f"{t['num_attention_heads']}: k3ray's KDA and MLA layers have the same heads")
    extra = t.get(K3RAY_FIELDS) or {}
    out = {
        "vocab_size": need("vocab_size"), "d_model": need("hidden_size"), "n_layers": n,
        "n_heads": need("num_attention_heads"), "head_dim": need("qk_nope_head_dim"),
        "kv_rank": need("kv_lora_rank"), "d_latent": need("routed_expert_hidden_size"),
        "n_experts": need("num_experts"), "top_k": need("num_experts_per_token"),
        "expert_inner": need("moe_intermediate_size"),
        "n_shared": 1 if t.get("num_shared_experts") else 0,
        "shared_inner": max(1, (t.get("num_shared_experts") or 0) * t["moe_intermediate_size"]),
        "attention_pattern": _pattern(["mla" if i in mla else "kda" for i in range(n)]),
        "max_seq_len": need("max_position_embeddings"),
        "kda_head_dim": la.get("head_dim", t["qk_nope_head_dim"]),
        "norm_eps": need("rms_norm_eps"),
        **{k: v for k, v in extra.items() if k in _K3RAY_ONLY},
    }
    if extra.get("n_shared", 0) * extra.get("shared_inner", 0) == out["n_shared"] * out["shared_inner"] > 0:
        out["n_shared"], out["shared_inner"] = extra["n_shared"], extra["shared_inner"]
    if dtype is not None:
        out["dtype"] = dtype
    return out
