"""`k3ray status | placement | policy get/set | incidents | checkpoint | audit | dashboards export/push`: the control
API's client and these commands' handlers (the parser is k3ray.control.cli's). A job is found through
`runs/<job>/control.json` (written 0600 by the job: url, token_file) with `--job NAME` (default: the newest job under
--runs-dir), or given by `--url` plus `--token-file` / `K3RAY_TOKEN`. Tables for people, `--json` for scripts; an
HTTP error prints the API's message and exits 2 (4xx) or 1 (5xx)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import httpx

from k3ray.config import parse_assignments
from k3ray.control.dashboards import all_dashboards, export
from k3ray.steering.auth import API_KEY_ENV, read_api_key


class ControlError(RuntimeError):
    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def find_job(runs_dir: str, job: str | None) -> dict:
    """The control record of job `job` (or of the newest job) under `runs_dir`."""
    root = Path(runs_dir)
    if job:
        path = root / job / "control.json"
        if not path.exists():
            raise ControlError(f"{path} not found: is job {job!r} running from this directory? "
                               f"(or pass --url and --token-file)")
    else:
        found = sorted(root.glob("*/control.json"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise ControlError(f"no running job found under {root}/*/control.json; pass --job, --runs-dir or --url")
        path = found[-1]
    return json.loads(path.read_text())


class Client:
    def __init__(self, url: str, token: str, timeout_s: float = 10.0):
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)
        self.url = url

    @classmethod
    def from_args(cls, args) -> "Client":
        if args.url:
            url, token_file = args.url, args.token_file
        else:
            record = find_job(args.runs_dir, args.job)
            url, token_file = record["url"], args.token_file or record["token_file"]
        token = os.environ.get("K3RAY_TOKEN") if not token_file else None
        if token_file:
            try:
                token = Path(token_file).read_text().strip()
            except OSError as err:
                raise ControlError(f"cannot read token file {token_file}: {err.strerror}") from None
        if not token:
            raise ControlError("no token: pass --token-file or set K3RAY_TOKEN")
        return cls(url, token, args.timeout)

    def request(self, method: str, path: str, body: dict | None = None):
        try:
            r = self.http.request(method, path, json=body)
        except httpx.HTTPError as err:
            raise ControlError(f"cannot reach the control API at {self.url} ({err}); is the job running?") from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise ControlError(f"HTTP {r.status_code} from {method} {path}: {detail}",
                               code=2 if r.status_code < 500 else 1)
        return r.json()


def _table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _show(args, data, human) -> None:
    print(json.dumps(data) if args.json else human(data))


def _status_text(s: dict) -> str:
    topo = s["topology"]
    tps = "-" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:,.0f}"
    loss = "-" if s["loss"] is None else f"{s['loss']:.4f}"
    return "\n".join([f"job        {s['job']} ({s['state']})", f"step       {s['step']}", f"loss       {loss}",
                      f"tokens/s   {tps}", f"topology   pp={topo['pp']} ep={topo['ep']} workers={topo['workers']} "
                      f"device={topo['device']}", f"api        {s['api_url']}"])


def _placement_text(p: dict) -> str:
    loads = p.get("rank_load") or {}
    layers = sorted(loads, key=int)
    rows = [[r, " ".join(map(str, experts)), *(loads[l][int(r)] for l in layers)]
            for r, experts in p["experts_of_ep_rank"].items()]
    return _table(rows, ["rank", "experts", *(f"load L{l}" for l in layers)])


def _policies_text(pols: dict) -> str:
    return "\n".join(f"{name}: " + " ".join(f"{k}={v}" for k, v in fields.items()) for name, fields in pols.items())


def _events_text(events: list[dict]) -> str:
    if not events:
        return "(none)"
    keys = list(dict.fromkeys(k for e in events for k in e))
    return _table([[e.get(k, "") for k in keys] for e in events], keys)


def cmd_status(args) -> int:
    if getattr(args, "serve", None):
        _show(args, _serving_stats(args.serve, args.timeout, api_key_file=args.api_key_file), _serving_text)
        return 0
    _show(args, Client.from_args(args).request("GET", "/v1/status"), _status_text)
    return 0


def _serving_stats(url: str, timeout: float, path: str = "/v1/status", api_key_file: str | None = None,
                   method: str = "GET", body: dict | None = None):
    try:
        key = read_api_key(api_key_file)
    except ValueError as err:
        raise ControlError(str(err)) from None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, f"{url.rstrip('/')}{path}", timeout=timeout, headers=headers, json=body)
    except httpx.HTTPError as err:
        raise ControlError(f"{url}: cannot reach the serving endpoint ({type(err).__name__}); is `k3ray serve` "
                           f"up?") from None
    if r.status_code == 401:
        raise ControlError(f"{url}{path}: {'the API key was refused' if key else 'needs an API key'} (pass "
                           f"--api-key-file F or set {API_KEY_ENV})")
    if r.status_code in (400, 404, 409, 500):  # the engine's one line names what is wrong
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        raise ControlError(f"{url}{path}: {detail}")
    if r.status_code != 200:
        raise ControlError(f"{url}{path}: HTTP {r.status_code}: {r.text[:200]}")
    return r.json()


def _on_serve(args, path: str, method: str = "GET", body: dict | None = None):
    return _serving_stats(args.serve, args.timeout, path, args.api_key_file, method, body)


def _serving_text(s: dict) -> str:
    return "\n".join([f"model      {s['model']} (checkpoint step {s['step']})",
                      f"grid       pp={s['pp']} ep={s['ep']}",
                      f"requests   running={s['running']} waiting={s['waiting']}",
                      f"kv pages   {s['pages_used']}/{s['pages_total']}   state slots used {s['slots_used']}",
                      f"generated  {s['tokens_out']:,} tokens in {s['iterations']:,} iterations "
                      f"({s['tokens_out'] / max(s['uptime_s'], 1e-9):,.1f} tokens/s since start)"])


def cmd_placement(args) -> int:
    if getattr(args, "serve", None):
        _show(args, _on_serve(args, "/v1/placement"), _serving_placement_text)
        return 0
    _show(args, Client.from_args(args).request("GET", "/v1/placement"), _placement_text)
    return 0


def _serving_placement_text(p: dict) -> str:
    """Per-rank table (homes, copies, load under the copies and without), per-expert load, balancedness, moves."""
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    ranks = range(len(p["copies"]))
    home_only = None
    if p["expert_load"] is not None:
        home_only = [sum(l for l, h in zip(p["expert_load"], p["home"]) if h == r) for r in ranks]
    rows = [[r, " ".join(str(e) for e, h in enumerate(p["home"]) if h == r), " ".join(map(str, p["copies"][r])) or "-",
             "-" if p["rank_load"] is None else f"{p['rank_load'][r]:.1f}",
             "-" if home_only is None else f"{home_only[r]:.1f}"] for r in ranks]
    lines = [_table(rows, ["rank", "home experts", "copies", "load", "load (home only)"]), ""]
    if p["expert_load"] is not None:
        lines.append("expert load  " + " ".join(f"{e}:{l:.0f}" for e, l in enumerate(p["expert_load"])))
    lines.append(f"balancedness {fmt(p['balancedness'])} (home only {fmt(p['balancedness_home_only'])}; mean/max "
                 f"rank load) at iteration {p['iteration']}")
    if p["moving"] is not None:
        lines.append(f"moving       copies {p['moving']['copies']} (fetching {p['moving']['fetch']})")
    for m in p["moves"][-5:]:
        lines.append(f"move         {fmt(m['balancedness_before'])} -> {fmt(m['balancedness_after'])}, "
                     f"{m['bytes_moved']:,} bytes, {m['seconds_decision_to_switch']:.3f}s decision -> switch"
                     + (f", dropped on ranks {sorted(m['failed'])}" if m["failed"] else ""))
    return "\n".join(lines)


def cmd_policy_get(args) -> int:
    path = f"/v1/policies/{args.name}" if args.name else "/v1/policies"
    data = _on_serve(args, path) if getattr(args, "serve", None) else Client.from_args(args).request("GET", path)
    _show(args, data, (lambda d: _policies_text({args.name: d})) if args.name else _policies_text)
    return 0


def cmd_policy_set(args) -> int:
    values = parse_assignments(args.values, "enabled=false or slots_per_rank=2")
    path = f"/v1/policies/{args.name}"
    serving = bool(getattr(args, "serve", None))
    change = _on_serve(args, path, "PUT", values) if serving else Client.from_args(args).request("PUT", path, values)
    _show(args, change, lambda c: f"{c['policy']}: " + " ".join(f"{k}={v}" for k, v in c["value"].items())
          + f"  (applies at {'iteration' if serving else 'step'} {c['applies_at_step']})")
    return 0


def cmd_incidents(args) -> int:
    if getattr(args, "serve", None):
        _show(args, _serving_stats(args.serve, args.timeout, "/v1/incidents", args.api_key_file), _events_text)
        return 0
    _show(args, Client.from_args(args).request("GET", "/v1/incidents"), _events_text)
    return 0


def cmd_scale(args) -> int:
    """`k3ray scale --ep N`: resize a training job's grid at its next step boundary; with `--serve URL` a serving
    grid's (every request goes on; the request waits for the new grid)."""
    if not getattr(args, "serve", None):
        change = Client.from_args(args).request("POST", "/v1/scale", {"ep": args.ep})
        _show(args, change, lambda c: f"ep {c['ep'][0]} -> {c['ep'][1]} at step {c['applies_at_step']}")
        return 0
    args.timeout = max(args.timeout, 600.0)  # a new serving grid is launched before the answer
    change = _on_serve(args, "/v1/scale", "POST", {"ep": args.ep})
    _show(args, change, lambda c: f"ep {c['ep'][0]} -> {c['ep'][1]}" + (
        "" if c.get("action") == "none" else f" in {c['seconds']['total']:.2f}s, {c['requeued']} requests "
                                             f"prefilled again"))
    return 0


def cmd_audit(args) -> int:
    if getattr(args, "serve", None):
        _show(args, _on_serve(args, "/v1/audit"), _events_text)
        return 0
    _show(args, Client.from_args(args).request("GET", "/v1/audit"), _events_text)
    return 0


def cmd_checkpoint(args) -> int:
    _show(args, Client.from_args(args).request("POST", "/v1/checkpoints"), lambda d: json.dumps(d))
    return 0


def cmd_dashboards_export(args) -> int:
    paths = export(Path(args.dir))
    _show(args, [str(p) for p in paths], lambda ps: "\n".join(ps))
    return 0


def cmd_dashboards_push(args) -> int:
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(args.url, credential=args.token or os.environ.get("GRAFANA_TOKEN"))
    done = []
    for dash in all_dashboards(args.datasource_uid).values():
        res = api.dashboard.update_dashboard({"dashboard": dash, "overwrite": True, "folderUid": args.folder_uid})
        done.append({"uid": dash["uid"], "url": res.get("url")})
    _show(args, done, _events_text)
    return 0
