"""One Ray cluster per test session: a real `ray start --head` on loopback, with the dashboard (Jobs API) and the
metrics export port, so Jobs and Prometheus tests talk to the same cluster as the runtime tests.

Every test that starts or uses Ray carries the `ray` marker: those whose fixtures include `ray_cluster` (every
Ray fixture here depends on it), marked at collection. `pytest -m "not ray"` runs the rest, with no Ray started; a
test that starts Ray without the marker fails."""
from __future__ import annotations

import contextlib
import os
import secrets
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from k3ray.control.local_nodes import free_ports, join_node, start_raylet, stop_node, wait_until_dead

# Ray >= 2.5x turns token auth on for clusters started with `ray start`; clients then need token mode, and Ray
# reads it when it is imported: set it before any test module imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# `ray start` in token mode needs a token; only a local `ray.init()` creates one (~/.ray/auth_token). On a fresh
# machine give the session's cluster, its clients and every subprocess a token of their own.
if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
        or (Path.home() / ".ray" / "auth_token").exists()):
    _token = Path(tempfile.mkdtemp(prefix="k3ray-auth-")) / "auth_token"
    _token.write_text(secrets.token_hex(32))
    _token.chmod(0o600)
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(_token)
# Without a GPU the Triton kernels run under Triton's interpreter; @triton.jit reads this when a kernel is defined,
# so it must be set before any test module imports k3ray.kernels (and so triton).
if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]

# configs/tiny.yaml with every feature of the released K3 on, at tiny size (`load_config(tiny, RELEASED)`): q-LoRA
# MLA without RoPE (a 4-wide unrotated slice), MLA layers listed, a dense first layer, KDA's short convolution,
# lower-bound gate and scaled read, Block AttnRes over blocks of 2 layers (with pp=2 the second stage receives a block
# summary), RMSNorm eps 1e-5, and each micro-batch routed with the bias from its own scores.
RELEASED = {"model.q_lora_rank": 24, "model.mla_rope_dim": 4, "model.mla_rope": False, "model.mla_layers": [1, 3],
            "model.first_dense_layers": 1, "model.dense_inner": 96, "model.kda_conv_size": 4,
            "model.kda_gate_lower_bound": -5.0, "model.kda_scaled_read": True, "model.attn_res_block_size": 2,
            "model.norm_eps": 1e-5, "model.quantile_bias_from": "micro_batch"}

# The fault, drill, node, runtime and checkpoint tests (and the serving tests' checkpoint) train on 2 sequences per
# micro-batch, not tiny.yaml's 8: their claims (exact trajectories, recoveries) hold at any batch size, at a quarter
# of the compute.
SMALL_BATCH = {"data.micro_batch_size": 2}


RAY_FIXTURES = {"ray_cluster"}  # the fixtures that start Ray: every other Ray fixture depends on one of them
# The files that take minutes, longest first (a 2-core host, 2026-12-07: ~630, 250, 150, 150, 100, 95 s): with a
# test file to a process (`--dist loadfile`, collection order) they start first, so the two processes end together
# rather than one running a long file alone at the end.
LONGEST_FILES = ("test_faults.py", "test_runtime.py", "test_serving_faults.py", "test_checkpointing.py",
                 "test_serving_placement.py", "test_nodes.py")


def pytest_collection_modifyitems(config, items):
    """The `ray` marker on every test whose fixtures (with those they depend on) start Ray; LONGEST_FILES first."""
    for item in items:
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)
    first = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.path.name, len(LONGEST_FILES)))  # stable: files stay whole


@pytest.fixture(autouse=True)
def _ray_only_where_marked(request):
    """A test without the `ray` marker that leaves Ray started (in this process) fails: `-m "not ray"` must start
    none."""
    was = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    yield
    if not was and request.node.get_closest_marker("ray") is None and "ray" in sys.modules \
            and sys.modules["ray"].is_initialized():
        pytest.fail(f"{request.node.nodeid} started Ray without the `ray` marker: use the ray_cluster fixture")


@dataclass
class RayCluster:
    address: str  # GCS address, for ray.init / RAY_ADDRESS
    dashboard_url: str  # Jobs API
    metrics_port: int  # Prometheus scrape target on 127.0.0.1
    session_dir: str


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    gcs, dash, metrics = free_ports(3)
    temp_dir = tempfile.mkdtemp(prefix="k3ray-ray-", dir="/tmp")  # ours alone: teardown stops only this cluster
    start_raylet(temp_dir, "--head", "--port", str(gcs), "--num-cpus", "8", "--include-dashboard", "true",
                 "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash), "--metrics-export-port", str(metrics))
    address = f"127.0.0.1:{gcs}"
    ray.init(address=address, log_to_driver=False)
    session_dir = ray._private.worker._global_node.get_session_dir_path()
    try:
        yield RayCluster(address, f"http://127.0.0.1:{dash}", metrics, session_dir)
    finally:
        ray.shutdown()
        stop_node(temp_dir)


@dataclass
class Run:
    """What a job did: every step's report, its incidents and final status, and every parameter by name (expert
    rows by expert id) after the steps asked for."""
    reports: list[dict]
    incidents: list[dict]
    status: dict
    params: dict[int, dict]  # steps done -> {name: tensor}

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.reports]


