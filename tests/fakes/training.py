"""The training controller's fakes, without Ray: `Cluster` (capacity, batches that blow up, losses to inject, calls
seen) and the `FakeGroup`s it makes, which play the WorkerGroup interface over in-memory workers whose "model" is the
tuple of batches trained on; and the helpers that drive a Controller on them (`config`, `run`, `states`,
`clean_run`, `resume`)."""
from __future__ import annotations

import math
import tempfile

import torch

from k3ray.config import load_config
from k3ray.grid.calls import ObjectsLost, TopologyError, WorkerLost
from k3ray.grid.standbys import Standbys
from k3ray.io import checkpoint as ckpt
from k3ray.io.checkpoint import part_name
from k3ray.train.controller import Controller


class Cluster:
    """What the fake groups share: capacity in workers, batches that blow up, losses to inject, calls seen."""

    def __init__(self, capacity: int = 8, nan_batches=(), lose: dict[int, int] | None = None,
                 die_in: dict[str, tuple[int, set[int]]] | None = None):
        self.capacity, self.nan_batches = capacity, set(nan_batches)
        self.lose = dict(lose or {})  # step -> world rank (or set of ranks) that dies during it (once)
        self.die_in = dict(die_in or {})  # method -> (its n-th call, counted from 1; world ranks that die in it)
        self.seen: dict[str, int] = {}  # method -> calls so far
        self.phantom = 0  # workers' worth of a lost node Ray still reports alive (until a placement fails)
        self.others = 0  # workers' worth held by others (another job): counted in totals, never placeable
        self.spares_dead = False  # every standby spare has died (its node lost)
        self.die_every: dict[str, set[int]] = {}  # method -> world ranks that die in every call of it
        self.place_fails = 0  # placements (launch, grow) that fail although the resources looked free
        self.lost_node_ranks: set[int] = set()  # world ranks on a node that is lost (or silent), not just dead
        self.step_gate = None  # a threading.Event a step waits on (forced interleavings with API calls)
        self.warmed_after: list[tuple] = []  # the batches trained each time the object stores were warmed
        self.snapshot_steps: list[int] = []  # the boundaries snapshots were taken at
        self.snapshots_lost = 0  # restores from a snapshot that find its parts lost with a node
        self.calls: list[tuple] = []
        self.announced: list[tuple] = []  # (step, batch, the next batch announced to run ahead) of every step run
        self.groups: list[FakeGroup] = []

    def group(self, cfg, ep: int, home: list[int], avoid_nodes: frozenset[str] = frozenset()) -> "FakeGroup":
        g = FakeGroup(self, cfg, ep, home)
        self.groups.append(g)
        return g


