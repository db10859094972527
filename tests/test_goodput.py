"""The goodput simulator (k3ray.goodput): seeded determinism, losses that add up, Young/Daly against the
simulator's best interval, calibration from incidents, and `k3ray plan --faults` (table, JSON, SVG, bad input)."""
from __future__ import annotations

import json

import pytest

from k3ray.config import load_config
from k3ray.control.cli import main
from k3ray.goodput import calibration
from k3ray.goodput.costs import PhaseCosts, phase_costs
from k3ray.goodput.optimise import evaluate, young_daly
from k3ray.goodput.profiles import FailureClass, Profile, llama3, load_profile
from k3ray.goodput.simulate import PHASES, Policy, sample_faults, simulate

DAY = 86400.0


@pytest.fixture(scope="module")
def tiny():
    return load_config("configs/tiny.yaml")      # pp 2 x ep 2: replicas of 4 GPUs


def costs_by_hand(**fields) -> PhaseCosts:
    """A grid whose phases are all free unless given."""
    base = dict(gpus=1024, pp=1, columns=1024, gpus_per_node=8, step_s=1.0,
                detect_s=dict.fromkeys(("crash", "node", "hang", "guard", "planned"), 0.0), relaunch_s=0.0,
                swap_s=0.0, restore_s=0.0, checkpoint_load_s=0.0, checkpoint_write_s=0.0, grow_back_s=0.0, warmup_s=0.0, shrunk_share=1.0,
                grow_back_after_steps=1, snapshot_stage_s=0.0, snapshot_offload_s=0.0, checkpoint_stage_s=0.0)
    return PhaseCosts(**{**base, **fields})


def test_llama3_profile_is_the_published_table():
    profile = llama3()
    assert len(profile.classes) == 19
    per_54_days = [c.rate * 16384 * 54 * 24 for c in profile.classes]
    assert round(sum(per_54_days)) == 466
    assert round(sum(n for c, n in zip(profile.classes, per_54_days) if c.detection != "planned")) == 419
    hbm = next(n for c, n in zip(profile.classes, per_54_days) if c.name == "GPU HBM3 memory")
    assert hbm / 419 == pytest.approx(0.172, abs=0.001)
    assert profile.mtbf_hours(16384) == pytest.approx(54 * 24 / 466)


def test_the_same_seed_gives_the_same_run_and_another_seed_another(tiny):
    costs = phase_costs(tiny, 64, calibration.Calibration(step_s=2.0))
    profile = load_profile("mtbf:500+node-mtbf:2000+hang-mtbf:3000")
    policy = Policy(5, 100, 8)
    runs = [simulate(costs, profile, policy, sample_faults(profile, 64, 10 * DAY, seed), 10 * DAY)
            for seed in (3, 3, 4)]
    assert runs[0].to_json() == runs[1].to_json()
    assert runs[0].faults > 20 and runs[0].goodput != runs[2].goodput


@pytest.mark.parametrize("policy", [Policy(1, 0, 0), Policy(5, 100, 0), Policy(20, 500, 8), Policy(2, 50, 64)])
def test_losses_add_up_to_one_minus_goodput(tiny, policy):
    costs = phase_costs(tiny, 64, calibration.Calibration(step_s=2.0))
    profile = load_profile("llama3+mtbf:300")
    out = simulate(costs, profile, policy, sample_faults(profile, 64, 20 * DAY, 0), 20 * DAY)
    assert set(out.losses) == set(PHASES)
    assert out.goodput + sum(out.losses.values()) == pytest.approx(1.0, abs=1e-9)
    assert all(v >= 0 for v in out.losses.values()) and 0 < out.goodput < 1
    assert (out.losses["spares_idle"] > 0) == (policy.spares > 0)


