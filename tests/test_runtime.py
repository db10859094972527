"""The Ray runtime reproduces the single-process reference; shards move; impossible topologies fail fast."""
from __future__ import annotations

import tempfile

import pytest
import ray
import torch

from k3ray.config import load_config
from conftest import RELEASED, SMALL_BATCH, UNFAILED_STEPS, job_params, run_job
from k3ray.control.driver import running_job, start_controller
from k3ray.parallel.reference import ReferenceTrainer

STEPS = UNFAILED_STEPS  # the shared unfailed run's length and train.steps, which this module's runs match


def tiny(**overrides):
    return load_config("configs/tiny.yaml", {"parallel.pp": 1, "parallel.ep": 1, "train.eval_every": 0,
                                            "train.steps": STEPS, **SMALL_BATCH,
                                            "checkpoint.dir": tempfile.mkdtemp(prefix="k3ray-runtime-"), **overrides})


@pytest.fixture(scope="module")
def reference_losses():
    cache = {}

    def get(ep: int, dtype: str, steps: int, released: bool = False) -> list[float]:
        key = (ep, dtype, steps, released)
        if key not in cache:
            trainer = ReferenceTrainer(tiny(**{"parallel.ep": ep, "model.dtype": dtype, **(RELEASED if released else {})}))
            cache[key] = [trainer.train_step(s, s).loss for s in range(steps)]
        return cache[key]

    return get


def run_distributed(cfg, steps: int) -> list[dict]:
    return run_job(cfg, steps, timeout_s=120).reports


def assert_close(got: list[float], want: list[float], rel: float) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rel * abs(w), f"step {step}: {g} vs reference {w} (rel {abs(g - w) / abs(w):.2e})"


@pytest.mark.parametrize("pp,ep", [(2, 2), (1, 4), (4, 1)])
def test_distributed_matches_reference_exactly_in_float64(ray_cluster, reference_losses, unfailed_ep4, pp, ep):
    """Same seed and data, MoonEP on: the 1F1B pipeline and the EP all-to-alls compute the reference's math.
    In float64 the trajectories agree to rounding (no top-k decision can flip): summation-order ulps,
    which Adam's normalisation amplifies over the steps to ~1e-9 with float64 moments. pp=1 x ep=4 is the session's
    shared unfailed run (the fault tests' reference, so it is checked here)."""
    cfg = tiny(**{"parallel.pp": pp, "parallel.ep": ep, "model.dtype": "float64"})
    reports = unfailed_ep4.reports if (pp, ep) == (1, 4) else run_distributed(cfg, STEPS)
    check_float64_run(cfg, reports, reference_losses(ep, "float64", STEPS))


def test_released_model_distributed_matches_reference_exactly_in_float64(ray_cluster, reference_losses):
    """The same with every feature of the released K3 on (conftest.RELEASED) at pp=2 x ep=2: the dense first layer,
    q-LoRA MLA without RoPE, KDA's convolution and bounded gate, and the Block AttnRes summaries crossing the
    pipeline boundary (forward and backward)."""
    steps = 6
    cfg = tiny(**{"parallel.pp": 2, "parallel.ep": 2, "model.dtype": "float64", "train.steps": steps, **RELEASED})
    check_float64_run(cfg, run_distributed(cfg, steps), reference_losses(2, "float64", steps, released=True))


def check_float64_run(cfg, reports: list[dict], want: list[float]) -> None:
    ep = cfg.parallel.ep
    assert len(reports) == len(want)
    assert_close([r["loss"] for r in reports], want, 1e-8)
    last = reports[-1]
    assert set(last["tokens_per_expert"]) == set(cfg.model.moe_layer_ids())
    assert all(len(rows) == ep for rows in last["tokens_per_expert"].values())
    assert {"compute", "dispatch_combine", "pipeline_wait", "optimizer"} <= set(last["timings"])
    assert all(a["routed_maxabs"] > 0 and a["resid_maxabs"] > 0 for a in last["activations"].values())


def test_distributed_matches_reference_in_float32(ray_cluster, reference_losses):
    """In float32 the summation order differs (EP all-reduce vs sequential accumulation) by ~1e-7; that holds
    until a near-tie top-k decision flips for some token, after which each flip moves the loss by ~1/tokens."""
    reports = run_distributed(tiny(**{"parallel.pp": 2, "parallel.ep": 2}), STEPS)
    got, want = [r["loss"] for r in reports], reference_losses(2, "float32", STEPS)
    assert_close(got[:5], want[:5], 1e-5)
    assert_close(got, want, 2e-3)