def run_job(cfg, steps: int, params_after: tuple[int, ...] = (), timeout_s: float = 600) -> Run:
    """Start the job's controller, run steps 0..steps-1 (batch index = step), gather the parameters after the step
    counts in params_after, stop the job."""
    import ray

    from k3ray.control.driver import running_job

    with running_job(cfg) as controller:
        reports, params = [], {}
        for s in range(steps):
            reports.append(ray.get(controller.train_step.remote(s), timeout=timeout_s))
            if s + 1 in params_after:
                params[s + 1] = job_params(controller)
        return Run(reports, ray.get(controller.get_incidents.remote()), ray.get(controller.status.remote()), params)


def job_params(controller) -> dict:
    """Every parameter of the job by name (expert rows by expert id), gathered from the live workers."""
    import ray

    def worker_states(ctrl) -> list[dict]:
        with ctrl.grid_lock:  # not mid-step nor mid-recovery
            return ctrl.grid.group.call("state")

    out = {}
    for state in ray.get(controller.__ray_call__.remote(worker_states), timeout=120):
        out.update(state["dense"])
        for layer, payload in state["experts"].items():
            for row, e in enumerate(payload["expert_ids"]):
                out[f"{layer}.expert{e}.w1"] = payload["w1"][row]
                out[f"{layer}.expert{e}.w2"] = payload["w2"][row]
    return out


UNFAILED_STEPS = 12  # the warmup's 10 steps and 2 of the cosine decay


@pytest.fixture(scope="session")
def unfailed_ep4(ray_cluster, tmp_path_factory) -> Run:
    """An unfailed run of the tiny model in float64 on pp=1 x ep=4 (MoonEP on, no evaluation, train.steps=12,
    SMALL_BATCH): UNFAILED_STEPS steps, parameters after 4 and 10. Run once per session; the float64 runtime test
    checks it against the single-process reference, and the fault, drill and node tests must reproduce its trajectory
    (snapshot, checkpoint, timeout, guard-warmup and grow-back settings do not change it; train.steps does only
    after the 10 warmup steps)."""
    from k3ray.config import load_config

    cfg = load_config("configs/tiny.yaml", {"parallel.pp": 1, "parallel.ep": 4, "train.eval_every": 0,
                                            "train.steps": UNFAILED_STEPS, "model.dtype": "float64",
                                            "checkpoint.at_end": False,
                                            "checkpoint.dir": str(tmp_path_factory.mktemp("unfailed")), **SMALL_BATCH})
    return run_job(cfg, UNFAILED_STEPS, params_after=(4, 10))


@pytest.fixture
def extra_nodes(ray_cluster):
    """Raylets joining the session's cluster on this machine (`join(num_cpus, *ray_start_args)` -> the node's temp
    dir; lose one with k3ray.control.local_nodes). Teardown stops only these nodes' processes and waits until Ray
    reports them dead."""
    dirs: list[str] = []
    ids: list[str] = []

    def join(num_cpus: int = 2, *args: str) -> str:
        temp_dir = tempfile.mkdtemp(prefix="k3ray-node-", dir="/tmp")
        dirs.append(temp_dir)
        ids.append(join_node(temp_dir, ray_cluster.address, num_cpus, *args))
        return temp_dir

    try:
        yield join
    finally:
        for d in dirs:
            stop_node(d)
        wait_until_dead(ids)  # the next test's actors are never placed on a node that is gone


@pytest.fixture(scope="session")
def serving_checkpoint(ray_cluster, tmp_path_factory) -> str:
    """A durable checkpoint of the tiny model in float64, trained 4 steps on pp=1 x ep=2 (serving tests load it onto
    other grids)."""
    from k3ray.config import load_config

    root = tmp_path_factory.mktemp("serve") / "ckpt"
    cfg = load_config("configs/tiny.yaml", {"train.eval_every": 0, "model.dtype": "float64", "parallel.pp": 1,
                                            "parallel.ep": 2, "checkpoint.dir": str(root),
                                            "checkpoint.every_n_steps": 3, **SMALL_BATCH})
    run_job(cfg, 4)
    return str(root)


@pytest.fixture(scope="session")
def serving_reference(serving_checkpoint):
    """The single-process reference generation from `serving_checkpoint`: (prompt ids, SamplingParams) ->
    (generated ids, finish reason)."""
    from k3ray.serve.drills import serving_reference as reference

    return reference(serving_checkpoint)


@pytest.fixture(scope="session")
def visible_reference(serving_reference):
    """(prompt text, sampling parameters as a request's dict) -> the reference's token ids as a stream shows them."""
    from k3ray.data import EOS, encode
    from k3ray.model.sampling import SamplingParams, visible_ids

    def visible(prompt: str, params: dict) -> list[int]:
        sp = SamplingParams(**params)
        return visible_ids(serving_reference(encode(prompt), sp)[0], sp, EOS)

    return visible


@contextlib.contextmanager
def serving_engine(checkpoint: str, pp: int, ep: int, serve: dict, spares: int = 0, standbys: bool | str = "auto"):
    """A ServingEngine actor serving `checkpoint` on a pp x ep grid (`serve`: serve.* overrides) with `spares` hot
    spares (and `standbys`: fault_tolerance.standbys), ready; shut down and killed afterwards."""
    import ray

    from k3ray.serve.engine import ServingEngine

    engine = ServingEngine.options(num_cpus=0).remote(checkpoint, pp, ep, serve, spares=spares, standbys=standbys)
    ray.get(engine.ready.remote(), timeout=300)
    try:
        yield engine
    finally:
        ray.get(engine.shutdown.remote(), timeout=120)
        ray.kill(engine, no_restart=True)


@pytest.fixture
def one_thread():
    """One intra-op thread: on a small shared machine two threads oversubscribe the cores and run ~5x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
