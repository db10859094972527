"""Config loading: shipped configs validate, broken ones fail naming the file and the field, and `config show`
reproduces the K3 totals of K3_NOTES."""
from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest
import yaml

from k3ray.control.cli import build_parser, main
from k3ray.config import ConfigError, FaultSpec, JobConfig, load_config
from k3ray.faults import FAULT_KINDS, SERVING_FAULTS, TRAINING_FAULTS, inject

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


@pytest.mark.parametrize("name", ["tiny", "k3", "gpu2"])
def test_shipped_configs_load(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert isinstance(cfg, JobConfig)
    assert cfg.model.n_experts % cfg.parallel.ep == 0


def _tiny_with(tmp_path: Path, section: str, key: str, value) -> Path:
    data = yaml.safe_load((CONFIGS / "tiny.yaml").read_text())
    data.setdefault(section, {})[key] = value
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _error(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_unknown_key_names_file_and_field(tmp_path):
    path = _tiny_with(tmp_path, "model", "colour", "blue")
    msg = _error(path)
    assert str(path) in msg
    assert "model.colour" in msg
    assert "unknown key" in msg


def test_negative_size_names_file_and_field(tmp_path):
    path = _tiny_with(tmp_path, "model", "d_model", -1)
    msg = _error(path)
    assert str(path) in msg
    assert "model.d_model" in msg


def test_ep_not_dividing_experts_names_both(tmp_path):
    path = _tiny_with(tmp_path, "parallel", "ep", 3)
    msg = _error(path)
    assert str(path) in msg
    assert "parallel.ep=3" in msg
    assert "n_experts=16" in msg


def test_bad_yaml_names_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  d_model: [64\n  n_layers: 4\n")
    msg = _error(path)
    assert str(path) in msg
    assert "YAML" in msg


def test_missing_file_names_file(tmp_path):
    path = tmp_path / "does_not_exist.yaml"
    msg = _error(path)
    assert str(path) in msg
    assert "cannot read" in msg


def test_config_show_k3_matches_notes(capsys):
    assert main(["config", "show", str(CONFIGS / "k3.yaml"), "--json"]) == 0
    totals = json.loads(capsys.readouterr().out)
    assert totals["total_params"] == pytest.approx(2779.5e9, rel=0.005)  # the released model's figures
    assert totals["active_params"] == pytest.approx(105.4e9, rel=0.005)
    assert totals["dense_layers"] == 1
    assert totals["dispatch_values_per_token"] == 57344
    assert totals["dispatch_values_per_token_full_width_top_k_half"] == 57344
    assert totals["layers"] == 93
    assert (totals["kda_layers"], totals["mla_layers"]) == (69, 24)


def test_cli_bad_config_exits_2_with_message(tmp_path, capsys):
    path = _tiny_with(tmp_path, "parallel", "ep", 3)
    assert main(["config", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3ray: ")
    assert str(path) in err
    assert "parallel.ep=3" in err and "n_experts=16" in err


def test_cli_train_missing_config_exits_2(tmp_path, capsys):
    path = tmp_path / "nowhere.yaml"
    assert main(["train", "--config", str(path), "--single-process", "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3ray: ") and str(path) in err and "cannot read" in err


@pytest.mark.parametrize("value", [-1, 1.5, True, "two"])
def test_bad_spares_count_exits_2_naming_the_field(tmp_path, capsys, value):
    path = _tiny_with(tmp_path, "fault_tolerance", "spares", value)
    assert main(["config", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3ray: ") and str(path) in err and "fault_tolerance.spares" in err


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_learning_rate_is_refused_before_training(tmp_path, capsys, value):
    assert main(["train", "--config", "configs/tiny.yaml", "--set", f"optimizer.lr={value}", "--single-process",
                 "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3ray: ") and "optimizer.lr" in err and "finite" in err and err.count("\n") == 2


def test_a_missing_data_folder_is_refused_before_any_worker_starts(tmp_path, capsys):
    missing = tmp_path / "no-such-corpus"
    assert main(["train", "--config", "configs/tiny.yaml", "--set", f"data.source={missing}", "--steps", "1",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("k3ray: ") and "data.source" in err and "neither 'stdlib' nor a directory" in err


def test_a_relative_data_folder_is_read_from_where_the_user_ran_the_command(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = load_config(Path(__file__).parents[1] / "configs/tiny.yaml", {"data.source": "corpus"})
    assert cfg.with_paths_from(tmp_path).data.source == str(corpus)


def test_fault_kinds_come_from_one_registry():
    """The config, `k3ray drill` and `inject` take the kinds k3ray.faults.FAULT_KINDS names, and no others."""
    assert get_args(FaultSpec.model_fields["kind"].annotation) == TRAINING_FAULTS
    drill = build_parser()._subparsers._group_actions[0].choices["drill"]
    assert next(a.choices for a in drill._actions if a.dest == "kind") == TRAINING_FAULTS
    assert set(TRAINING_FAULTS) | set(SERVING_FAULTS) == set(FAULT_KINDS)
    with pytest.raises(ValueError, match="drill kind: 'melt' is not one of kill_worker, nan"):
        inject(None, "melt", [])