def test_young_daly_agrees_with_the_simulators_best_snapshot_interval():
    """Blow-ups every 10,000 s on the grid roll back to the snapshot; a snapshot stalls 2 s; a step is 1 s: Young/Daly
    says sqrt(2 x 2 x 10,000) - 2 = 198 steps; the simulation's best of 50..800 must be 200."""
    costs = costs_by_hand(snapshot_stage_s=2.0)
    profile = Profile("blowups", (FailureClass("blow-up", 1 / (10000 / 3600 * 1024), "gpu", "guard", False),))
    assert young_daly(2.0, 10000.0, 1.0) == pytest.approx(198.0)
    candidates = [Policy(e, 0, 0) for e in (50, 100, 200, 400, 800)]
    outcomes = evaluate(costs, profile, candidates, 400 * DAY, seeds=[0, 1])
    best = max(outcomes, key=lambda o: o.goodput)
    assert best.policy.snapshot_every == 200
    loss = outcomes[2].losses["snapshot_stall"] + outcomes[2].losses["replay"]
    assert loss == pytest.approx(2.0 / 200 + 200 / 2 / 10000, rel=0.1)   # stall/tau + tau/(2M)


def test_spares_keep_the_grid_whole_and_without_them_it_runs_shrunk_until_grow_back():
    costs = costs_by_hand(columns=16, gpus=16, relaunch_s=10.0, swap_s=1.0)
    profile = Profile("gpus", (FailureClass("gpu", 1 / (10 * 16), "gpu", "crash", True),), repair_hours=1.0)
    faults = sample_faults(profile, 16, 30 * DAY, 0)
    shrunk = simulate(costs, profile, Policy(1, 0, 0), faults, 30 * DAY)
    spared = simulate(costs, profile, Policy(1, 0, 2), faults, 30 * DAY)
    # a fault every 10 h; ceil(16/15) = 2x steps for the hour until the GPU is back: half of that hour is lost
    assert shrunk.losses["shrunk"] == pytest.approx(0.05, rel=0.3) and shrunk.losses["swap"] == 0
    assert spared.losses["swap"] > 0 and spared.losses["shrunk"] < shrunk.losses["shrunk"] / 5


def test_a_run_of_fixed_length_ends_at_its_steps():
    costs = costs_by_hand(columns=4, gpus=4, relaunch_s=5.0, restore_s=1.0, grow_back_s=3.0)
    profile = Profile("w", (FailureClass("w", 30.0, "gpu", "crash", False),), gpus_per_node=1)
    out = simulate(costs, profile, Policy(3, 0, 0), sample_faults(profile, 4, 1000.0, 0), 1000.0, steps=30)
    assert out.steps == pytest.approx(30) and out.faults == len(out.fault_steps) > 0
    assert out.goodput == pytest.approx(30 * 1.0 / out.seconds)


def test_calibration_from_incidents(tmp_path):
    lines = [{"time": 1.0, "kind": "worker_lost", "rule": "worker_lost", "ep": [4, 3], "replayed_steps": [5, 7],
              "seconds": {"detection": 0.04, "find_snapshot": 0.0, "replan": 0.02, "place_and_start_workers": 4.0,
                          "process_groups": 0.4, "restore": 0.02, "launch_other": 0.01, "replay": 7.0}},
             {"time": 2.0, "kind": "grow_back", "ep": [3, 4], "seconds": 3.5}]
    path = tmp_path / "incidents.jsonl"
    path.write_text("".join(json.dumps(i) + "\n" for i in lines))
    calib, measured = calibration.from_incidents(calibration.read_incidents([str(path)]), pp=1,
                                                 state_bytes_per_worker=2e6, step_s=1.5)
    assert (calib.detect_crash_s, calib.start_workers_s, calib.process_groups_s) == (0.04, 4.0, 0.4)
    assert calib.process_groups_world == 3 and calib.step_s == 1.5
    assert calib.restore_gb_per_s == pytest.approx(2e6 / 1e9 / 0.02)
    assert measured["grow_back_s"] == 3.5 and calib.grow_back_start_s == pytest.approx(3.5 - 0.4 - 0.02)
    assert calib.shrunk_share == pytest.approx((7.0 / 2 / 1.5 - 1) / (2 - 1))  # 2 steps replayed, ceil(4/3) = 2
    assert calib.warmup_s == pytest.approx(0.0, abs=1e-5)  # no replay on a grid kept whole: the warm-up is in the share
    out = tmp_path / "calib.json"
    out.write_text(json.dumps({**calib.to_json(), "measured": measured}))
    assert calibration.load(str(out)) == calib
    (tmp_path / "bad.json").write_text(json.dumps({"restore_gbps": 3}))
    with pytest.raises(ValueError, match="unknown fields"):
        calibration.load(str(tmp_path / "bad.json"))


