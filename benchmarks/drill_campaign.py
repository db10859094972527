"""A drill campaign: N randomized fault drills on CPU, each one survived and exact or not, one JSON line each.

Training drills (k3ray.train.drills.plan, as tests/test_drills.py): pp=1 x ep=4 in float64, one worker, two at
once, two close together (the second during the recovery, during a grow-back, at the checkpoint commit) or a whole
node (a second raylet, every process of it SIGKILLed) lost during a step, a snapshot, a checkpoint commit, an
evaluation, a policy push or a grow-back; exact = every loss equals the unfailed run's at rel 1e-12.
Serving drills: the engine on pp=2 x ep=2 (float64, hot spares or not) under streaming requests loses a worker
during prefill or decode, or loses one, then one of the grid being launched to recover, then another once it serves
again; exact = every request ends, without an error, with the single-process reference's tokens; its health is
polled throughout (unavailable while no grid serves, ok at the end).

    python benchmarks/drill_campaign.py [--drills 110] [--master-seed 0] [--results FILE] [--resume FILE]
                                        [--seeds S,S,...] [--workdir DIR] [--serving 0.3] [--table]
                                        [--store-mb 80 --set model.expert_inner=512 ...]

--store-mb gives every raylet an object store of that size (Ray's least is 75 MB) and --set changes the training
drills' config (and their reference's): with a wider model the snapshots outgrow the store, so every drill runs with
snapshots held one at a time and spilled to disk.

ONE Ray cluster (a head of 8 CPUs on loopback, a second raylet joining for each node drill) for the whole campaign;
one unfailed training run and one serving checkpoint, cached in the workdir (reference.json) across resumes. The
seed list is printed; `--seeds S` reruns drills alone. Each drill's line: seed, family, kind, state, survived, exact,
seconds, incident summary, unexpected incidents (and the error). `--resume FILE` appends to FILE and skips the seeds
it holds (but reruns those named with --seeds). The kind x state table (run / survived / exact / clean: exact with
no incident but those the faults cause; a seed counts with its last run) ends the run; `--table` prints it alone.
Failed drills keep their checkpoint folder (incidents.jsonl) in the workdir. `touch WORKDIR/STOP` ends the campaign
after the drill under way (its cluster stopped), for a later --resume.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from k3ray.config import load_config, parse_assignments
from k3ray.control.driver import running_job
from k3ray.control.local_nodes import free_port, head_room, join_node, kill_node, start_raylet, stop_node
from k3ray.serve.drills import Stream, serving_reference
from k3ray.train.drills import DRILL_STEPS, drill_overrides, plan, run_drill
from k3ray.serve.engine import ServingEngine
from k3ray.data import EOS, encode
from k3ray.model.sampling import SamplingParams, visible_ids

PROMPTS = ["def ", "import sys\n", "class A:\n    def f(self", "x", "for k, v in d.items():\n", "return ",
           "if not path:\n    raise ValueError(", "@classmethod\n", "try:\n    pass\nexcept", "s = "]
SERVE = {"page_size": 4, "pages_per_rank": 128, "slots_per_rank": 8, "token_budget": 16, "max_waiting": 16,
         "max_tokens": 64}
OVERRIDES: dict = {}  # --set: the training drills' config changes
STORE: list[str] = []  # --store-mb: `ray start`'s arguments for every raylet
# what a drill's faults should cause; any other incident (a failed checkpoint write, a guard trip, a failed
# grow-back) is flagged in its line and counted in the table's "clean" column
EXPECTED_INCIDENTS = {"worker_lost", "checkpoint_abandoned", "grow_back", "rebalance"}
INCIDENT_KEYS = ("kind", "step", "ranks", "ep", "action", "attempts", "interrupted", "requeued", "spares_used",
                 "seconds", "why")


def serving_plan(seed: int) -> dict:
    """A serving drill: `serve_kill` (one worker under streaming load, during prefill or decode, with a hot spare or
    not) or `serve_kill_in_recovery` (one, then one of the grid being launched to recover, then another once it
    serves again); which ranks, and the requests."""
    rng = random.Random(seed)
    kind = rng.choice(("serve_kill", "serve_kill_in_recovery"))
    n = rng.randint(4, 8)
    prompts = rng.sample(range(len(PROMPTS)), n)
    params = [{"max_tokens": rng.randint(16, 36), "temperature": rng.choice((0.0, 0.8)), "seed": rng.randrange(1000)}
              for _ in range(n)]
    if kind == "serve_kill":
        spares = rng.choice((0, 1))
        state = rng.choice(("prefill", "decode")) + ("_spare" if spares else "")
        ranks = [rng.randrange(4)]
    else:
        spares, state = 0, "recovery_then_serving"
        ranks = [rng.randrange(4), rng.randrange(2), rng.randrange(2)]  # the recovered grid is pp=2 x ep=1
    return {"seed": seed, "family": "serving", "kind": kind, "state": state, "spares": spares, "ranks": ranks,
            "prompts": prompts, "params": params}


def campaign_plan(seed: int, serving_fraction: float) -> dict:
    if random.Random(seed ^ 0x5EED).random() < serving_fraction:
        return serving_plan(seed)
    return {"family": "training", **plan(seed)}


def summarize(incidents: list[dict]) -> list[dict]:
    return [{k: i[k] for k in INCIDENT_KEYS if i.get(k) not in (None, [], {})} for i in incidents]


def close(a: list[float], b: list[float], rel: float = 1e-12) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


# ---- references, cached in the workdir ----

def references(workdir: Path) -> dict:
    """The unfailed run's losses (DRILL_STEPS steps, the drills' config without faults) and a serving checkpoint
    (the tiny model trained 4 steps on pp=1 x ep=2 in float64), each made once."""
    path = workdir / "reference.json"
    ref = json.loads(path.read_text()) if path.exists() else {}
    if "losses" not in ref:
        t0 = time.perf_counter()
        cfg = load_config("configs/tiny.yaml", {**drill_overrides(str(workdir / "unfailed"), ()), **OVERRIDES})
        with running_job(cfg) as controller:
            ref["losses"], _ = run_drill(controller, None, DRILL_STEPS)
        print(f"unfailed run: {DRILL_STEPS} steps in {time.perf_counter() - t0:.0f}s", flush=True)
        path.write_text(json.dumps(ref))
    if "serving_checkpoint" not in ref:
        t0 = time.perf_counter()
        root = workdir / "serving_checkpoint"
        cfg = load_config("configs/tiny.yaml", {"train.eval_every": 0, "model.dtype": "float64", "parallel.pp": 1,
                                                "parallel.ep": 2, "checkpoint.dir": str(root),
                                                "checkpoint.every_n_steps": 3})
        with running_job(cfg) as controller:
            run_drill(controller, None, 4)
        ref["serving_checkpoint"] = str(root)
        print(f"serving checkpoint: {time.perf_counter() - t0:.0f}s", flush=True)
        path.write_text(json.dumps(ref))
    return ref


# ---- one drill ----

def join(address: str, tries: int = 3) -> str:
    """A second raylet joined to the cluster (its temp dir). `ray start` on this shared machine can fail on its own
    (a free port taken by another process before the raylet binds it): tried again with new ports, and each failure
    printed."""
    for attempt in range(1, tries + 1):
        node = tempfile.mkdtemp(prefix="k3ray-campaign-node-", dir="/tmp")
        try:
            join_node(node, address, 2, *STORE)
            return node
        except (RuntimeError, TimeoutError) as err:
            stop_node(node)
            print(f"    node join {attempt}/{tries} failed: {err}", flush=True)
            if attempt == tries:
                raise


def training_drill(drill: dict, ref: dict, workdir: Path, address: str) -> dict:
    ckpt = workdir / f"drill-{drill['seed']}"
    cfg = load_config("configs/tiny.yaml", {**drill_overrides(str(ckpt), drill["faults"]), **OVERRIDES,
                                            "fault_tolerance.incidents_file": str(ckpt / "incidents.jsonl")})
    node, at = None, {"begin": time.perf_counter()}
    try:
        if drill["kind"] == "node":  # 2 workers on the head, 2 on a node of their own
            node = join(address)
            at["node_joined"] = time.perf_counter()
            with head_room(2), running_job(cfg) as controller:
                at["job_started"] = time.perf_counter()
                losses, incidents = run_drill(controller, drill, drill["steps"], lambda: kill_node(node))
                at["steps_done"] = time.perf_counter()
        else:
            with running_job(cfg) as controller:
                at["job_started"] = time.perf_counter()
                losses, incidents = run_drill(controller, drill, drill["steps"])
                at["steps_done"] = time.perf_counter()
        at["job_stopped"] = time.perf_counter()
    finally:
        if node is not None:
            stop_node(node)
    lost = [i for i in incidents if i["kind"] == "worker_lost"]
    exact = close(losses, ref["losses"][:drill["steps"]])
    marks = list(at.items())
    out = {"survived": bool(lost), "exact": exact, "incidents": summarize(incidents),
           "phases": {name: round(t - marks[i - 1][1], 1) for i, (name, t) in enumerate(marks) if i},
           "step": drill["step"], "steps": drill["steps"], "faults": drill["faults"]}
    if not lost:
        out["error"] = "no worker_lost incident: the fault did not land"
    elif not exact:
        out["error"] = f"losses {losses} != unfailed {ref['losses'][:drill['steps']]}"
    if out["survived"] and exact:
        shutil.rmtree(ckpt, ignore_errors=True)
    return out


def serving_drill(drill: dict, ref: dict, reference) -> dict:
    prompts = [PROMPTS[p] for p in drill["prompts"]]
    want = []
    for p, kw in zip(prompts, drill["params"]):
        sp = SamplingParams(**kw)
        want.append(visible_ids(reference(encode(p), sp)[0], sp, EOS))
    engine = ServingEngine.options(num_cpus=0).remote(ref["serving_checkpoint"], 2, 2, SERVE,
                                                      spares=drill["spares"])
    health, stop = [], threading.Event()

    def watch() -> None:  # /health's answers while the drill runs (what the front door's /health maps to 503)
        while not stop.is_set():
            h = ray.get(engine.health.remote(), timeout=60)
            if not health or health[-1]["status"] != h["status"]:
                health.append({"status": h["status"], "reason": h.get("reason")})
            time.sleep(0.05)

    def wait_for(status: str, timeout: float = 120) -> bool:
        until = time.time() + timeout
        while time.time() < until:
            if ray.get(engine.health.remote(), timeout=60)["status"] == status:
                return True
            time.sleep(0.02)
        return False

    try:
        ray.get(engine.ready.remote(), timeout=300)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        streams = [Stream(engine, encode(p), kw) for p, kw in zip(prompts, drill["params"])]
        for s in streams:
            s.start()
        if drill["state"].startswith("decode") or drill["kind"] == "serve_kill_in_recovery":
            deadline = time.time() + 120
            while sum(len(s.tokens()) >= 2 for s in streams) < len(streams) // 2 and time.time() < deadline:
                time.sleep(0.05)
        ray.get(engine.drill.remote("kill_worker", drill["ranks"][:1]), timeout=120)
        notes = []
        if drill["kind"] == "serve_kill_in_recovery":
            if not wait_for("unavailable", 60):
                notes.append("the first recovery was over before the second kill")
            until = time.time() + 120  # the new grid (pp=2 x ep=1) has its workers starting: kill one
            while time.time() < until and not (ray.get(engine.stats.remote())["ep"] == 1 and ray.get(
                    engine.drill.remote("kill_worker", drill["ranks"][1:2]), timeout=120)):
                time.sleep(0.02)
            if ray.get(engine.health.remote())["status"] != "unavailable":
                notes.append("the second kill landed after the recovery")
            wait_for("ok")
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 60 and not all(s.items and "finish" in s.items[-1][1] for s in streams):
                now = time.perf_counter()
                if sum(len(s.tokens()) for s in streams) > sum(len(s.tokens(before=now - 1)) for s in streams):
                    break  # tokens flow again
                time.sleep(0.05)
            ray.get(engine.drill.remote("kill_worker", drill["ranks"][2:]), timeout=120)
        for s in streams:
            s.join(timeout=300)
        hung = sum(s.is_alive() for s in streams)
        errors = [item["message"] if "message" in item else str(item) for s in streams for _, item in s.items
                  if "error" in item]
        differ = sum(s.tokens() != w for s, w in zip(streams, want))
        final = ray.get(engine.health.remote(), timeout=60)
        stop.set()
        watcher.join(timeout=10)
        incidents = ray.get(engine.incident_log.remote(), timeout=60)
        lost = [i for i in incidents if i["kind"] == "worker_lost"]
        survived = not hung and not errors and final["status"] == "ok" and bool(lost)
        out = {"survived": survived, "exact": survived and not differ, "incidents": summarize(incidents),
               "health": health, "requests": len(streams)}
        problems = ([f"{hung} streams hung"] * bool(hung) + errors[:3] + [f"{differ} requests differ"] * bool(differ)
                    + [f"health at the end: {final}"] * (final["status"] != "ok")
                    + ["no worker_lost incident"] * (not lost))
        if problems:
            out["error"] = "; ".join(problems)
        if notes:
            out["notes"] = notes
        return out
    finally:
        stop.set()
        try:
            ray.get(engine.shutdown.remote(), timeout=120)
        except Exception:  # noqa: BLE001 - an engine that failed keeps no grid worth closing
            pass
        ray.kill(engine, no_restart=True)
        for pg_id, pg in ray.util.placement_group_table().items():  # an engine killed mid-recovery leaves its own
            if pg["state"] != "REMOVED":
                remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


# ---- the campaign ----

def table(results: list[dict]) -> str:
    """kind x state: drills run, survived, exact, and clean (exact with no unexpected incident)."""
    rows: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for r in results:
        unexpected = r.get("unexpected", sorted({i["kind"] for i in r["incidents"]} - EXPECTED_INCIDENTS))
        for i, ok in enumerate((True, r["survived"], r["exact"], r["exact"] and not unexpected)):
            rows[(r["kind"], r["state"])][i] += ok
    lines = [f"| {'kind':<24}| {'state':<22}| run | survived | exact | clean |",
             f"|{'-' * 25}|{'-' * 23}|-----|----------|-------|-------|"]
    for (kind, state), (n, s, e, c) in sorted(rows.items()):
        lines.append(f"| {kind:<24}| {state:<22}| {n:>3} | {s:>8} | {e:>5} | {c:>5} |")
    n, s, e, c = (sum(r[i] for r in rows.values()) for i in range(4))
    lines.append(f"| {'all':<24}| {'':<22}| {n:>3} | {s:>8} | {e:>5} | {c:>5} |")
    return "\n".join(lines)


def start_cluster(preload: bool) -> tuple[str, str]:
    """A head of 8 CPUs on loopback, this process connected; (its temp dir, GCS address)."""
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
            or (Path.home() / ".ray" / "auth_token").exists()):
        token = Path(tempfile.mkdtemp(prefix="k3ray-auth-")) / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
    if preload:  # the raylets start each worker process with these imported, pooled ones too: a drill's
        # replacement workers start in seconds instead of importing torch on a loaded machine
        os.environ["RAY_preload_python_modules"] = "torch,k3ray.grid.worker"
    port = free_port()
    head = tempfile.mkdtemp(prefix="k3ray-campaign-", dir="/tmp")
    start_raylet(head, "--head", "--port", str(port), "--num-cpus", "8", "--include-dashboard", "false", *STORE)
    address = f"127.0.0.1:{port}"
    ray.init(address=address, log_to_driver=False)
    return head, address


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drills", type=int, default=110)
    ap.add_argument("--master-seed", type=int, default=0, help="draws the campaign's seed list")
    ap.add_argument("--seeds", help="these drill seeds only (comma-separated), run again if done")
    ap.add_argument("--serving", type=float, default=0.3, help="share of serving drills")
    ap.add_argument("--results", default="runs/drill_campaign/results.jsonl")
    ap.add_argument("--resume", metavar="FILE", help="append to FILE, skipping the seeds it holds")
    ap.add_argument("--table", action="store_true", help="only print the results file's table")
    ap.add_argument("--no-preload", action="store_true", help="worker processes import torch when an actor starts")
    ap.add_argument("--workdir", default="runs/drill_campaign", help="references and failed drills' folders")
    ap.add_argument("--store-mb", type=int, help="every raylet's object store, MB (Ray's default otherwise)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="the training drills' config (and their reference's)")
    args = ap.parse_args()
    OVERRIDES.update(parse_assignments(args.set))
    STORE.extend(["--object-store-memory", str(args.store_mb << 20)] if args.store_mb else [])
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    results_path = Path(args.resume or args.results)
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    if args.seeds:
        seeds = [int(s) for s in args.seeds.split(",")]
    else:
        rng = random.Random(args.master_seed)
        seeds = [rng.randrange(2**31) for _ in range(args.drills)]
    print(f"seeds: {','.join(map(str, seeds))}", flush=True)
    done = set()  # seeds named with --seeds run again (a rerun after a fix), their new line appended
    if args.resume and results_path.exists() and not args.seeds:
        done = {json.loads(line)["seed"] for line in results_path.read_text().splitlines() if line.strip()}
        print(f"resuming {results_path}: {len(done)} drills done", flush=True)
    if args.table:
        return report(results_path)
    head, address = start_cluster(not args.no_preload)
    try:
        ref = references(workdir)
        reference = None
        for i, seed in enumerate(seeds):
            if seed in done:
                continue
            if (workdir / "STOP").exists():
                (workdir / "STOP").unlink()
                print("STOP file found: stopping before the next drill (--resume goes on)", flush=True)
                break
            drill = campaign_plan(seed, args.serving)
            print(f"[{i + 1}/{len(seeds)}] {time.strftime('%H:%M:%S')} {drill}", flush=True)
            t0 = time.perf_counter()
            try:
                if drill["family"] == "training":
                    out = training_drill(drill, ref, workdir, address)
                else:
                    reference = reference or serving_reference(ref["serving_checkpoint"])
                    out = serving_drill(drill, ref, reference)
            except Exception as e:  # noqa: BLE001 - a drill that raised did not survive; the campaign goes on
                out = {"survived": False, "exact": False, "incidents": [],
                       "error": f"{type(e).__name__}: {str(e)[:2000]}", "traceback": traceback.format_exc()[-3000:]}
            out["unexpected"] = sorted({i["kind"] for i in out["incidents"]} - EXPECTED_INCIDENTS)
            line = {"seed": seed, "family": drill["family"], "kind": drill["kind"], "state": drill["state"],
                    "survived": out.pop("survived"), "exact": out.pop("exact"),
                    "seconds": round(time.perf_counter() - t0, 1), **out}
            with results_path.open("a") as f:
                f.write(json.dumps(line) + "\n")
            print(f"    survived={line['survived']} exact={line['exact']} {line['seconds']}s "
                  f"{line.get('error', '')[:300]}", flush=True)
    finally:
        ray.shutdown()
        stop_node(head)
    report(results_path)


def report(results_path: Path) -> None:
    """The kind x state table of a results file (each seed's last run), and the reruns."""
    results = [json.loads(line) for line in results_path.read_text().splitlines() if line.strip()]
    last = {r["seed"]: r for r in results}  # a seed run again after a fix counts with its last run
    if len(last) < len(results):
        print(f"{len(results) - len(last)} reruns; failed first runs: "
              f"{[(r['seed'], r['kind'], r['state']) for r in results if not (r['survived'] and r['exact'])]}")
    print(table(list(last.values())))


if __name__ == "__main__":
    main()
