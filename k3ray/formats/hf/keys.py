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
from functools import partial
from typing import Callable, Iterable

import torch

from k3ray.config import ModelConfig

__all__ = ["Group", "UnmappedName", "RELEASE_PREFIX", "dense_groups", "expert_names", "expert_to_hf",
           "expert_into", "to_layout", "from_layout", "config_to_hf", "config_from_hf", "layout_of", "text_config",
           "is_vision"]

RELEASE_PREFIX = "language_model."  # the release's multimodal wrapper around the text model
VISION_PREFIXES = ("vision_tower.", "mm_projector.")


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


def _a_log(heads: int) -> tuple[Callable, Callable]:
    """KDA's A_log: k3ray [H], the release [1, 1, H, 1] (broadcast against [B, S, H, K] there)."""
    return (lambda ts: [ts[0].reshape(1, 1, heads, 1)]), (lambda ts: [ts[0].reshape(heads)])


def _shared(n_shared: int) -> tuple[Callable, Callable]:
    """k3ray's shared experts s = 0..n-1 (w_gate, w_up [I_s, d], w_out [d, I_s]) are the release's one shared FFN
    with the inner units side by side: a GLU's inner units are independent, so the sum of n FFNs is one FFN of width
    n*I_s (the release has one: n_shared 1, the same tensors)."""
    def to_hf(ts):
        g, u, o = ts[:n_shared], ts[n_shared:2 * n_shared], ts[2 * n_shared:]
        return [torch.cat(g), torch.cat(u), torch.cat(o, dim=1)]

    def from_hf(ts):
        gate, up, down = ts
        return list(gate.chunk(n_shared)) + list(up.chunk(n_shared)) + list(down.chunk(n_shared, dim=1))
    return to_hf, from_hf


# k3ray name inside a block -> release name inside `model.layers.N.` (the tables in k3ray.model's docstrings).
_MLA = {"attn.w_q.weight": "self_attn.q_proj.weight",
        "attn.w_q_down.weight": "self_attn.q_a_proj.weight",
        "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn.w_q_up.weight": "self_attn.q_b_proj.weight",
        "attn.w_dkv.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn.w_ukv.weight": "self_attn.kv_b_proj.weight",  # per head: key rows, then value rows, in both
        "attn.w_g.weight": "self_attn.g_proj.weight",
        "attn.w_o.weight": "self_attn.o_proj.weight"}
_KDA = {"attn.w_q.weight": "self_attn.q_proj.weight",
        "attn.w_k.weight": "self_attn.k_proj.weight",
        "attn.w_v.weight": "self_attn.v_proj.weight",
        "attn.q_conv.weight": "self_attn.q_conv1d.weight",
        "attn.k_conv.weight": "self_attn.k_conv1d.weight",
        "attn.v_conv.weight": "self_attn.v_conv1d.weight",
        "attn.w_a_down.weight": "self_attn.f_a_proj.weight",
        "attn.w_a_up.weight": "self_attn.f_b_proj.weight",
        "attn.dt_bias": "self_attn.dt_bias",
        "attn.w_b.weight": "self_attn.b_proj.weight",
        "attn.o_norm.weight": "self_attn.o_norm.weight",
        "attn.w_g.weight": "self_attn.g_proj.weight",
        "attn.w_o.weight": "self_attn.o_proj.weight"}
_BLOCK = {"attn_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_res.proj.weight": "self_attention_res_proj.weight",
          "attn_res.norm.weight": "self_attention_res_norm.weight",
          "ffn_res.proj.weight": "mlp_res_proj.weight",
          "ffn_res.norm.weight": "mlp_res_norm.weight",
          "ffn.w_gate.weight": "mlp.gate_proj.weight",
          "ffn.w_up.weight": "mlp.up_proj.weight",
          "ffn.w_out.weight": "mlp.down_proj.weight",
          "moe.w_down.weight": "block_sparse_moe.routed_expert_down_proj.weight",
          "moe.norm.weight": "block_sparse_moe.routed_expert_norm.weight",
          "moe.w_up.weight": "block_sparse_moe.routed_expert_up_proj.weight",
          "moe.router.weight": "block_sparse_moe.gate.weight",
          "moe.router.bias": "block_sparse_moe.gate.e_score_correction_bias"}
