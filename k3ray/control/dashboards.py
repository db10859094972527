"""Grafana dashboards generated from code: overview, experts, reliability, serving, plus provisioning YAML for the
Prometheus datasource and the dashboards. `export(dir)` writes them (`k3ray dashboards export DIR`); the committed
copies live in `dashboards/`. Every query uses the `ray_`-prefixed names Ray exports for k3ray.control.metrics.SPECS and the
`$job` variable (label k3ray_job)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

DATASOURCE_UID = "prometheus"
SEL = 'k3ray_job=~"$job"'


def q(metric: str, extra: str = "") -> str:
    """`ray_<metric>{k3ray_job=~"$job"<extra>}`."""
    return f"ray_{metric}{{{SEL}{extra}}}"


def panel(title: str, exprs: list[tuple[str, str]], unit: str = "short", kind: str = "timeseries",
          w: int = 12, h: int = 8, **extra) -> dict:
    """A panel with one target per (PromQL, legend)."""
    return {"type": kind, "title": title, "gridPos": {"w": w, "h": h},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + i), "expr": e, "legendFormat": legend,
                         **({"format": "heatmap"} if kind == "heatmap" else {})}
                        for i, (e, legend) in enumerate(exprs)], **extra}


def _layout(panels: list[dict]) -> list[dict]:
    x = y = row_h = 0
    for i, p in enumerate(panels):
        g = p["gridPos"]
        if x + g["w"] > 24:
            x, y, row_h = 0, y + row_h, 0
        g.update(x=x, y=y)
        p["id"] = i + 1
        x, row_h = x + g["w"], max(row_h, g["h"])
    return panels


def _variables(ds_uid: str, with_layer: bool) -> dict:
    ds = {"type": "datasource", "name": "datasource", "query": "prometheus",
          "current": {"text": "Prometheus", "value": ds_uid}}
    job = {"type": "query", "name": "job", "label": "job", "includeAll": True, "multi": True, "refresh": 2,
           "datasource": {"type": "prometheus", "uid": "${datasource}"},
           "query": {"query": "label_values(ray_k3ray_step, k3ray_job)", "refId": "job"},
           "definition": "label_values(ray_k3ray_step, k3ray_job)", "current": {"text": "All", "value": "$__all"}}
    layer = {**job, "name": "layer", "label": "layer",
             "query": {"query": 'label_values(ray_k3ray_maxvio_ratio{k3ray_job=~"$job"}, layer)', "refId": "layer"},
             "definition": 'label_values(ray_k3ray_maxvio_ratio{k3ray_job=~"$job"}, layer)'}
    return {"list": [ds, job] + ([layer] if with_layer else [])}


def dashboard(uid: str, title: str, panels: list[dict], ds_uid: str, with_layer: bool = False) -> dict:
    return {"uid": uid, "title": title, "tags": ["k3ray"], "timezone": "browser", "schemaVersion": 39,
            "refresh": "10s", "time": {"from": "now-30m", "to": "now"}, "editable": True,
            "templating": _variables(ds_uid, with_layer), "panels": _layout(panels)}


def overview(ds_uid: str = DATASOURCE_UID) -> dict:
    return dashboard("k3ray-overview", "k3ray / overview", [
        panel("Loss", [(q("k3ray_loss"), "{{k3ray_job}}")]),
        panel("Tokens per second", [(q("k3ray_tokens_per_second"), "{{k3ray_job}}"),
                                    (f"rate(ray_k3ray_tokens_total{{{SEL}}}[$__rate_interval])", "{{k3ray_job}} avg")],
              unit="short"),
        panel("Step time by phase", [(q("k3ray_step_phase_seconds", ',phase!="step"'), "{{phase}}")], unit="s"),
        panel("Step time p50 / p99", [
            (f"histogram_quantile({p}, sum by (le) (rate(ray_k3ray_step_seconds_bucket{{{SEL}}}[$__rate_interval])))",
             f"p{int(p * 100)}") for p in (0.5, 0.99)], unit="s"),
        panel("Gradient norm", [(q("k3ray_grad_norm"), "{{k3ray_job}}")], w=8),
        panel("Learning rate", [(q("k3ray_learning_rate"), "{{k3ray_job}}")], w=8),
        panel("Step", [(q("k3ray_step"), "{{k3ray_job}}")], kind="stat", w=8),
        panel("Policy changes", [(f"sum by (policy) (increase(ray_k3ray_policy_changes_total{{{SEL}}}[5m]))",
                                  "{{policy}}")], w=12),
        panel("MoonEP replica slots per rank", [(q("k3ray_replica_slots"), "{{k3ray_job}}")], w=12),
    ], ds_uid)


def experts(ds_uid: str = DATASOURCE_UID) -> dict:
    layer = ',layer=~"$layer"'
    return dashboard("k3ray-experts", "k3ray / experts", [
        panel("Routed tokens per EP rank", [(q("k3ray_routed_tokens", layer), "L{{layer}} r{{rank}}")]),
        panel("Rank load max / mean", [(f"{q('k3ray_rank_load_max_tokens', layer)} / "
                                        f"{q('k3ray_rank_load_mean_tokens', layer)}", "L{{layer}}")]),
        panel("MaxVio per layer", [(q("k3ray_maxvio_ratio", layer), "L{{layer}}")]),
        panel("MaxVio by layer (heatmap over time)", [(q("k3ray_maxvio_ratio", layer), "{{layer}}")],
              kind="status-history"),
        panel("Expert load / mean, layer $layer", [
            (f"sum by (le) (increase(ray_k3ray_expert_load_ratio_bucket{{{SEL}{layer}}}[$__rate_interval]))",
             "{{le}}")], kind="heatmap", w=24, repeat="layer", repeatDirection="h",
              options={"calculate": False, "yAxis": {"unit": "short"}, "cellGap": 1}),
        panel("Routed activation max |x|", [(q("k3ray_activation_maxabs", layer), "L{{layer}}")]),
        panel("Residual max |x|", [(q("k3ray_residual_maxabs", layer), "L{{layer}}")]),
    ], ds_uid, with_layer=True)


def reliability(ds_uid: str = DATASOURCE_UID) -> dict:
    def rate_of(metric: str, by: str = "") -> str:
        group = f"sum by ({by}) " if by else "sum "
        return f"{group}(increase(ray_{metric}{{{SEL}}}[5m]))"

    return dashboard("k3ray-reliability", "k3ray / reliability", [
        panel("Incidents by rule (5m)", [(rate_of("k3ray_incidents_total", "rule"), "{{rule}}")]),
        panel("Rollbacks (5m)", [(rate_of("k3ray_rollbacks_total"), "rollbacks")], w=6),
        panel("Recoveries (5m)", [(rate_of("k3ray_recoveries_total"), "recoveries")], w=6),
        panel("Mean recovery time", [(f"{rate_of('k3ray_recovery_seconds_total')} / "
                                      f"{rate_of('k3ray_recoveries_total')}", "seconds")], unit="s", w=8),
        panel("Mean snapshot time", [(f"{rate_of('k3ray_snapshot_seconds_total')} / "
                                      f"{rate_of('k3ray_snapshots_total')}", "seconds")], unit="s", w=8),
        panel("Mean checkpoint time", [(f"{rate_of('k3ray_checkpoint_seconds_total')} / "
                                        f"{rate_of('k3ray_checkpoints_total')}", "seconds")], unit="s", w=8),
        panel("Job state", [(q("k3ray_job_state") + " == 1", "{{state}}")], kind="state-timeline", w=24),
    ], ds_uid)


def serving(ds_uid: str = DATASOURCE_UID) -> dict:
    """`k3ray serve`: latency, load, cache use, per-expert served load (k3ray.serve.metrics)."""
    def quantiles(metric: str) -> list[tuple[str, str]]:
        return [(f"histogram_quantile({p}, sum by (le) (rate(ray_{metric}_bucket{{{SEL}}}[$__rate_interval])))",
                 f"p{int(p * 100)}") for p in (0.5, 0.99)]

    return dashboard("k3ray-serving", "k3ray / serving", [
        panel("Time to first token p50 / p99", quantiles("k3ray_serve_ttft_seconds"), unit="s"),
        panel("Inter-token latency p50 / p99", quantiles("k3ray_serve_inter_token_seconds"), unit="s"),
        panel("Output tokens per second", [
            (f"rate(ray_k3ray_serve_output_tokens_total{{{SEL}}}[$__rate_interval])", "{{k3ray_job}}")]),
        panel("Requests running / waiting", [(q("k3ray_serve_requests"), "{{state}}")]),
        panel("Queue depth", [(q("k3ray_serve_queue_depth"), "waiting")], w=8),
        panel("KV pages used", [(q("k3ray_serve_kv_pages_used"), "used"), (q("k3ray_serve_kv_pages_total"), "total")],
              w=8),
        panel("Finished requests by reason (5m)", [
            (f"sum by (finish) (increase(ray_k3ray_serve_requests_total{{{SEL}}}[5m]))", "{{finish}}")], w=8),
        panel("Prefix cache hit rate (prompt tokens)", [(q("k3ray_serve_prefix_cache_hit_ratio"), "hit rate")],
              unit="percentunit"),
        panel("Prefix cache held", [(q("k3ray_serve_prefix_cache_bytes"), "bytes")], unit="bytes"),
        panel("Iteration time p50 / p99", quantiles("k3ray_serve_iteration_seconds"), unit="s"),
        panel("Served expert load / mean", [
            (f"sum by (le) (increase(ray_k3ray_serve_expert_load_ratio_bucket{{{SEL}}}[$__rate_interval]))",
             "{{le}}")], kind="heatmap", options={"calculate": False, "cellGap": 1}),
        panel("Served tokens per expert", [(q("k3ray_serve_expert_tokens"), "e{{expert}}")], kind="bargauge",
              options={"displayMode": "basic", "orientation": "vertical"}),
        panel("Replica map: EP ranks holding each expert", [(q("k3ray_serve_expert_holders"), "e{{expert}}")],
              kind="bargauge", options={"displayMode": "basic", "orientation": "vertical"}),
        panel("Balancedness (mean / max rank load)", [(q("k3ray_serve_balancedness_ratio"), "{{placement}}")],
              unit="percentunit", w=24),
    ], ds_uid)


def all_dashboards(ds_uid: str = DATASOURCE_UID) -> dict[str, dict]:
    """The training job's dashboards (their queries are checked against a training job's Prometheus)."""
    return {d["uid"]: d for d in (overview(ds_uid), experts(ds_uid), reliability(ds_uid))}


def provisioning(ds_uid: str = DATASOURCE_UID, prometheus_url: str = "http://localhost:9090",
                 dashboards_path: str = "/var/lib/grafana/dashboards/k3ray") -> dict[str, dict]:
    datasource = {"apiVersion": 1, "datasources": [{"name": "Prometheus", "type": "prometheus", "uid": ds_uid,
                                                   "access": "proxy", "url": prometheus_url, "isDefault": True,
                                                   "jsonData": {"timeInterval": "1s"}}]}
    provider = {"apiVersion": 1, "providers": [{"name": "k3ray", "folder": "k3ray", "type": "file",
                                               "disableDeletion": False, "updateIntervalSeconds": 30,
                                               "options": {"path": dashboards_path}}]}
    return {"provisioning/datasources/k3ray.yaml": datasource, "provisioning/dashboards/k3ray.yaml": provider}


def panel_queries(dash: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel."""
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def export(out: Path, ds_uid: str = DATASOURCE_UID) -> list[Path]:
    """Write <out>/<uid>.json for each dashboard and the provisioning YAML; returns the paths written."""
    written = []
    for uid, dash in {**all_dashboards(ds_uid), "k3ray-serving": serving(ds_uid)}.items():
        path = out / f"{uid}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dash, indent=2) + "\n")
        written.append(path)
    for rel, doc in provisioning(ds_uid).items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# generated by `k3ray dashboards export`; edit k3ray/dashboards.py instead\n"
                        + yaml.safe_dump(doc, sort_keys=False))
        written.append(path)
    return written
