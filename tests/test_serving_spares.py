"""Serving with a hot spare under kills in rounds (the engine on pp=2 x ep=2 with one spare, float64, the shared
serving checkpoint): every round costs seconds, not the collective timeout, and every request still ends with
exactly the tokens of an undisturbed run.

The second round's kill leaves a survivor waiting: rank 0 hangs in its forward, so its EP peer (rank 1) waits in the
all-to-all and stage 1 of EP rank 1 (rank 3) waits for rank 1's hidden state; rank 0 is then killed. Rank 1 fails at
once (its peer's connection closed), but rank 3 waits on rank 1, which is alive: a gloo wait ends only at
parallel.collective_timeout_s, and the serving graph cannot be torn down, nor a new one run on rank 3, before it
returns. The engine makes the survivors leave the lost grid's process groups, which shuts their connections
down: the wait ends at once. Where the replacement spare is not up yet in the second round, the grid is
rebuilt in place around its surviving column (no process started), its other survivor standing by as a spare.

The engine serves a copy of the shared checkpoint whose collective timeout is COLLECTIVE_TIMEOUT_S, far above what a
round costs even on a loaded 2-core host (a round of 45 s was seen there: Ray took 20 s to report the kill and the
spare's process groups 15 s): a round that waits the timeout out is then told apart by its gap whatever the load."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import ray

from conftest import serving_engine
from k3ray.data import encode
from k3ray.serve.drills import Stream

PROMPTS = ["def ", "import sys\n", "class A:\n    def f(self", "x", "for k, v in d.items():\n", "return "]
PARAMS = [{"max_tokens": 40 + 2 * i, "temperature": 0.0 if i % 2 else 0.8, "seed": 30 + i} for i in range(len(PROMPTS))]
SERVE = {"page_size": 4, "pages_per_rank": 128, "slots_per_rank": 6, "token_budget": 16, "max_waiting": 16,
         "max_tokens": 64}
COLLECTIVE_TIMEOUT_S = 300.0  # parallel.collective_timeout_s of the checkpoint served here


def with_collective_timeout(checkpoint: str, dest: Path, timeout_s: float) -> str:
    """A copy of `checkpoint` (its parts hard-linked) whose config has parallel.collective_timeout_s = timeout_s."""
    shutil.copytree(checkpoint, dest, copy_function=os.link)
    for manifest in dest.glob("step_*/manifest.json"):
        doc = json.loads(manifest.read_text())
        doc["meta"]["config"]["parallel"]["collective_timeout_s"] = timeout_s
        manifest.unlink()  # a hard link to the shared checkpoint's: written anew, not through
        manifest.write_text(json.dumps(doc))
    return str(dest)


class Clients:
    """Clients sending the requests of PROMPTS and PARAMS back to back, each request a Stream, until `stop`."""

    def __init__(self, engine, n: int):
        self.engine, self.done, self.running = engine, [], True
        self.threads = [threading.Thread(target=self._client, args=(c,), daemon=True) for c in range(n)]
        for t in self.threads:
            t.start()

    def _client(self, c: int) -> None:
        k = c
        while self.running:
            i = k % len(PROMPTS)
            stream = Stream(self.engine, encode(PROMPTS[i]), PARAMS[i])
            self.done.append((i, stream))
            stream.run()
            k += 1

    def stop(self) -> None:
        self.running = False
        for t in self.threads:
            t.join(timeout=300)

    def token_times(self) -> list[float]:
        return sorted(at for _, s in list(self.done) for at, item in list(s.items) if item.get("tokens"))

    def longest_gap(self, t_from: float, t_to: float) -> float:
        """A round's serving gap: the longest time without a token from the last one before `t_from` (the round's
        fault) to the first one after `t_to` (serving again), also when tokens still came right after the fault
        from iterations already under way (inf if none came yet)."""
        times = self.token_times()
        before, after = [a for a in times if a <= t_from], [a for a in times if a > t_to]
        if not before or not after:
            return float("inf")
        window = [a for a in times if before[-1] <= a <= after[0]]
        return max(b - a for a, b in zip(window, window[1:]))

    def wait_for_tokens(self, timeout_s: float = 120.0) -> None:
        """Until some request gets a token after now (serving)."""
        t, until = time.perf_counter(), time.time() + timeout_s
        while time.time() < until and not [a for a in self.token_times() if a > t]:
            time.sleep(0.02)


def wait_for_recovery(engine, losses: int, timeout_s: float = COLLECTIVE_TIMEOUT_S + 120.0) -> None:
    """Until the engine's first `losses` lost-worker incidents are over (each one's gap to the next token known), so
    that the next round's fault reaches the recovered grid, not the one still being given up."""
    until = time.time() + timeout_s
    while time.time() < until:
        over = [i for i in ray.get(engine.incident_log.remote())
                if i["kind"] == "worker_lost" and "to_next_token" in i.get("seconds", {})]
        if len(over) >= losses:
            return
        time.sleep(0.25)


def test_kills_in_rounds_with_a_spare_complete_every_request_as_undisturbed_in_seconds(serving_checkpoint,
                                                                                       visible_reference, tmp_path):
    """Every request ends with its undisturbed tokens, the first round is a spare's swap, and no round waits out the
    collective timeout (the bound, half of it, leaves room for a loaded host; the benchmark serve_kill_rounds.py measures
    the gaps themselves)."""
    want = [visible_reference(p, kw) for p, kw in zip(PROMPTS, PARAMS)]
    checkpoint = with_collective_timeout(serving_checkpoint, tmp_path / "ckpt", COLLECTIVE_TIMEOUT_S)
    with serving_engine(checkpoint, 2, 2, SERVE, spares=1) as engine:
        clients = Clients(engine, 6)
        clients.wait_for_tokens()
        t_first = time.perf_counter()
        ray.get(engine.drill.remote("kill_worker", [2]))  # round 1: the spare takes rank 2's place
        wait_for_recovery(engine, 1)
        t_first_served = time.perf_counter()
        clients.wait_for_tokens()  # seen by the clients too: round 1's window ends before round 2's fault
        ray.get(engine.drill.remote("hang_collective", [0]))  # round 2: rank 0 hangs, its peers wait on it ...
        time.sleep(0.5)
        t_second = time.perf_counter()
        ray.get(engine.drill.remote("kill_worker", [0]))  # ... and dies: rank 3 still waits on rank 1
        wait_for_recovery(engine, 2)
        t_second_served = time.perf_counter()
        time.sleep(1.0)
        clients.stop()
        gaps = [clients.longest_gap(t_first, t_first_served), clients.longest_gap(t_second, t_second_served)]
        incidents = [i for i in ray.get(engine.incident_log.remote()) if i["kind"] == "worker_lost"]
        print(f"\nserving gaps per round: {[round(g, 2) for g in gaps]} s; "
              f"incidents: {[(i['ranks'], i['action'], i['seconds']) for i in incidents]}")
        for i, s in clients.done:
            assert not [item for _, item in s.items if "error" in item], f"request {PROMPTS[i]!r}"
            assert s.tokens() == want[i], f"request {PROMPTS[i]!r}, {PARAMS[i]}"
        assert [i["ranks"] for i in incidents] == [[2], [0]]
        assert incidents[0]["action"] == "replace"
        assert ray.get(engine.health.remote())["status"] == "ok"
    assert max(gaps) < COLLECTIVE_TIMEOUT_S / 2, f"serving gaps {gaps} s: a round waited out the collective timeout"
