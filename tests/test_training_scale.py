"""`k3ray scale --ep N` for training jobs: the control API and the CLI queue a resize for the next step boundary and
refuse a bad size in one line naming the field; scaling a float64 job 4 -> 2 -> 4 mid-run (down as after a loss, the
workers left out standing by; up as a grow-back into those workers; the global batch kept) leaves the losses of the
unscaled run."""
from __future__ import annotations

import pytest

from k3ray.config import load_config
from conftest import SMALL_BATCH


def test_scale_requests_are_validated_and_queued_through_the_api_and_cli(tmp_path, capsys):
    from k3ray.control.api import ApiServer, build_app
    from k3ray.control.cli import main
    from k3ray.train.controller import Controller

    cfg = load_config("configs/tiny.yaml", {"parallel.pp": 1, "parallel.ep": 4,
                                            "checkpoint.dir": str(tmp_path / "ckpt")})
    ctrl = Controller(cfg)
    with pytest.raises(ValueError, match=r"^ep: must be a whole number from 1 to parallel.ep=4"):
        ctrl.request_scale(5)
    server = ApiServer(build_app(ctrl, "secret"), "127.0.0.1", 0)
    server.start()
    try:
        (tmp_path / "token").write_text("secret")
        cli = ["scale", "--url", server.url, "--token-file", str(tmp_path / "token"), "--ep"]
        for bad in ("0", "5"):
            assert main(cli + [bad]) == 2
            err = capsys.readouterr().err.strip()
            assert err.count("\n") == 0 and "ep: must be a whole number from 1 to parallel.ep=4" in err, err
        assert ctrl.scaling.asked is None  # nothing queued by a refused request
        assert main(cli + ["2"]) == 0
        assert capsys.readouterr().out.strip() == "ep 4 -> 2 at step 0"
        assert ctrl.scaling.asked == 2
    finally:
        server.stop()


def test_scaling_a_training_job_down_and_up_mid_run_leaves_the_losses(ray_cluster, unfailed_ep4, tmp_path):
    import ray

    from k3ray.control.driver import running_job

    cfg = load_config("configs/tiny.yaml", {"parallel.pp": 1, "parallel.ep": 4, "train.eval_every": 0,
                                            "train.steps": 12, "model.dtype": "float64", "checkpoint.at_end": False,
                                            "checkpoint.dir": str(tmp_path / "ckpt"), **SMALL_BATCH})
    steps, losses = 4, []
    with running_job(cfg) as controller:
        for s in range(steps):
            if s in (1, 3):
                ray.get(controller.request_scale.remote(2 if s == 1 else 4))
            losses.append(ray.get(controller.train_step.remote(s), timeout=300)["loss"])
            if s == 1:  # the workers left out stand by, and fill the places when the grid grows again
                assert {k: ray.get(controller.status.remote())[k] for k in ("ep", "spares")} == {"ep": 2, "spares": 2}
        incidents = ray.get(controller.get_incidents.remote())
        status = ray.get(controller.status.remote())
    assert [(i["kind"], i["step"], i["ep"]) for i in incidents] == [("scaled", 1, [4, 2]), ("scaled", 3, [2, 4])]
    assert status["ep"] == 4 and status["spares"] == 0 and status["state"] == "running"
    assert losses == pytest.approx(unfailed_ep4.losses[:steps], rel=1e-12, abs=0)
