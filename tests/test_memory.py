"""The pre-flight device-memory estimate (k3ray.policies.memory): its static parts against the real tiny model and
optimizer, and the decision (fits / recompute / smaller micro-batches / refused) over fake device sizes."""
import pytest

from k3ray.config import ConfigError, load_config
from k3ray.control import preflight
from k3ray.control.cli import main
from k3ray.model.decoder import build_stage
from k3ray.optim import AdamW
from k3ray.policies import memory

RELEASED_TINY = {"model.q_lora_rank": 16, "model.mla_rope_dim": 8, "model.kda_conv_size": 4,
                 "model.kda_scaled_read": True, "model.attn_res_block_size": 2, "model.first_dense_layers": 1,
                 "model.dense_inner": 96, "model.dtype": "bfloat16"}


def _cfg(**overrides):
    return load_config("configs/tiny.yaml", {**RELEASED_TINY, **overrides})


@pytest.mark.parametrize("pp,ep,moments", [(1, 2, "float32"), (2, 4, "float32"), (1, 2, "bfloat16")])
def test_static_bytes_are_the_real_models_and_optimizers(pp, ep, moments):
    cfg = _cfg(**{"parallel.pp": pp, "parallel.ep": ep, "optimizer.moments_dtype": moments})
    state_bytes = 12 if moments == "float32" else 8  # the fp32 master and the two moments
    m = cfg.model
    local = m.n_experts // ep
    heaviest = 0
    for p in range(pp):
        layers = m.stage_layers(pp, p)
        stage = build_stage(m, layers, list(range(local)))
        params = dict(stage.named_parameters())
        opt = AdamW(cfg.optimizer)
        opt.init_state(params)
        param_bytes = sum(t.numel() * t.element_size() for t in params.values())
        buffer_bytes = sum(b.numel() * b.element_size() for b in stage.buffers())
        n, buffers = memory.stage_params(m, layers, local)
        assert n == sum(t.numel() for t in params.values())
        assert n * 2 + buffers * 4 == param_bytes + buffer_bytes
        state = [t for st in opt.state.values() for t in st.values()]
        assert state_bytes * n == sum(t.numel() * t.element_size() for t in state)
        heaviest = max(heaviest, param_bytes + buffer_bytes)
    est = memory.estimate(cfg)
    if pp == 1:
        assert (est.params, est.grads, est.master + est.moments) == (heaviest, param_bytes, state_bytes * n)


def test_recompute_and_more_ranks_need_less():
    cfg = _cfg(**{"parallel.pp": 1})
    base = memory.estimate(cfg)
    recompute = memory.estimate(memory.with_settings(cfg, {"execution.recompute": "attention_elementwise"}))
    split = memory.estimate(memory.with_settings(cfg, {"data.micro_batch_size": 4, "parallel.micro_batches": 4}))
    assert recompute.activations < base.activations and recompute.static == base.static
    assert split.activations < base.activations
    assert memory.estimate(memory.with_settings(cfg, {"parallel.ep": 4})).static < base.static


def test_decision_fits_recomputes_splits_or_refuses():
    cfg = _cfg(**{"parallel.pp": 1})
    peak = memory.estimate(cfg).peak
    fits = memory.decide(cfg, peak)
    assert fits.outcome == "fits" and fits.changes == {}

    recompute = {"execution.recompute": "attention_elementwise"}
    with_recompute = memory.estimate(memory.with_settings(cfg, recompute)).peak
    adjusted = memory.decide(cfg, with_recompute)
    assert (adjusted.outcome, adjusted.changes) == ("adjusted", recompute)
    assert "results unchanged" in memory.describe(adjusted)

    split = {**recompute, "data.micro_batch_size": 4, "parallel.micro_batches": 4}  # the same 8 x 2 sequences
    smaller = memory.decide(cfg, memory.estimate(memory.with_settings(cfg, split)).peak)
    assert (smaller.outcome, smaller.changes) == ("adjusted", split)
    assert preflight.checked(cfg, smaller.device_bytes).global_batch_sequences == cfg.global_batch_sequences

    # one sequence per micro-batch (nothing to split) and experts large enough that more EP ranks are what fits
    big = _cfg(**{"parallel.pp": 1, "model.expert_inner": 8192, "data.micro_batch_size": 1})
    smallest = memory.estimate(memory.with_settings(big, recompute)).peak
    ep4 = memory.estimate(memory.with_settings(big, {"parallel.ep": 4, "parallel.micro_batches": 1})).peak
    assert ep4 < smallest
    refused = memory.decide(big, ep4)
    assert refused.outcome == "refused"
    # the fewest workers first, one suggestion per kind of grid; ep=4 keeps the global batch in 1 micro-batch
    assert list(refused.fitting_grids)[0] == "parallel.ep=4 parallel.micro_batches=1"
    assert all(e.peak <= ep4 for e in refused.fitting_grids.values())
    with pytest.raises(ConfigError, match=r"tiny: device memory: needs .* fits with parallel\.ep=4 "):
        preflight.checked(big, ep4)


def test_a_setting_that_fits_is_filled_with_fewer_larger_micro_batches():
    cfg = _cfg(**{"parallel.pp": 1, "data.micro_batch_size": 2, "parallel.micro_batches": 4})
    shapes = {m: memory.estimate(memory.with_settings(cfg, {"data.micro_batch_size": 8 // m,
                                                            "parallel.micro_batches": m})).peak for m in (1, 2, 4)}
    assert shapes[1] > shapes[2] > shapes[4]
    # room for 2 micro-batches of 4 but not for 1 of 8: the fewest that fit
    filled = memory.decide(cfg, shapes[2])
    assert (filled.outcome, filled.changes) == ("filled", {"data.micro_batch_size": 4, "parallel.micro_batches": 2})
    assert "2 micro-batch(es) of 4 sequences" in memory.describe(filled)
    run = preflight.checked(cfg, shapes[2])
    assert (run.data.micro_batch_size, run.parallel.micro_batches) == (4, 2)
    assert run.global_batch_sequences == cfg.global_batch_sequences
    assert memory.decide(cfg, shapes[1]).changes == {"data.micro_batch_size": 8, "parallel.micro_batches": 1}
    assert memory.decide(cfg, shapes[4]).outcome == "fits"  # no room for larger ones: as configured
    # switched off, or pipeline stages (fewer micro-batches widen the bubble): the configured shape
    off = memory.with_settings(cfg, {"execution.fill_memory": False})
    assert memory.decide(off, shapes[1]).outcome == "fits"
    staged = memory.with_settings(cfg, {"parallel.pp": 2})
    assert memory.decide(staged, 10 * shapes[1]).outcome == "fits"


def test_no_device_size_no_check():
    cfg = _cfg()
    assert preflight.device_bytes(cfg) is None  # CPU, no execution.device_memory_gib
    assert preflight.checked(cfg, None) is cfg


def test_plan_prints_the_estimate_and_decision(capsys):
    assert main(["plan", "--config", "configs/tiny.yaml", "--memory", "--set", "execution.device_memory_gib=0.001"]) == 0
    out = capsys.readouterr().out
    assert "activations" in out and "device memory: needs" in out
