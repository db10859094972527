"""The released (Hugging Face) checkpoint format: a tiny folder written here with the release's tensor names and
config.json fields (shapes worked out below from the config, not by k3ray) converts to a k3ray checkpoint and
exports back bit for bit; bad folders fail with one line naming the tensor and the file. Ray-free; seconds."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3ray.control.cli import main
from k3ray.formats.hf.convert import convert_from_hf, export_hf, export_weights_only
from k3ray.formats.serving_weights import serving_weights
from k3ray.io import checkpoint as ckpt
from k3ray.formats.hf.files import HFFolder

D, H, HD, P, QL, R, LAT, E, I, DENSE, W, VOCAB = 64, 4, 16, 8, 24, 32, 32, 8, 32, 96, 4, 256
CONFIG = {  # the released K3's fields at a reduced size: 4 layers, MLA at 0-based 2 and 3 (as K3's 91 and 92)
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": VOCAB, "hidden_size": D, "num_hidden_layers": 4, "num_attention_heads": H,
    "num_key_value_heads": H, "q_lora_rank": QL, "kv_lora_rank": R, "qk_nope_head_dim": HD, "qk_rope_head_dim": P,
    "v_head_dim": HD, "mla_use_nope": True, "mla_use_output_gate": True, "num_experts": E,
    "num_experts_per_token": 2, "num_shared_experts": 2, "moe_intermediate_size": I, "routed_expert_hidden_size": LAT,
    "latent_moe_use_norm": True, "first_k_dense_replace": 1, "intermediate_size": DENSE, "attn_res_block_size": 2,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "tie_word_embeddings": False,
    "linear_attn_config": {"num_heads": H, "head_dim": HD, "kda_layers": [1, 2], "full_attn_layers": [3, 4],
                           "short_conv_kernel_size": W, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
    "bos_token_id": 1, "eos_token_id": 2,
}


def release_tensors(prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """Every tensor of CONFIG's model under the release's names, with its shape (nn.Linear weights are [out, in])."""
    head = ("language_model." if prefix.startswith("language_model") else "") + "lm_head.weight"
    out = {f"{prefix}embed_tokens.weight": (VOCAB, D), f"{prefix}norm.weight": (D,), head: (VOCAB, D),
           f"{prefix}output_attn_res_proj.weight": (1, D), f"{prefix}output_attn_res_norm.weight": (D,)}
    for n in range(4):
        p = f"{prefix}layers.{n}."
        out |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                p + "self_attention_res_proj.weight": (1, D), p + "self_attention_res_norm.weight": (D,),
                p + "mlp_res_proj.weight": (1, D), p + "mlp_res_norm.weight": (D,)}
        a = p + "self_attn."
        if n + 1 in CONFIG["linear_attn_config"]["kda_layers"]:
            out |= {a + "q_proj.weight": (H * HD, D), a + "k_proj.weight": (H * HD, D),
                    a + "v_proj.weight": (H * HD, D),
                    a + "q_conv1d.weight": (H * HD, 1, W), a + "k_conv1d.weight": (H * HD, 1, W),
                    a + "v_conv1d.weight": (H * HD, 1, W), a + "A_log": (1, 1, H, 1), a + "dt_bias": (H * HD,),
                    a + "f_a_proj.weight": (HD, D), a + "f_b_proj.weight": (H * HD, HD),
                    a + "b_proj.weight": (H, D), a + "o_norm.weight": (HD,), a + "g_proj.weight": (H * HD, D),
                    a + "o_proj.weight": (D, H * HD)}
        else:
            out |= {a + "q_a_proj.weight": (QL, D), a + "q_a_layernorm.weight": (QL,),
                    a + "q_b_proj.weight": (H * (HD + P), QL), a + "kv_a_proj_with_mqa.weight": (R + P, D),
                    a + "kv_a_layernorm.weight": (R,), a + "kv_b_proj.weight": (H * 2 * HD, R),
                    a + "g_proj.weight": (H * HD, D), a + "o_proj.weight": (D, H * HD)}
        if n < CONFIG["first_k_dense_replace"]:
            out |= {p + "mlp.gate_proj.weight": (DENSE, D), p + "mlp.up_proj.weight": (DENSE, D),
                    p + "mlp.down_proj.weight": (D, DENSE)}
            continue
        m = p + "block_sparse_moe."
        out |= {m + "gate.weight": (E, D), m + "gate.e_score_correction_bias": (E,),
                m + "routed_expert_down_proj.weight": (LAT, D), m + "routed_expert_norm.weight": (LAT,),
                m + "routed_expert_up_proj.weight": (D, LAT),
                m + "shared_experts.gate_proj.weight": (2 * I, D), m + "shared_experts.up_proj.weight": (2 * I, D),
                m + "shared_experts.down_proj.weight": (D, 2 * I)}
        for e in range(E):
            out |= {m + f"experts.{e}.w1.weight": (I, LAT), m + f"experts.{e}.w3.weight": (I, LAT),
                    m + f"experts.{e}.w2.weight": (LAT, I)}
    return out


def write_release(path: Path, config: dict = CONFIG, prefix: str = "model.", shards: int = 3, seed: int = 0,
                  drop: str | None = None, change: dict | None = None, dtype=torch.bfloat16) -> Path:
    """A release folder: `dtype` weights (the router bias float32) in `shards` files plus the index. `drop` leaves
    a tensor out; `change` replaces tensors by name."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in release_tensors(prefix).items():
        fp32 = name.endswith("e_score_correction_bias")
        if name.endswith("norm.weight"):
            t = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) * shape[-1] ** -0.5
        tensors[name] = t.to(torch.float32 if fp32 else dtype)
    tensors |= change or {}
    tensors.pop(drop, None)
    path.mkdir(parents=True)
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map |= {n: file for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    return path


def read_all(path: Path) -> dict[str, torch.Tensor]:
    folder = HFFolder(path)
    return {n: folder.get(n) for n in folder.tensors}


@pytest.mark.parametrize("prefix", ["model.", "language_model.model."])
def test_round_trip_release_to_k3ray_to_release_is_bit_exact(tmp_path, prefix):
    """Through a pp=2 x ep=2 k3ray checkpoint and back: the same names, dtypes and bytes; config.json keeps every
    field it had (the release's spelling, nested under text_config, stays nested)."""
    release = prefix.startswith("language_model")
    config = {"model_type": "kimi_k3", "text_config": CONFIG} if release else CONFIG
    # the release also holds its vision tower, which k3ray's text model leaves out (and says so)
    vision = {"vision_tower.patch_embed.proj.weight": torch.zeros(8, 3, 2, 2, dtype=torch.bfloat16)} if release else {}
    src = write_release(tmp_path / "hf", config, prefix, change=vision)
    info = convert_from_hf(str(src), str(tmp_path / "k3"), pp=2, ep=2)
    assert info["vision_tensors_left_out"] == len(vision)
    out = export_hf(str(tmp_path / "k3"), str(tmp_path / "back"), max_shard_bytes=40_000)
    a, b = read_all(src), read_all(tmp_path / "back")
    for name in vision:
        del a[name]
    assert sorted(a) == sorted(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)), n
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    want, got = (config["text_config"], back["text_config"]) if "text_config" in config else (config, back)
    assert {k: got[k] for k in want if k != "linear_attn_config"} == {k: v for k, v in want.items()
                                                                      if k != "linear_attn_config"}
    assert {k: got["linear_attn_config"][k] for k in want["linear_attn_config"]} == want["linear_attn_config"]
    # shards as the release names them, each within the limit unless one tensor alone is larger
    files = sorted(p.name for p in (tmp_path / "back").glob("*.safetensors"))
    assert files == [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    assert out["shards"] == len(files) > 1
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    for f in files:
        with safe_open(str(tmp_path / "back" / f), "pt") as h:
            assert all(index["weight_map"][k] == f for k in h.keys())


def test_converted_checkpoint_is_a_verified_k3ray_checkpoint_of_the_grid(tmp_path):
    src = write_release(tmp_path / "hf")
    info = convert_from_hf(str(src), str(tmp_path / "k3"), pp=2, ep=2)
    m = ckpt.verify(tmp_path / "k3", 0)
    assert sorted(m.parts) == [f"rank{r:05d}.pt" for r in range(4)] and info["parts"] == 4
    assert m.meta["pp"] == 2 and m.meta["ep"] == 2 and m.meta["config"]["model"]["dtype"] == "bfloat16"
    assert (tmp_path / "k3" / "config.yaml").is_file()
    # EP rank 1 of stage 0 holds experts 4..7 of layer 1 (layer 0 is dense) and no dense tensor (rank 0 of the
    # stage has them)
    part = ckpt.load_part(tmp_path / "k3", 0, "rank00001.pt")
    assert part["dense"] == {} and sorted(part["experts"]) == [1]
    assert part["experts"][1]["expert_ids"] == [4, 5, 6, 7]
    # a routed expert's gate is the first half of k3ray's w1, transposed (k3ray's expert weights are input-major)
    gate = HFFolder(src).get("model.layers.1.block_sparse_moe.experts.5.w1.weight")
    assert torch.equal(part["experts"][1]["w1"][1][:, :I], gate.t())


def test_weights_only_export_drops_optimizer_state_and_keeps_weights(tmp_path, serving_checkpoint_local):
    out = tmp_path / "weights"
    export_weights_only(serving_checkpoint_local, str(out))
    full, light = serving_weights(serving_checkpoint_local), serving_weights(str(out))
    assert light.config["model"]["dtype"] == "bfloat16"
    for n, t in full.state["dense"].items():
        assert torch.equal(light.state["dense"][n], t.to(torch.bfloat16)), n
    part = ckpt.load_part(out, light.step, "rank00000.pt")
    assert part["opt_dense"] == {} and all(x["opt"] == {"w1": None, "w2": None} for x in part["experts"].values())


@pytest.fixture
def serving_checkpoint_local(tmp_path) -> str:
    """A k3ray checkpoint with optimizer state, written without Ray: a converted one trained by nothing, plus
    moments put in by hand (what training would have written)."""
    src = write_release(tmp_path / "hf-src", seed=5)
    root = tmp_path / "k3-src"
    convert_from_hf(str(src), str(root), dtype="float32")
    part = ckpt.load_part(root, 0, "rank00000.pt")
    part["opt_dense"] = {n: {"m": torch.ones_like(t), "v": torch.ones_like(t)} for n, t in part["dense"].items()}
    part["opt_steps"] = 7
    m = ckpt.verify(root, 0)
    info = ckpt.write_part(root, 1, "rank00000.pt", part)  # a committed step is never written over: the next one
    ckpt.commit(root, 1, [info], m.meta, keep=1)
    return str(root)


def test_a_trained_checkpoint_exports_and_converts_back(tmp_path):
    """A k3ray checkpoint that never came from a release (no source recorded; float32 weights) exports in the
    release's format, which converts back to the same weights and model config."""
    src = write_release(tmp_path / "hf", seed=3)
    root = tmp_path / "k3"
    convert_from_hf(str(src), str(root), pp=2, ep=2, dtype="float32")
    m = ckpt.verify(root, 0)
    meta = {k: v for k, v in m.meta.items() if k != "source"}
    written = []
    for name in m.parts:  # every dense weight moved off bf16's grid: export must keep float32 to give it back
        state = ckpt.load_part(root, 0, name)
        state["dense"] = {n: t + 1e-4 for n, t in state["dense"].items()}
        written.append(ckpt.write_part(root, 1, name, state))
    ckpt.commit(root, 1, written, meta, keep=2)
    assert main(["export", "--hf", str(root), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "kimi_linear" and config["torch_dtype"] == "float32"
    convert_from_hf(str(tmp_path / "out"), str(tmp_path / "again"), ep=4)
    a, b = serving_weights(str(root)), serving_weights(str(tmp_path / "again"))
    assert a.step == 1 and a.config["model"] == b.config["model"]
    for n, t in a.state["dense"].items():
        assert torch.equal(b.state["dense"][n], t), n
    for layer, x in a.state["experts"].items():
        assert torch.equal(b.state["experts"][layer]["w1"], x["w1"]) and torch.equal(
            b.state["experts"][layer]["w2"], x["w2"])


def test_serving_reads_a_release_folder_directly(tmp_path):
    src = write_release(tmp_path / "hf")
    convert_from_hf(str(src), str(tmp_path / "k3"), pp=2, ep=2)
    direct, converted = serving_weights(str(src)), serving_weights(str(tmp_path / "k3"))
    assert direct.config["model"] == converted.config["model"]
    for n, t in converted.state["dense"].items():
        assert torch.equal(direct.state["dense"][n], t), n
    for layer, x in converted.state["experts"].items():
        assert x["expert_ids"] == direct.state["experts"][layer]["expert_ids"]
        assert torch.equal(x["w1"], direct.state["experts"][layer]["w1"])


# -- bad input: one line naming the tensor and the file, exit 2, no traceback -----------------------------------------
def _cli_error(capsys, *argv) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_missing_shard(tmp_path, capsys):
    src = write_release(tmp_path / "hf")
    (src / "model-00002-of-00003.safetensors").unlink()
    err = _cli_error(capsys, "convert", "--from-hf", str(src), "--to", str(tmp_path / "k3"))
    assert "model-00002-of-00003.safetensors is missing" in err and "model." in err


def test_shape_that_does_not_match_config(tmp_path, capsys):
    name = "model.layers.2.self_attn.kv_b_proj.weight"  # layer 2 is MLA (1-based 3)
    src = write_release(tmp_path / "hf", change={name: torch.zeros(H * 2 * HD, R + 1, dtype=torch.bfloat16)})
    err = _cli_error(capsys, "convert", "--from-hf", str(src), "--to", str(tmp_path / "k3"))
    assert name in err and ".safetensors" in err and f"shape [{H * 2 * HD}, {R + 1}]" in err
    assert not (tmp_path / "k3").exists()  # checked whole before anything is written


def test_unknown_key(tmp_path, capsys):
    name = "model.layers.3.self_attn.q_conv1d.weight"  # a KDA convolution in an MLA layer
    src = write_release(tmp_path / "hf", change={name: torch.zeros(H * HD, 1, W, dtype=torch.bfloat16)})
    err = _cli_error(capsys, "convert", "--from-hf", str(src), "--to", str(tmp_path / "k3"))
    assert name in err and "unknown tensor" in err and ".safetensors" in err


def test_dtype_k3ray_cannot_hold(tmp_path, capsys):
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"  # e.g. a quantised release's packed int8
    src = write_release(tmp_path / "hf", change={name: torch.zeros(LAT, I, dtype=torch.int8)})
    err = _cli_error(capsys, "convert", "--from-hf", str(src), "--to", str(tmp_path / "k3"))
    assert name in err and "dtype I8" in err and ".safetensors" in err


def test_serving_a_bad_release_folder(tmp_path, capsys):
    name = "model.layers.1.block_sparse_moe.gate.weight"
    src = write_release(tmp_path / "hf", change={name: torch.zeros(E + 1, D, dtype=torch.bfloat16)})
    err = _cli_error(capsys, "serve", "--checkpoint", str(src))  # before any Ray actor starts
    assert name in err and f"shape [{E + 1}, {D}]" in err


def test_missing_tensor_and_config_field(tmp_path, capsys):
    name = "model.layers.3.block_sparse_moe.experts.7.w3.weight"
    src = write_release(tmp_path / "hf", drop=name)
    err = _cli_error(capsys, "convert", "--from-hf", str(src), "--to", str(tmp_path / "k3"))
    assert name in err and "missing" in err
    bad = write_release(tmp_path / "hf2", config={k: v for k, v in CONFIG.items() if k != "kv_lora_rank"})
    err = _cli_error(capsys, "convert", "--from-hf", str(bad), "--to", str(tmp_path / "k3b"))
    assert "config.json" in err and "kv_lora_rank" in err


def _release_k3_config() -> dict:
    """config.json of the released K3 (text fields, as the port transcribes the model card)."""
    return {"vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93, "num_attention_heads": 96,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True, "num_experts": 896,
            "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
            "routed_expert_hidden_size": 3584, "first_k_dense_replace": 1, "intermediate_size": 33792,
            "attn_res_block_size": 12, "rms_norm_eps": 1e-5, "max_position_embeddings": 1048576,
            "moe_router_activation_func": "sigmoid", "tie_word_embeddings": False,
            "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                                   "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                                   "full_attn_layers": list(range(4, 93, 4)) + [93],
                                   "kda_layers": [i for i in range(1, 94) if i % 4 and i != 93]}}


def test_release_config_is_configs_k3():
    """The released config.json describes exactly configs/k3.yaml's model."""
    from k3ray.config import ModelConfig, load_config
    from k3ray.formats.hf.keys import config_from_hf

    want = load_config("configs/k3.yaml").model
    assert ModelConfig.model_validate(config_from_hf({"model_type": "kimi_k3", "text_config": _release_k3_config()},
                                                     "bfloat16")) == want


@pytest.mark.parametrize("path,released", [("configs/tiny.yaml", False), ("configs/tiny.yaml", True),
                                           ("configs/gpu2.yaml", False), ("configs/k3.yaml", False)])
def test_model_config_survives_config_json(path, released):
    """k3ray -> config.json -> k3ray gives the same ModelConfig (k3ray-only fields travel under `k3ray`)."""
    from conftest import RELEASED
    from k3ray.config import ModelConfig, load_config
    from k3ray.formats.hf.keys import config_from_hf, config_to_hf

    cfg = load_config(path, RELEASED if released else {}).model
    assert ModelConfig.model_validate(config_from_hf(json.loads(json.dumps(config_to_hf(cfg))))) == cfg


def test_a_grid_that_does_not_fit_the_model(tmp_path, capsys):
    src = write_release(tmp_path / "hf")
    err = _cli_error(capsys, "convert", "--from-hf", str(src), "--to", str(tmp_path / "k3"), "--ep", "3")
    assert f"parallel.ep=3 does not divide model.n_experts={E}" in err
