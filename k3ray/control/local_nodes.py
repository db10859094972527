"""Raylets on this machine standing in for nodes (drills, tests and benchmarks of node loss without a second host):
start one with ports and a temp dir of its own (other clusters may share the machine; `ray stop` would stop them
all), then lose it (SIGKILL every process of it at once, as a power loss does), silence it (SIGSTOP it and every
process under it: nothing dies, nothing answers) or stop it for good (every process of it)."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free now. The sockets stay bound until all are chosen: ports taken one at a
    time can repeat, since the kernel may hand a just-released port out again."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


_AGENT_PORTS = ("metrics-export-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                "runtime-env-agent-port")


def start_raylet(temp_dir: str, *args: str, env: dict | None = None, attempts: int = 3) -> None:
    """`ray start --temp-dir temp_dir ARGS` on 127.0.0.1 with free ports for its agents and metrics (unless ARGS
    name them). A port chosen free can be taken by another process before Ray binds it; when `ray start` says a
    port is in use, it is tried again with new ports; so it is when the node timed out during its startup (a loaded
    host: seen in the test suite on 2 shared cores)."""
    for attempt in range(attempts):
        names = [name for name in _AGENT_PORTS if f"--{name}" not in args]
        ports = [f"--{name}={port}" for name, port in zip(names, free_ports(len(names)))]
        done = subprocess.run([shutil.which("ray"), "start", "--temp-dir", temp_dir, "--node-ip-address",
                               "127.0.0.1", "--disable-usage-stats", *ports, *args], timeout=300, capture_output=True,
                              text=True, env=env if env is not None else dict(os.environ))
        if done.returncode == 0:
            return
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()[-3:]
        transient = any(("port" in line and "used" in line) or "timed out during startup" in line for line in said)
        if not transient or attempt == attempts - 1:  # what `ray start` said, not only its exit status
            raise RuntimeError(f"ray start {' '.join(args)} in {temp_dir} failed (exit {done.returncode}): "
                               + " | ".join(said))


def join_node(temp_dir: str, address: str, num_cpus: int, *args: str, timeout_s: float = 60.0) -> str:
    """Start a raylet joining the cluster at `address` (GCS host:port; this process connected to it; `args`: more
    of `ray start`'s, e.g. --object-store-memory) and wait until Ray reports it alive. Returns its node id. Waits for a new id, not for one more alive node: a node lost just
    before may be reported dead meanwhile."""
    import ray

    before = {n["NodeID"] for n in ray.nodes()}
    start_raylet(temp_dir, "--address", address, "--num-cpus", str(num_cpus), *args)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        new = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in before]
        if new:
            return new[0]
        time.sleep(0.5)
    raise TimeoutError(f"the raylet in {temp_dir} did not join {address} within {timeout_s:g}s")


def wait_until_dead(node_ids: list[str], timeout_s: float = 90.0) -> None:
    """Wait until Ray reports none of `node_ids` alive. A stopped raylet stays alive to the GCS until its health
    checks fail (seconds after a SIGKILL): an actor placed there meanwhile dies unstarted with its node."""
    import ray

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if not {n["NodeID"] for n in ray.nodes() if n["Alive"]} & set(node_ids):
            return
        time.sleep(0.5)
    raise TimeoutError(f"Ray still reports node(s) {sorted(node_ids)} alive {timeout_s:g}s after they stopped")


@contextmanager
def head_room(cpus: int):
    """All but `cpus` of the head's CPUs held by a placement group for the with-block, so that a grid larger than
    that places the rest of its workers on the other nodes. Waits for earlier tests' actors to give theirs back."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    head = ray.get_runtime_context().get_node_id()
    total = next(n["Resources"]["CPU"] for n in ray.nodes() if n["NodeID"] == head)
    blocker = placement_group([{"CPU": total - cpus}], strategy="STRICT_PACK",
                              bundle_label_selector=[{"ray.io/node-id": head}])
    try:
        ray.get(blocker.ready(), timeout=120)
        yield
    finally:
        remove_placement_group(blocker)


def _processes() -> tuple[dict[int, bytes], dict[int, list[int]]]:
    """Command line of every process, and the children of each."""
    cmdlines, children = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():  # a caller naming the dir is not the node
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        cmdlines[int(entry.name)] = cmd
        children.setdefault(ppid, []).append(int(entry.name))
    return cmdlines, children


def _tree(roots: list[int], children: dict[int, list[int]]) -> list[int]:
    tree, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _raylets(temp_dir: str, cmdlines: dict[int, bytes]) -> list[int]:
    return [pid for pid, cmd in cmdlines.items() if temp_dir.encode() in cmd and b"raylet" in cmd.split(b"\0")[0]]


def node_processes(temp_dir: str) -> list[int]:
    """Every process of the node: those naming its dir (raylet, agents; GCS and dashboard of a head) and every process
    under its raylet (the workers, whose command lines no longer name the dir)."""
    cmdlines, children = _processes()
    mine = {pid for pid, cmd in cmdlines.items() if temp_dir.encode() in cmd}
    return sorted(mine | set(_tree(_raylets(temp_dir, cmdlines), children)))


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_node(temp_dir: str) -> None:
    """A lost node: every process of it SIGKILLed in one pass. Killing the raylet alone is another fault: its
    workers notice and exit only later, and meanwhile some still answer calls."""
    _signal(node_processes(temp_dir), signal.SIGKILL)


def silence_node(temp_dir: str) -> list[int]:
    """A silent node: its raylet and its workers stopped (SIGSTOP), alive to the OS, answering nobody; returns them."""
    cmdlines, children = _processes()
    pids = _tree(_raylets(temp_dir, cmdlines), children)
    _signal(pids, signal.SIGSTOP)
    return pids


def stop_node(temp_dir: str, remove: bool = True) -> None:
    """Every process of the node SIGTERMed (and continued, if silenced), then SIGKILLed, its temp dir removed."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = node_processes(temp_dir)
        _signal(pids, sig)
        _signal(pids, signal.SIGCONT)
        deadline = time.time() + 5  # a head's GCS and autoscaler outlast SIGTERM by 15 s and more
        while node_processes(temp_dir) and time.time() < deadline:
            time.sleep(0.2)
    if remove:
        shutil.rmtree(temp_dir, ignore_errors=True)
