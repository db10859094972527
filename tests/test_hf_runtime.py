"""A release folder converted to a k3ray checkpoint, with Ray workers: it serves on pp=2 x ep=2 (paged caches, expert
parallelism) with exactly the greedy tokens of the single-process reference on the same weights, and training
resumes from it on another EP size with exactly its weights. float64 (the folder holds F64 tensors) so that batching
cannot flip an argmax."""
from __future__ import annotations

import math

import ray
import torch

from conftest import job_params
from k3ray.config import load_config, serving_config
from k3ray.control.driver import running_job

from k3ray.formats.hf.convert import convert_from_hf
from k3ray.formats.serving_weights import serving_weights
from k3ray.serve.engine import ServingEngine
from k3ray.data import EOS, encode
from k3ray.model.decoder import build_stage
from k3ray.model.sampling import SamplingParams, visible_ids
from k3ray.optim import AdamW
from k3ray.parallel import shards
from k3ray.parallel.reference import generate_reference
from test_hf_format import write_release

PROMPTS = ["def ", "class A:\n    def f(self", "x = ["]
SERVE = {"page_size": 4, "pages_per_rank": 64, "slots_per_rank": 4, "token_budget": 16, "max_waiting": 8,
         "max_tokens": 32}


def test_converted_release_serves_on_pp2_ep2_as_the_reference(ray_cluster, tmp_path):
    src = write_release(tmp_path / "hf", dtype=torch.float64, seed=11)
    root = str(tmp_path / "k3")
    convert_from_hf(str(src), root, pp=1, ep=1)  # written on one worker, served on four

    torch.set_num_threads(1)
    w = serving_weights(root)
    cfg = serving_config(w.config, 1, 1)
    assert cfg.model.dtype == "float64"
    model = build_stage(cfg.model, range(cfg.model.n_layers), init=False)
    shards.load_weights(model, AdamW(cfg.optimizer), w.state, {i: [x] for i, x in w.state["experts"].items()},
                        set(range(cfg.model.n_experts)))
    sp = SamplingParams(max_tokens=12)
    want = [visible_ids(generate_reference(model, encode(p), sp)[0], sp, EOS) for p in PROMPTS]
    assert len(set(map(tuple, want))) > 1  # the prompts lead somewhere different: the weights matter

    engine = ServingEngine.options(num_cpus=0).remote(root, 2, 2, SERVE)
    try:
        assert ray.get(engine.ready.remote(), timeout=300)["pp"] == 2
        for prompt, tokens in zip(PROMPTS, want):
            got = [t for item in ray.get(list(engine.generate.options(num_returns="streaming").remote(
                encode(prompt), SamplingParams(max_tokens=12, temperature=0.0)))) for t in item.get("tokens", ())]
            assert got == tokens, prompt
    finally:
        ray.get(engine.shutdown.remote(), timeout=120)
        ray.kill(engine, no_restart=True)


def test_training_resumes_from_a_converted_release_on_another_ep(ray_cluster, tmp_path):
    src = write_release(tmp_path / "hf", dtype=torch.float64, seed=12)
    root = tmp_path / "k3"
    convert_from_hf(str(src), str(root))  # one worker's part; the job runs two EP ranks
    cfg = load_config(root / "config.yaml", {"parallel.ep": 2, "train.eval_every": 0, "checkpoint.at_end": False,
                                             "data.seq_len": 32, "data.micro_batch_size": 2})
    want = serving_weights(str(root)).state
    with running_job(cfg, resume=True) as job:
        assert ray.get(job.status.remote())["step"] == 0
        got = job_params(job)
        for name, t in want["dense"].items():
            assert torch.equal(got[name], t), name
        for layer, x in want["experts"].items():
            for row, e in enumerate(x["expert_ids"]):
                assert torch.equal(got[f"{layer}.expert{e}.w1"], x["w1"][row])
                assert torch.equal(got[f"{layer}.expert{e}.w2"], x["w2"][row])
        assert math.isfinite(ray.get(job.train_step.remote(0), timeout=300)["loss"])