_TOP = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
        "output_res.proj.weight": "model.output_attn_res_proj.weight",
        "output_res.norm.weight": "model.output_attn_res_norm.weight",
        "lm_head.weight": "lm_head.weight"}
_SHARED = re.compile(r"moe\.shared\.(\d+)\.w_(gate|up|out)\.weight")


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
        kda = cfg.layer_kind(layer) == "kda"
        own = {**_BLOCK, **(_KDA if kda else _MLA)}
        if tail in own:
            groups[name] = _one(name, hf + own[tail])
        elif kda and tail == "attn.A_log":
            groups[name] = Group((name,), (hf + "self_attn.A_log",), *_a_log(cfg.n_heads))
        elif tail == "moe.shared.0.w_gate.weight":
            members = tuple(f"blocks.{layer}.moe.shared.{s}.w_{w}.weight" for w in ("gate", "up", "out")
                            for s in range(cfg.n_shared))
            groups[name] = Group(members, tuple(hf + f"block_sparse_moe.shared_experts.{w}_proj.weight"
                                                for w in ("gate", "up", "down")), *_shared(cfg.n_shared))
        elif not _SHARED.fullmatch(tail):
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


def expert_into(w1: torch.Tensor, w2: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                down: torch.Tensor) -> None:
    """Inverse of expert_to_hf, into one expert's rows of k3ray's stacked weights (w1 [d_latent, 2I], w2 [I,
    d_latent]): one copy per tensor."""
    inner = gate.shape[0]
    w1[:, :inner].copy_(gate.t())
    w1[:, inner:].copy_(up.t())
    w2.copy_(down.t())


# -- the two spellings ------------------------------------------------------------------------------------------
def layout_of(names: Iterable[str]) -> str:
    """'release' when the names carry the multimodal wrapper (`language_model.`), else 'text'."""
    return "release" if any(n.startswith(RELEASE_PREFIX) for n in names) else "text"


def is_vision(name: str) -> bool:
    """The release's vision tower and its projector (k3ray's model is text only)."""
    return name.startswith(VISION_PREFIXES)


def to_layout(name: str, layout: str) -> str:
    return RELEASE_PREFIX + name if layout == "release" else name


def from_layout(name: str) -> str:
    return name.removeprefix(RELEASE_PREFIX)


# -- config.json ------------------------------------------------------------------------------------------------
# Fields that exist only in k3ray travel in config.json under this key (loaders ignore unknown keys), so that a
# checkpoint exported and converted back has the same ModelConfig. A release's config.json has none: the release's
# behaviour is what its fields say (e.g. KDA reads scaled by head_dim^-1/2).
K3RAY_FIELDS = "k3ray"
_K3RAY_ONLY = ("balancing", "sign_update_rate", "quantile_bins", "quantile_window", "quantile_resolution",
               "quantile_step", "quantile_bias_from", "quantile_eval_bias_from", "dtype", "rope_theta",
               "kda_scaled_read")


def _pattern(kinds: list[str]) -> list[str] | None:
    """The shortest attention pattern shorter than the stack that, aligned to its end as ModelConfig.layer_kind
    reads it, gives these layer kinds; None if there is none."""
    n = len(kinds)
    for size in range(1, n):
        pat = kinds[n - size:]
        if all(kinds[i] == pat[(i - n) % size] for i in range(n)):
            return pat
    return None


