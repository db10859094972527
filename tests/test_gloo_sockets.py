"""Leaving a grid ends the waits on its gloo groups at once, even while something still holds the groups: three
processes join pp=3 x ep=1; stage 2 waits for stage 1's hidden state and stage 1 (its own stale thread) for stage
0's; stage 1 leaves the grid holding its world group. Both waits fail at once ("Connection closed by peer"), not at
the collective timeout, and a TCP connection that is not gloo's stays open."""
from __future__ import annotations

import json
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from k3ray.parallel.gloo_sockets import tcp_sockets
from k3ray.parallel.grid_groups import GridGroups

TIMEOUT_S = 30.0  # the groups' collective timeout: a wait ending near it was not ended by the leave
WAITING_S = 2.0  # how long the waits run before stage 1 leaves


def _wait_in_recv(world, src: int, out: dict) -> threading.Thread:
    def wait():
        t0 = time.perf_counter()
        try:
            dist.recv(torch.empty(4), src, group=world)
            out["result"] = "received"
        except RuntimeError as err:
            out["result"] = str(err).splitlines()[0]
        out["waited_s"] = time.perf_counter() - t0

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def _rank(rank: int, port: int, echo_port: int, folder: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    other = socket.create_connection(("127.0.0.1", echo_port))  # not gloo's: must stay open
    groups = GridGroups()
    groups.join(f"tcp://127.0.0.1:{port}", "gloo", 1, rank, 0, 3, 1, TIMEOUT_S)
    world = groups.world
    dist.barrier(group=world)
    report: dict = {"sockets": len(tcp_sockets())}
    if rank in (1, 2):
        thread = _wait_in_recv(world, rank - 1, report)
        time.sleep(WAITING_S)
        if rank == 1:
            held = world  # noqa: F841 - what a failed call's frames would hold: the group stays alive
            t0 = time.perf_counter()
            groups.leave(cuda=False)
            report["leave_s"] = time.perf_counter() - t0
            other.sendall(b"ping")
            report["other"] = other.recv(4).decode()
        thread.join(timeout=TIMEOUT_S + 10)
    with open(os.path.join(folder, f"{rank}.json"), "w") as f:
        json.dump(report, f)
    until = time.time() + TIMEOUT_S + 10  # every process alive until each wait ended: an exit would end them too
    while time.time() < until and len([n for n in os.listdir(folder) if n.endswith(".json")]) < 3:
        time.sleep(0.1)


def _echo(server: socket.socket) -> None:
    while True:
        conn, _ = server.accept()
        threading.Thread(target=lambda c=conn: [c.sendall(c.recv(4)), time.sleep(30)], daemon=True).start()


def test_leaving_a_grid_ends_the_waits_on_its_gloo_groups_at_once(tmp_path):
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_echo, args=(server,), daemon=True).start()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, server.getsockname()[1], str(tmp_path)), nprocs=3, join=True)
    stage = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    for waiting in (stage[1], stage[2]):  # stage 1's own stale thread, and its peer
        assert "Connection closed by peer" in waiting["result"], waiting
        assert waiting["waited_s"] < WAITING_S + 10.0 < TIMEOUT_S, waiting
    assert stage[1]["other"] == "ping"