def test_plan_faults_table_json_and_svg(capsys, tmp_path):
    args = ["plan", "--config", "configs/tiny.yaml", "--faults", "mtbf:2000+node-mtbf:20000", "--gpus", "16,64",
            "--days", "3", "--set", "fault_tolerance.spares=0"]
    assert main(args + ["--svg", str(tmp_path / "g.svg")]) == 0
    table = capsys.readouterr().out
    rows = [line.split() for line in table.splitlines() if line.lstrip()[:2] in ("16", "64")]
    assert [r[1] for r in rows] == ["given", "best", "0", "given", "best", "0"]
    for r in rows:
        goodput, losses = float(r[3 if r[1] != "0" else 4]), [float(x) for x in r[4 if r[1] != "0" else 5:][:11]]
        assert goodput + sum(losses) == pytest.approx(100.0, abs=0.05)
    assert "Young/Daly" in table and "formulas" in table and "process groups(G)" in table
    assert (tmp_path / "g.svg").read_text().startswith("<svg") and "polyline" in (tmp_path / "g.svg").read_text()
    assert main(args + ["--json", "--spares", "4", "--snapshot-every", "2", "--checkpoint-every", "10"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [g["gpus"] for g in result["grids"]] == [16, 64]
    given = result["grids"][0]["given"]
    assert given["policy"] == {"snapshot_every": 2, "checkpoint_every": 10, "spares": 4}
    assert given["goodput"] + sum(given["losses"].values()) == pytest.approx(1.0)
    assert result["grids"][1]["best"]["young_daly_snapshot_every"] > 0
    assert main(args[:4] + ["mtbf:2000", "--gpus", "16", "--days", "1", "--json"]) == 0   # no fault goes to a checkpoint
    assert json.loads(capsys.readouterr().out)["grids"][0]["best"]["young_daly_checkpoint_every"] is None


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "abc"], "--gpus 'abc': expected GPU counts"),
    (["--gpus", "6"], "--gpus 6: not a multiple of the config's pp x ep"),
    (["--faults", "weibull:3"], "--faults weibull:3: neither a profile"),
    (["--faults", "mtbf:-1"], "--faults mtbf:-1: hours must be positive"),
    (["--days", "0"], "--days 0: must be more than 0"),
    (["--spares", "-1"], "--spares -1: must be 0 or more"),
    (["--snapshot-every", "x"], "--snapshot-every 'x': not an integer"),
    (["--calibration", "/nonexistent.json"], "--calibration /nonexistent.json:"),
])
def test_plan_faults_bad_input_is_one_line_and_exit_2(capsys, flags, message):
    if flags[0] == "--gpus":  # the goodput flags need --faults
        assert main(["plan", "--config", "configs/tiny.yaml"] + flags) == 2
        assert "go with --faults" in capsys.readouterr().err
    args = ["plan", "--config", "configs/tiny.yaml", "--faults", "mtbf:1000", "--gpus", "4", "--days", "1"]
    assert main(args + flags) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err


def test_a_profile_file_with_a_bad_class_is_named(tmp_path):
    path = tmp_path / "rates.yaml"
    path.write_text("classes:\n  - {name: gpu, mtbf_hours: 1000, scope: rack}\n")
    with pytest.raises(ValueError, match=r"classes\[0\]: scope must be one of"):
        load_profile(str(path))
    path.write_text("repair_hours: 2\nclasses:\n  - {name: gpu, mtbf_hours: 1000}\n"
                    "  - {name: switch, rate_per_gpu_hour: 1.0e-5, scope: node, detection: hang}\n")
    profile = load_profile(str(path))
    assert profile.repair_hours == 2 and profile.classes[1].scope == "node" and profile.classes[0].rate == 1e-3