def config_to_hf(cfg: ModelConfig, base: dict | None = None) -> dict:
    """config.json (text layout) for a k3ray model: `base` (the config.json a checkpoint was converted from, if
    any, text layout) with every field k3ray decides set from `cfg`."""
    kinds = [cfg.layer_kind(i) for i in range(cfg.n_layers)]
    shared_width = cfg.n_shared * cfg.shared_inner
    out = dict(base or {})
    out.update({
        "model_type": out.get("model_type", "kimi_linear"),
        "architectures": out.get("architectures", ["KimiLinearForCausalLM"]),
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": cfg.q_lora_rank or None, "kv_lora_rank": cfg.kv_rank,
        "qk_nope_head_dim": cfg.head_dim, "qk_rope_head_dim": cfg.mla_rope_dim, "v_head_dim": cfg.head_dim,
        "mla_use_nope": not cfg.mla_rope, "mla_use_output_gate": True,
        "num_experts": cfg.n_experts, "num_experts_per_token": cfg.top_k, "moe_intermediate_size": cfg.expert_inner,
        # the release states the shared width as num_shared_experts x moe_intermediate_size
        "num_shared_experts": shared_width // cfg.expert_inner if shared_width % cfg.expert_inner == 0 else None,
        "shared_expert_intermediate_size": shared_width,
        "routed_expert_hidden_size": cfg.d_latent, "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 1.0,
        "first_k_dense_replace": cfg.first_dense_layers, "intermediate_size": cfg.dense_inner or None,
        "moe_layer_freq": 1, "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "attn_res_block_size": cfg.attn_res_block_size or None,
        "rms_norm_eps": cfg.norm_eps, "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "linear_attn_config": {**(out.get("linear_attn_config") or {}),
                               "num_heads": cfg.n_heads, "head_dim": cfg.kda_head_dim,
                               "short_conv_kernel_size": cfg.kda_conv_size or None,
                               "gate_lower_bound": cfg.kda_gate_lower_bound, "use_full_rank_gate": True,
                               "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "kda"],
                               "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "mla"]},
        K3RAY_FIELDS: {**{k: getattr(cfg, k) for k in _K3RAY_ONLY}, "n_shared": cfg.n_shared,
                       "shared_inner": cfg.shared_inner, "attention_pattern": cfg.attention_pattern,
                       "mla_layers": cfg.mla_layers},
    })
    return out


def text_config(doc: dict) -> dict:
    """The text model's fields of a config.json in either layout."""
    return doc["text_config"] if isinstance(doc.get("text_config"), dict) else doc


def _need(where: dict, key: str, prefix: str = ""):
    """where[key], or ValueError naming the missing field."""
    if where.get(key) is None:
        raise ValueError(f"config.json: {prefix}{key} is missing")
    return where[key]


def _check_representable(t: dict) -> None:
    """ValueError naming a field of the text config whose value k3ray's model cannot hold."""
    for key, want in (("mla_use_output_gate", True), ("tie_word_embeddings", False),
                      ("moe_router_activation_func", "sigmoid")):
        got = t.get(key, want)
        if got != want:
            raise ValueError(f"config.json: {key}={got!r}: k3ray's model holds only {key}={want!r}")
    if _need(t, "qk_nope_head_dim") != _need(t, "v_head_dim"):
        raise ValueError(f"config.json: qk_nope_head_dim={t['qk_nope_head_dim']} != v_head_dim={t['v_head_dim']}: "
                         f"k3ray's MLA uses one head width")


def _layer_kinds(t: dict) -> tuple[set[int], list[str]]:
    """(MLA layers 0-based, the kind of every layer) from linear_attn_config, checked: the KDA and full-attention
    layers split 1..n, KDA's heads are MLA's, KDA's output gate full rank."""
    la = _need(t, "linear_attn_config")
    n = _need(t, "num_hidden_layers")
    mla = {i - 1 for i in la.get("full_attn_layers") or []}
    kda = {i - 1 for i in la.get("kda_layers") or []}
    if mla & kda or (mla | kda) != set(range(n)):
        raise ValueError(f"config.json: linear_attn_config.kda_layers and full_attn_layers must split layers "
                         f"1..{n} between them")
    if kda and _need(la, "num_heads", "linear_attn_config.") != _need(t, "num_attention_heads"):
        raise ValueError(f"config.json: linear_attn_config.num_heads={la['num_heads']} != num_attention_heads="
                         f"{t['num_attention_heads']}: k3ray's KDA and MLA layers have the same heads")
    if kda and not la.get("use_full_rank_gate", True):
        raise ValueError("config.json: linear_attn_config.use_full_rank_gate=false: k3ray's KDA output gate is "
                         "full rank (g_proj)")
    return mla, ["mla" if i in mla else "kda" for i in range(n)]