class FakeGroup:
    """The WorkerGroup interface over in-memory workers that all hold the same state: the batches trained on. Hot
    spares are counted, holding capacity like workers."""

    def __init__(self, cluster: Cluster, cfg, ep: int, home: list[int]):
        self.cluster, self.cfg, self.pp, self.ep, self.home = cluster, cfg, cfg.parallel.pp, ep, list(home)
        self.trained: tuple[int, ...] = ()
        self.launch_seconds: dict[str, float] = {}
        self.alive = False
        self.spares: list[str] = []
        self.standbys = Standbys()  # none (the standbys' path is tested on Ray: tests/test_faults.py)
        self.alive_nodes = self.transfer = self.resources = self  # the group's parts: this fake plays them itself

    @property
    def size(self) -> int:
        return self.pp * self.ep

    @property
    def held(self) -> int:
        return self.size + len(self.spares) if self.alive else 0

    def fits(self, extra_cluster_free: bool = False) -> tuple[bool, str]:
        used = sum(g.held for g in self.cluster.groups) if extra_cluster_free else 0
        return self.size + used <= self.cluster.capacity, "too small"

    def _die(self, method: str) -> None:
        """Workers die in this call when the test asked for it (once)."""
        n = self.cluster.seen[method] = self.cluster.seen.get(method, 0) + 1
        nth, ranks = self.cluster.die_in.get(method, (0, set()))
        if n == nth:
            raise WorkerLost(set(ranks), f"ActorDiedError in {method}")
        if method in self.cluster.die_every:
            raise WorkerLost(set(self.cluster.die_every[method]), f"ActorDiedError in {method}")

    def room_for(self, n: int) -> bool:
        return sum(g.held for g in self.cluster.groups) + self.cluster.others + n <= self.cluster.capacity

    def grow(self, ep: int, home: list[int], restore: dict, timeout_s: float) -> None:
        """In place: ready spares fill the added places first, the rest are placed; a placement that fails leaves
        the grid as it was."""
        added = self.pp * (ep - self.ep)
        from_spares = min(added, self.spares_ready())
        if self.cluster.place_fails:
            self.cluster.place_fails -= 1
            raise TopologyError("placement timed out")
        if not self.room_for(added - from_spares):
            raise TopologyError(f"could not place {added - from_spares} more workers")
        self.spares = self.spares[from_spares:]
        self.cluster.calls.append(("grow", self.ep, ep))
        self.parts = []  # every worker takes its place in the grown grid: the parts it was writing are forgotten
        self.ep, self.home = ep, list(home)
        self.launch_seconds = {"place_and_start_workers": 0.0}
        self.restore(restore)

    def places_held(self) -> int:
        return self.spares_ready()

    @property
    def nodes(self) -> list[str]:  # a node per world rank
        return [f"node{r}" for r in range(self.size)]

    def avoid(self, nodes: set[str]) -> None:
        pass  # every node of the fake cluster is placed on

    def healthy(self) -> set[str]:
        return {f"node{r}" for r in range(self.size) if r not in self.cluster.lost_node_ranks}

    def capacity(self, free: bool = False) -> int:
        held = sum(g.held for g in self.cluster.groups) + (self.cluster.others if free else 0)
        return self.cluster.capacity + self.cluster.phantom - held

    def launch(self, timeout_s: float, restore: dict | None = None, wait_for_spares: bool = True) -> str:
        self._die("launch")  # a worker dies, or does not answer, while the grid starts
        if self.cluster.place_fails:
            self.cluster.place_fails -= 1
            raise TopologyError("placement timed out")
        if not self.fits()[0] or self.size + self.cluster.others > self.cluster.capacity:
            self.cluster.phantom = 0  # the placement waited in vain: now Ray reports the node dead
            raise TopologyError(f"needs {self.size} workers")
        self.alive = True
        self.start_spares()
        if restore is not None:
            self.restore(restore)
        return "fake"

    def start_spares(self) -> int:
        room = self.cluster.capacity - sum(g.held for g in self.cluster.groups)
        started = max(0, min(self.cfg.fault_tolerance.spares - len(self.spares), room))
        self.spares += [f"spare{len(self.cluster.calls)}.{i}" for i in range(started)]
        self.cluster.calls.append(("start_spares", started))
        return started

    def standing_by(self, ranks: set[int]) -> frozenset[int]:
        return frozenset()  # no standbys (CPU)

    def start_standbys(self) -> int:
        return 0

    def spares_ready(self) -> int:
        if self.cluster.spares_dead:
            self.spares = []
        return len(self.spares)

    def regroup(self, lost: set[int], ep: int, home: list[int], keep: list[int], spare_for: set[int],
                restore: dict, timeout_s: float) -> None:
        """In place: spares take the places in spare_for, survivors of columns not kept stand by as spares."""
        assert len(spare_for) <= len(self.spares) and spare_for <= lost
        left_out = self.size - len(lost) - (self.pp * ep - len(spare_for))
        self.cluster.calls.append(("regroup", sorted(lost), ep, list(keep), sorted(spare_for)))
        self.spares = self.spares[len(spare_for):] + [f"survivor{i}" for i in range(left_out)]
        self.ep, self.home = ep, list(home)
        self.launch_seconds = {"swap_in_spares": 0.0}
        if restore is None:  # every worker takes its place again, its weights initialised from the seed
            self.trained = ()
        else:
            self.restore(restore)

    def restore(self, sources: dict, timeout_s: float = 0) -> None:
        self._die("restore")
        assert set(sources) == set(range(self.pp))
        state = sources[0][0]  # a snapshot (the tuple) or a checkpoint part (written by save_checkpoint)
        if isinstance(state, tuple) and self.cluster.snapshots_lost:
            self.cluster.snapshots_lost -= 1
            raise ObjectsLost("restore failed on 1 of 2 workers (rank 0: ObjectReconstructionFailedError: lost)")
        self.trained = tuple(state["trained"].tolist()) if isinstance(state, dict) else state

    def run_step(self, step: int, batch: int, timeout_s: float, next_batch: int | None = None) -> list[dict]:
        self.cluster.calls.append(("run_step", step))
        self.cluster.announced.append((step, batch, next_batch))
        if self.cluster.step_gate is not None:
            assert self.cluster.step_gate.wait(10)
        ranks = self.cluster.lose.pop(step, None)
        if ranks is not None:
            raise WorkerLost({ranks} if isinstance(ranks, int) else set(ranks), "ActorDiedError")
        self.trained += (batch,)
        loss = math.nan if batch in self.cluster.nan_batches else 10.0 / len(self.trained)
        E = self.cfg.model.n_experts
        report = {"loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_expert": {0: [[1] * E] * self.ep},
                  "rank_load": {0: [E] * self.ep}, "timings": {"compute": 0.0, "total": 1.0},
                  "activations": {0: {"routed_maxabs": 1.0, "routed_rms": 1.0, "resid_maxabs": 1.0}}}
        return [report] * self.size

    def call_each(self, method: str, args: dict, timeout_s: float | None = 120.0) -> dict:
        self.cluster.calls.append((method, *sorted(args)))
        self._die(method)
        return {r: {} if method == "export_shard" else True for r in args}

    def call(self, method: str, *args, timeout_s: float | None = 120.0) -> list:
        self.cluster.calls.append((method, *args))
        self._die(method)
        if method == "state":
            return [self.trained] * self.size
        if method == "save_checkpoint":  # real parts on disk, so that commits and their verification are real
            root, step = args
            self.parts = [ckpt.write_part(root, step, part_name(r), {"trained": torch.tensor(self.trained)})
                          for r in range(self.size)]
        if method == "checkpoint_parts":
            parts, self.parts = getattr(self, "parts", []), []
            return [[p.to_json()] for p in parts]
        if method == "evaluate":
            return [float(len(self.trained))] * self.size
        return [True] * self.size

    def warm_stores(self) -> list:
        self.cluster.warmed_after.append(self.trained)  # the batches trained when the stores were warmed
        return []

    def stage_snapshot(self, step: int) -> tuple[list, None]:
        self._die("stage_snapshot")
        self.cluster.snapshot_steps.append(step)
        return [(1, 0.0)] * self.size, None

    def stream_snapshot(self, step: int, staged: list) -> list:
        return [self.trained] * self.size

    def snapshot_bytes(self, parts: list, timeout_s: float | None) -> int:
        self._die("snapshot_bytes")
        return len(parts)

    def hold_peer_snapshots(self, step: int, refs: list) -> None:
        self._die("hold_peer_snapshots")

    def close(self) -> None:
        self.alive = False


