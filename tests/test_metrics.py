"""Metrics end to end: a real Prometheus scrapes the session Ray cluster (through Ray's service-discovery file) while
a tiny job trains, and every PromQL expression of every generated dashboard panel returns data."""
from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from k3ray.config import load_config
from k3ray.control.dashboards import all_dashboards, export, panel_queries
from k3ray.control.local_nodes import free_port
from k3ray.control.metrics import SPECS

REPO = Path(__file__).resolve().parents[1]
JOB = "metricstest"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


def test_metric_names_follow_prometheus_conventions():
    for name, (kind, _desc, tags) in SPECS.items():
        assert name.startswith("k3ray_") and name == name.lower()
        assert name.endswith("_total") == (kind == "counter"), name
        assert set(tags) <= {"layer", "rank", "phase", "rule", "policy", "state"}, name


def test_export_writes_dashboards_and_provisioning(tmp_path):
    paths = {p.relative_to(tmp_path).as_posix() for p in export(tmp_path)}
    assert {"k3ray-overview.json", "k3ray-experts.json", "k3ray-reliability.json",
            "provisioning/datasources/k3ray.yaml", "provisioning/dashboards/k3ray.yaml"} <= paths
    experts = json.loads((tmp_path / "k3ray-experts.json").read_text())
    assert any(p["type"] == "heatmap" and p.get("repeat") == "layer" for p in experts["panels"])
    ds = yaml.safe_load((tmp_path / "provisioning/datasources/k3ray.yaml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    # the committed copies are what the code generates
    for name in ("k3ray-overview.json", "k3ray-experts.json", "k3ray-reliability.json"):
        assert (REPO / "dashboards" / name).read_text() == (tmp_path / name).read_text(), \
            f"dashboards/{name} is stale: run `k3ray dashboards export dashboards`"


@pytest.fixture
def prometheus(ray_cluster, tmp_path):
    """Prometheus on 127.0.0.1 scraping every 1 s the targets of Ray's SD file (rewritten to 127.0.0.1)."""
    session = Path(ray_cluster.session_dir)  # Ray 2.60 writes it in the session dir; older ones under metrics/
    candidates = [session / "prom_metrics_service_discovery.json",
                  session / "metrics" / "prom_metrics_service_discovery.json"]
    deadline = time.monotonic() + 30
    while not any(p.exists() for p in candidates):
        assert time.monotonic() < deadline, f"none of {candidates} appeared"
        time.sleep(0.5)
    sd_src = next(p for p in candidates if p.exists())
    sd = tmp_path / "ray_targets.json"

    def rewrite() -> None:  # Ray adds targets as node agents come up: keep the copy current
        groups = json.loads(sd_src.read_text())
        for group in groups:
            group["targets"] = [f"127.0.0.1:{t.rsplit(':', 1)[1]}" for t in group["targets"]]
        tmp = sd.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(sd)

    rewrite()
    halt = threading.Event()

    def follow() -> None:
        while not halt.wait(1.0):
            rewrite()

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "ray", "file_sd_configs": [{"files": [str(sd)], "refresh_interval": "2s"}]}],
    }))
    port = free_port()
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        halt.set()
        follower.join(timeout=5)
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _instant(prom: str, expr: str) -> list:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def test_every_dashboard_query_returns_data(ray_cluster, prometheus):
    import ray
    from k3ray.control.driver import running_job

    cfg = load_config(REPO / "configs/tiny.yaml", {"name": JOB, "train.eval_every": 0, "api.enabled": False, "parallel.pp": 1, "parallel.ep": 1})
    with running_job(cfg) as controller:
        halt, steps, errors = threading.Event(), [0], []

        def train() -> None:
            try:
                while not halt.is_set():
                    ray.get(controller.train_step.remote(steps[0], steps[0]), timeout=120)
                    steps[0] += 1
            except Exception as err:
                errors.append(err)

        thread = threading.Thread(target=train, daemon=True)
        thread.start()
        queries = [(uid, title, expr.replace("$job", JOB).replace("$layer", ".*").replace("$__rate_interval", "30s"))
                   for uid, dash in all_dashboards().items() for title, expr in panel_queries(dash)]
        missing = queries
        try:
            deadline = time.monotonic() + 120  # Ray's exporter can take several seconds, Prometheus needs 2+ scrapes
            while missing and time.monotonic() < deadline:
                assert not errors, f"training failed: {errors[0]!r}"
                time.sleep(2)
                missing = [q for q in missing if not _instant(prometheus, q[2])]
            assert steps[0] > 0
            if missing:
                targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
                names = sorted({r["metric"]["__name__"] for r in _instant(prometheus, '{__name__=~"ray_k3ray.*"}')})
                pytest.fail("panels without data:\n" + "\n".join(f"{u} / {t}: {e}" for u, t, e in missing)
                            + f"\ntargets: {[(t['scrapeUrl'], t['health'], t['lastError']) for t in targets]}"
                            + f"\nk3ray series in Prometheus: {names}")
            maxvio = _instant(prometheus, f'ray_k3ray_maxvio_ratio{{k3ray_job="{JOB}"}}')
            layers = {r["metric"]["layer"] for r in maxvio}
            assert layers == {str(i) for i in range(cfg.model.n_layers)}
        finally:
            halt.set()
            thread.join(timeout=120)