def config_from_hf(doc: dict, dtype: str | None = None) -> dict:
    """ModelConfig fields from a config.json (either layout). Raises ValueError naming the field that k3ray's model
    cannot represent or that is missing."""
    t = text_config(doc)
    _check_representable(t)
    mla, kinds = _layer_kinds(t)
    la, n = t["linear_attn_config"], len(kinds)
    shared = t.get("shared_expert_intermediate_size") or \
        (t.get("num_shared_experts") or 0) * _need(t, "moe_intermediate_size")
    pattern = _pattern(kinds)
    need = partial(_need, t)
    out = {
        "vocab_size": need("vocab_size"), "d_model": need("hidden_size"), "n_layers": n,
        "n_heads": need("num_attention_heads"), "head_dim": need("qk_nope_head_dim"),
        "kv_rank": need("kv_lora_rank"), "q_lora_rank": t.get("q_lora_rank") or 0,
        "mla_rope_dim": t.get("qk_rope_head_dim") or 0, "mla_rope": not t.get("mla_use_nope", False),
        "d_latent": need("routed_expert_hidden_size"),
        "n_experts": need("num_experts"), "top_k": need("num_experts_per_token"),
        "expert_inner": need("moe_intermediate_size"), "n_shared": 1 if shared else 0, "shared_inner": shared or 1,
        "first_dense_layers": t.get("first_k_dense_replace") or 0, "dense_inner": t.get("intermediate_size") or 0,
        **({"attention_pattern": pattern} if pattern else {"mla_layers": sorted(mla)}),
        "max_seq_len": need("max_position_embeddings"),
        "kda_head_dim": la.get("head_dim", t["qk_nope_head_dim"]),
        "kda_conv_size": la.get("short_conv_kernel_size") or 0,
        "kda_gate_lower_bound": la.get("gate_lower_bound"),
        "kda_scaled_read": True,
        "attn_res_block_size": t.get("attn_res_block_size") or 0,
        "norm_eps": need("rms_norm_eps"),
    }
    if out["mla_rope"] and not out["mla_rope_dim"]:  # RoPE over nothing: no position encoding either way
        out["mla_rope"] = False
    if not out["first_dense_layers"]:
        out["dense_inner"] = 0
    out = _k3ray_spelling(out, t.get(K3RAY_FIELDS) or {}, mla, kinds)
    if dtype is not None:
        out["dtype"] = dtype
    return out


def _k3ray_spelling(out: dict, extra: dict, mla: set[int], kinds: list[str]) -> dict:
    """`out` with the fields only k3ray has (`extra`: the config's K3RAY_FIELDS), and k3ray's own split of the
    shared width and spelling of the layer kinds where they give the same model."""
    out = {**out, **{k: v for k, v in extra.items() if k in _K3RAY_ONLY}}
    if extra.get("n_shared", 0) * extra.get("shared_inner", 0) == out["n_shared"] * out["shared_inner"] > 0:
        out["n_shared"], out["shared_inner"] = extra["n_shared"], extra["shared_inner"]
    if "attention_pattern" in extra and "mla_layers" in extra:
        spelled = {k: v for k, v in out.items() if k not in ("attention_pattern", "mla_layers")}
        spelled.update(attention_pattern=extra["attention_pattern"], mla_layers=extra["mla_layers"])
        if extra["mla_layers"] is not None and sorted(extra["mla_layers"]) == sorted(mla) or \
                extra["mla_layers"] is None and _aligned(extra["attention_pattern"], len(kinds)) == kinds:
            out = spelled
    return out


def _aligned(pattern: list[str], n: int) -> list[str]:
    return [pattern[(i - n) % len(pattern)] for i in range(n)]
