"""The serving iteration as a Ray Compiled Graph over a grid's workers (plain Python, owned by the ServingGrid).

Every worker (p, e) runs data-parallel rank e's plan each iteration, every few milliseconds; as actor calls that costs
two task submissions and thread hops per iteration (2-3 ms measured on an H200 machine), as a compiled graph the
plans go out and the answers come back over shared-memory channels (under 1 ms). The graph is compiled on a grid's
first iteration and belongs to that grid generation: a grid rebuilt around spares (a new generation) or launched
anew gets a new one. Failures keep the one meaning they have everywhere: a worker lost or hung is WorkerLost (the
graph, broken, is dropped with its grid; its teardown goes on in the background, so nothing waits on a dead worker),
an error raised inside live workers is WorkerError.
"""
from __future__ import annotations

import logging
import threading

import ray
from ray.dag import DAGContext, InputNode, MultiOutputNode
from ray.exceptions import RayError, RayTaskError

from k3ray.grid import calls
from k3ray.grid.calls import WorkerError, WorkerLost, cause_line
from k3ray.grid.worker_group import WorkerGroup

log = logging.getLogger("k3ray.serve")
MAX_IN_FLIGHT = 2  # iterations submitted before the first is collected (serve.overlap: the next one is scheduled and
# submitted while the workers run the one before)
TEARDOWN_S = 5.0  # how long a graph's teardown waits for a worker still inside a step (a lost peer's)
DROP_WAIT_S = 1.0  # how long dropping a graph waits for its teardown, which goes on in the background
TEARDOWN_THREAD = "k3ray-serving-graph-teardown"
LEAVE_S = 5.0  # how long a lost grid's survivors are given to leave its process groups
WATCH_S = 1.0  # how often a wait for an iteration's answers looks for dead workers


class ServingGraph:
    def __init__(self):
        self.compiled = None
        self.generation = -1

    def run(self, group: WorkerGroup, plans: dict, timeout_s: float) -> dict:
        """One iteration: rank e -> RankPlan in; rank e -> its stages' answers (StageOutput) in pipeline order."""
        return self.collect(group, self.submit(group, plans, timeout_s), timeout_s)

    def submit(self, group: WorkerGroup, plans: dict, timeout_s: float):
        """Start an iteration (up to MAX_IN_FLIGHT at once: serve.overlap); its answers come from `collect`, which
        must be called for every iteration, in the order submitted."""
        return self._guarded(group, timeout_s, lambda: self._execute(group, plans))

    def collect(self, group: WorkerGroup, ref, timeout_s: float) -> dict:
        """rank e -> its stages' answers (StageOutput) in pipeline order, of the iteration `ref` from `submit`."""
        out = self._guarded(group, timeout_s, lambda: self._watched(group, lambda: ray.get(ref, timeout=timeout_s)))
        return {e: out[e::group.ep] for e in range(group.ep)}

    def _execute(self, group: WorkerGroup, plans: dict):
        if self.compiled is None or self.generation != group.generation:  # a worker of a grid just rebuilt may
            self._compile(group)  # already be gone: compiling fails as a call would
        return self.compiled.execute(*[plans[e] for e in range(group.ep)])

    def _guarded(self, group: WorkerGroup, timeout_s: float, call):
        """call() with the failures of workers in their one meaning: WorkerLost, WorkerError."""
        try:
            return call()
        except RayTaskError as err:  # raised inside a worker: by a lost peer's broken collective, or its own
            if dead := group.dead_ranks():
                self._give_up(group, dead)
                raise WorkerLost(dead, f"{type(err.cause).__name__} in serve_step") from None
            raise WorkerError(f"serve_step failed: {cause_line(err)}") from None
        except (RayError, TimeoutError) as err:  # a worker died, or none answered in time: the graph is broken
            dead = group.dead_ranks()
            self._give_up(group, dead)
            raise WorkerLost(dead or set(range(group.size)), f"{type(err).__name__} in serve_step" if dead else
                             f"no answer to serve_step within {timeout_s:g}s (hung collective or silent node?)",
                             hung=not dead) from None

    def _watched(self, group: WorkerGroup, wait):
        """wait() while a watcher looks for dead workers every WATCH_S. A compiled graph reports a dead actor only
        once the loops of all the others have ended, and a survivor waiting on a live peer that gave the iteration
        up ends its loop only at parallel.collective_timeout_s; a dead worker found gives the grid up instead
        (`_give_up`: survivors leave its groups, the graph is torn down), which ends the wait at once."""
        done = threading.Event()

        def watch() -> None:
            while not done.wait(WATCH_S):
                if (dead := group.dead_ranks()) and not done.is_set():  # not once the answers came
                    self._give_up(group, dead)
                    return

        threading.Thread(target=watch, name="k3ray-serving-watch", daemon=True).start()
        try:
            return wait()
        finally:
            done.set()

    def _give_up(self, group: WorkerGroup, dead: set[int]) -> None:
        """The grid lost workers: its survivors leave its process groups, then the graph goes. A survivor may still
        wait inside the iteration on a live peer that gave it up (stage 1 for the hidden state of a stage 0 whose EP
        peer died): gloo ends that wait only at parallel.collective_timeout_s, and until then the graph cannot be
        torn down nor a new one run on that worker (Ray runs one graph loop per worker at a time). The peer leaving
        shuts its groups' connections down, which ends the wait at once (k3ray.parallel.grid_groups)."""
        left = [calls.send(w, group.generation, "leave_grid") for r, w in enumerate(group.workers) if r not in dead]
        if left:
            ray.wait(left, num_returns=len(left), timeout=LEAVE_S)  # a survivor that does not answer: lost later
        self.drop()

    def _compile(self, group: WorkerGroup) -> None:
        self.drop()
        with InputNode() as plans:
            dag = MultiOutputNode([w.serve_step.bind(group.generation, plans[r % group.ep])
                                   for r, w in enumerate(group.workers)])
        self.compiled = dag.experimental_compile(_max_inflight_executions=MAX_IN_FLIGHT)
        self.generation = group.generation

    def drop(self) -> None:
        """Tear the graph down in the background, waiting DROP_WAIT_S at most. Ray's teardown waits up to 30 s for
        each worker to take the cancel of its loop and TEARDOWN_S for the loop to end, and a dead worker is reported
        dead only once its process is gone (a process holding a GPU takes seconds to go): nothing waits for that. The
        cancels are sent at once, so a live worker's loop ends soon, and a graph compiled on it meanwhile starts
        once it has."""
        if self.compiled is None:
            return
        compiled, self.compiled = self.compiled, None
        DAGContext.get_current().teardown_timeout = TEARDOWN_S
        teardown = threading.Thread(target=_tear_down, args=(compiled,), name=TEARDOWN_THREAD, daemon=True)
        teardown.start()
        teardown.join(DROP_WAIT_S)


def _tear_down(compiled) -> None:
    try:
        compiled.teardown()
    except Exception:  # noqa: BLE001 - a graph over dead workers may not tear down cleanly: it is gone anyway
        log.debug("tearing the serving graph down failed", exc_info=True)


class _QuietTeardown(logging.Filter):
    """Ray's complaints while it tears a graph down, ours or one its monitor found broken (about dead workers:
    expected), are left out."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName not in (TEARDOWN_THREAD, "CompiledGraphMonitorThread")


logging.getLogger("ray.dag.compiled_dag_node").addFilter(_QuietTeardown())
