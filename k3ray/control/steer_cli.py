"""The commands that reach a running job: `submit` and `job` (Ray Jobs), and the control commands of its API or a
serving endpoint (status, placement, incidents, audit, checkpoint, scale, policy) and the dashboards."""
from __future__ import annotations

import argparse
import os

from k3ray.control import client, jobs
from k3ray.control.cli_args import positive_int


def _control_args(p: argparse.ArgumentParser) -> None:
    """How a control command finds its job's API."""
    p.add_argument("--job", help="job name (default: the newest job under --runs-dir)")
    p.add_argument("--runs-dir", default=os.environ.get("K3RAY_RUNS_DIR", "runs"), help="where jobs write control.json")
    p.add_argument("--url", help="control API URL (instead of --job)")
    p.add_argument("--token-file", help="file holding the bearer token (else K3RAY_TOKEN)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="JSON output for scripts")


def _serve_args(p: argparse.ArgumentParser, help_: str) -> None:
    p.add_argument("--serve", metavar="URL", help=help_)
    p.add_argument("--api-key-file", metavar="F", help="that endpoint's API key (else $K3RAY_API_KEY)")


def _ray_jobs_address(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("RAY_DASHBOARD_ADDRESS", "http://127.0.0.1:8265"),
                   help="Ray dashboard (Jobs API) address")


def add_parsers(sub) -> None:
    """The `submit`, `job`, control and `dashboards` commands."""
    s = sub.add_parser("submit", help="submit `k3ray train --config X` to a cluster as a Ray job; prints the job id")
    s.add_argument("--config", required=True, help="config to train")
    s.add_argument("--steps", type=positive_int)
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config field")
    s.add_argument("--working-dir", default=".")
    s.add_argument("--wait", action="store_true", help="follow the job until it ends, then print its logs")
    _ray_jobs_address(s)
    s.set_defaults(func=jobs.cmd_submit)

    j = sub.add_parser("job", help="a submitted Ray job: status, logs, stop")
    j.add_argument("action", choices=["status", "logs", "stop"])
    j.add_argument("job_id", help="submission id (printed by k3ray submit)")
    _ray_jobs_address(j)
    j.set_defaults(func=jobs.cmd_job)

    for name, func, help_ in [("status", client.cmd_status, "live job status: step, loss, tokens/s, topology, state"),
                              ("placement", client.cmd_placement, "expert placement and per-rank load"),
                              ("incidents", client.cmd_incidents, "the job's incident log"),
                              ("audit", client.cmd_audit, "every policy change: what, when, from where"),
                              ("checkpoint", client.cmd_checkpoint, "request a durable checkpoint now")]:
        cp = sub.add_parser(name, help=help_)
        _control_args(cp)
        cp.set_defaults(func=func)
        if name in ("status", "incidents", "placement", "audit"):
            _serve_args(cp, f"the {name} of a `k3ray serve` endpoint instead")

    sc = sub.add_parser("scale", help="resize a job's EP dimension: a training job at the next step boundary (the "
                                      "global batch kept), a serving job between two iterations (no request dropped)")
    sc.add_argument("--ep", type=int, required=True, help="the new EP size")
    _control_args(sc)
    _serve_args(sc, "a `k3ray serve` endpoint instead (the request then waits for the new grid)")
    sc.set_defaults(func=client.cmd_scale)

    _add_policy_parser(sub)
    _add_dashboards_parser(sub)


def _add_policy_parser(sub) -> None:
    pol = sub.add_parser("policy", help="read or change live policies (applied at the next step boundary)")
    psub = pol.add_subparsers(dest="policy_command", required=True)
    get = psub.add_parser("get", help="show all policies or one")
    get.add_argument("name", nargs="?")
    _control_args(get)
    _serve_args(get, "the policies of a `k3ray serve` endpoint instead")
    get.set_defaults(func=client.cmd_policy_get)
    put = psub.add_parser("set", help="change fields of one policy: k3ray policy set moonep enabled=false")
    put.add_argument("name")
    put.add_argument("values", nargs="+", metavar="KEY=VALUE", help="values are YAML: true, 2, 0.5, null")
    _control_args(put)
    _serve_args(put, "change a `k3ray serve` endpoint's policy instead (applied at its next iteration)")
    put.set_defaults(func=client.cmd_policy_set)


def _add_dashboards_parser(sub) -> None:
    dash = sub.add_parser("dashboards", help="Grafana dashboards generated from code")
    dsub = dash.add_subparsers(dest="dashboards_command", required=True)
    exp = dsub.add_parser("export", help="write dashboard JSON and provisioning YAML to DIR")
    exp.add_argument("dir")
    exp.add_argument("--json", action="store_true")
    exp.set_defaults(func=client.cmd_dashboards_export)
    push = dsub.add_parser("push", help="upload the dashboards to a Grafana server")
    push.add_argument("--url", required=True, help="Grafana URL, e.g. http://localhost:3000")
    push.add_argument("--token", help="Grafana service-account token (else GRAFANA_TOKEN)")
    push.add_argument("--datasource-uid", default="prometheus")
    push.add_argument("--folder-uid", default=None)
    push.add_argument("--json", action="store_true")
    push.set_defaults(func=client.cmd_dashboards_push)