def config(**overrides):
    # a folder of its own: a checkpoint folder belongs to one job, and these jobs must not meet others' checkpoints
    base = {"checkpoint.dir": tempfile.mkdtemp(prefix="k3ray-ctrl-"), "train.eval_every": 0,
            "fault_tolerance.snapshot_every": 4, "policies.guards.warmup_steps": 100, "api.enabled": False,
            "checkpoint.at_end": False, "parallel.pp": 1, "parallel.ep": 1}
    return load_config("configs/tiny.yaml", {**base, **overrides})


def run(cluster: Cluster, steps: int, **overrides) -> Controller:
    ctrl = Controller(config(**overrides), group_factory=cluster.group)
    ctrl.start()
    for s in range(steps):
        ctrl.train_step(s)
    return ctrl


def states(ctrl: Controller) -> list[str]:
    return [s for _, s, _ in ctrl.machine.history]


def clean_run(steps: int, **overrides) -> tuple[int, ...]:
    cluster = Cluster()
    run(cluster, steps, **overrides)
    return cluster.groups[-1].trained


def resume(tmp_path, fresh: bool = False, **overrides) -> tuple[Controller, dict, Cluster]:
    cluster = Cluster()
    ctrl = Controller(config(**{"checkpoint.dir": str(tmp_path), "checkpoint.every_n_steps": 4, **overrides}),
                      group_factory=cluster.group)
    return ctrl, ctrl.start(resume=True, fresh=fresh), cluster