def test_moved_shard_then_moonep_switched_off_live_train_as_the_unfailed_run(ray_cluster, unfailed_ep4):
    """One job on pp=1 x ep=4 in float64, MoonEP on (as in the shared unfailed run):
    - experts moved to another rank after 3 steps (optimizer moments exist, so they must travel too): the model
      computes the same function, and the step after the move trains as the shared unfailed run, which never moves
      anything (its loss, and the parameters it updates with the moved moments; the bound of test_faults' re-homed
      experts);
    - a policy change applies at the next step: bad requests are refused and change nothing; switching MoonEP off
      is acknowledged for step 4, audited with its source, and step 4 runs plain EP (unequal rank loads);
    - MoonEP moves where experts are computed, never what: the 6 steps trained with it off have the unfailed run's
      losses, and with it on per-rank loads are equal."""
    with running_job(tiny(**{"parallel.ep": 4, "model.dtype": "float64"})) as controller:
        losses = [ray.get(controller.train_step.remote(s, s), timeout=300)["loss"] for s in range(3)]
        before = ray.get(controller.evaluate.remote(), timeout=300)
        placement = ray.get(controller.move_experts.remote([0, 1, 2], 1), timeout=300)
        assert placement["home"][:3] == [1, 1, 1]
        assert ray.get(controller.evaluate.remote(), timeout=300) == before
        losses.append(ray.get(controller.train_step.remote(3, 3), timeout=300)["loss"])
        params = job_params(controller)

        with pytest.raises(ray.exceptions.RayTaskError, match="slots_per_rank"):
            ray.get(controller.set_policy.remote("moonep", {"slots_per_rank": -1}))
        with pytest.raises(ray.exceptions.RayTaskError, match="unknown policy"):
            ray.get(controller.set_policy.remote("nope", {}))
        assert ray.get(controller.get_policies.remote("moonep"))["enabled"] is True  # bad requests changed nothing
        ack = ray.get(controller.set_policy.remote("moonep", {"enabled": False}, "test"))
        assert ack["applies_at_step"] == 4
        off = [ray.get(controller.train_step.remote(s, s), timeout=300) for s in range(4, 10)]
        assert any(max(v) - min(v) > 1 for v in off[0]["rank_load"].values())  # plain EP: unequal ranks
        audit = ray.get(controller.audit_log.remote())
        assert audit[-1]["policy"] == "moonep" and audit[-1]["applied"] and audit[-1]["source"] == "test"
    assert_close(losses, unfailed_ep4.losses[:4], 1e-12)
    want = unfailed_ep4.params[4]
    assert params.keys() == want.keys()
    diff = max(float((params[k] - want[k]).abs().max()) for k in want)
    assert diff <= 1e-12, f"parameters after 4 steps differ from the unfailed run's by {diff:.2e}"
    assert_close([r["loss"] for r in off], unfailed_ep4.losses[4:10], 1e-9)
    assert tiny().policies.moonep.enabled
    for layer, loads in unfailed_ep4.reports[5]["rank_load"].items():
        assert max(loads) - min(loads) <= 1, f"layer {layer}: MoonEP rank loads {loads}"
    assert any(max(v) - min(v) > 1 for v in off[-1]["rank_load"].values())


def test_gpu_jobs_run_at_normal_priority(ray_cluster):
    """Ray starts actors at nice 15. A GPU job's controller (every step's critical path) and workers (their host
    thread feeds the GPU) get a runtime env that runs them at normal priority; a CPU job asks for none."""
    import os

    from k3ray.grid.held_resources import actor_runtime_env

    assert actor_runtime_env(tiny()) is None
    gpu_env = actor_runtime_env(tiny(**{"parallel.device": "cuda"}))
    assert ray.get(ray.remote(lambda: os.getpriority(os.PRIO_PROCESS, 0)).options(runtime_env=gpu_env).remote()) == 0


def test_more_workers_than_cluster_fails_fast(ray_cluster):
    from k3ray.grid.calls import TopologyError

    cfg = tiny(**{"parallel.pp": 4, "parallel.ep": 4})  # 16 workers on an 8-CPU cluster
    with pytest.raises(TopologyError, match="needs 16 CPU"):
        start_controller(cfg)


def test_periodic_rebalance_rehomes_experts_without_changing_training(ray_cluster, unfailed_ep4):
    """The replication policy re-homes experts every N steps from the load history (shards move with their
    optimizer moments): home loads get more even, losses stay those of a run that never moves anything."""
    base = {"parallel.ep": 4, "model.dtype": "float64"}
    moving = tiny(**base, **{"policies.replication.enabled": True, "policies.replication.every_n_steps": 3})
    with running_job(moving) as controller:
        reports = [ray.get(controller.train_step.remote(s), timeout=300) for s in range(7)]
        incidents = ray.get(controller.get_incidents.remote())
        home = ray.get(controller.placement.remote())["home"]
    assert [i["kind"] for i in incidents].count("rebalance") >= 1
    assert sorted(home) == sorted(e * 4 // 16 for e in range(16))  # still 4 experts per rank
    # the load history the last rebalance (after step 5) planned from, as the controller keeps it
    decay = moving.policies.replication.history_decay
    history = None
    for r in reports[:6]:
        now = sum(torch.tensor(rows, dtype=torch.float64).sum(0) for rows in r["tokens_per_expert"].values())
        history = now if history is None else decay * history + (1 - decay) * now

    def heaviest_rank(homes: list[int]) -> float:
        return float(torch.zeros(4, dtype=torch.float64).index_add_(0, torch.tensor(homes), history).max())

    contiguous = [e * 4 // 16 for e in range(16)]
    assert heaviest_rank(home) < heaviest_rank(contiguous)  # home loads got more even
    assert_close([r["loss"] for r in reports], unfailed_ep4.losses[:7], 1e-9)  # a run that never moves anything


def test_priced_moonep_trains_as_the_reference(ray_cluster, reference_losses):
    """MoonEP priced by its cost model, with figures that make one copy of this tiny expert worth about 100 rows: it
    moves some rows but stops short of exact balance, and the losses are still the reference's."""
    priced = {"parallel.ep": 4, "model.dtype": "float64", "policies.moonep.cost_model": True,
              "policies.moonep.nvlink_gb_per_s": 10_000.0}
    reports = run_distributed(tiny(**priced), 6)
    assert_close([r["loss"] for r in reports], reference_losses(4, "float64", STEPS)[:6], 1e-8)
    home = torch.arange(16) * 4 // 16
    moved, unbalanced = False, False
    for r in reports:
        for layer, loads in r["rank_load"].items():
            home_loads = torch.zeros(4, dtype=torch.int64).index_add_(
                0, home, torch.tensor(r["tokens_per_expert"][layer]).sum(0)).tolist()
            assert sum(loads) == sum(home_loads)
            moved |= loads != home_loads
            unbalanced |= max(loads) - min(loads) > 1
    assert moved and unbalanced
