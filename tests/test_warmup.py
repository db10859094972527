"""Warm starts: the kept kernel caches reach a GPU job's actors, and `k3ray warmup` runs the job's step on a model
with one layer of each kind the job's stack holds."""
from __future__ import annotations

import subprocess
import sys

from k3ray.config import load_config
from k3ray.control.warmup import warmup_config
from k3ray.grid.kernel_cache import kernel_cache_env
from k3ray.grid.held_resources import actor_runtime_env


def _kinds(m) -> set[tuple[str, bool]]:
    return {(m.layer_kind(i), m.is_moe_layer(i)) for i in range(m.n_layers)}


def test_the_warmup_model_holds_one_layer_of_each_kind_the_job_holds():
    for path, layers in [("configs/k3.yaml", 3), ("configs/gpu2.yaml", 4), ("configs/tiny.yaml", None)]:
        cfg = load_config(path)
        small = warmup_config(cfg)
        assert small.parallel.pp == small.parallel.ep == 1
        assert _kinds(small.model) == _kinds(cfg.model)
        assert small.model.n_layers == (layers or small.model.n_layers) <= cfg.model.n_layers
        assert (small.data.seq_len, small.data.micro_batch_size) == (cfg.data.seq_len, cfg.data.micro_batch_size)


def test_the_kernel_cache_is_the_users_own_setting_else_k3rays_folder(monkeypatch, tmp_path):
    for var in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("K3RAY_KERNEL_CACHE", str(tmp_path))
    env = kernel_cache_env()
    assert env == {"TRITON_CACHE_DIR": str(tmp_path / "triton"), "TRITON_CACHE_AUTOTUNING": "1",
                   "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    assert kernel_cache_env()["TRITON_CACHE_DIR"] == "/elsewhere"
    gpu = load_config("configs/gpu2.yaml")
    assert actor_runtime_env(gpu)["env_vars"]["TRITON_CACHE_DIR"] == "/elsewhere"  # workers and spares alike
    assert actor_runtime_env(load_config("configs/tiny.yaml")) is None  # CPU jobs: nothing to keep


def test_warmup_runs_the_jobs_step_on_cpu_and_refuses_a_gpu_config_without_a_gpu():
    ok = subprocess.run([sys.executable, "-m", "k3ray", "warmup", "--config", "configs/tiny.yaml"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "warmup of tiny" in ok.stdout and "first step" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "k3ray", "warmup", "--config", "configs/gpu2.yaml"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no GPU" in bad.stderr and "Traceback" not in bad.stderr
