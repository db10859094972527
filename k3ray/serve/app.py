"""`k3ray serve`: OpenAI-compatible front doors (FastAPI on uvicorn, one Ray actor process each; their routes:
k3ray.serve.front_door) in front of the serving engine actor (k3ray.serve.engine), which drives the
worker grid.

Front doors: `--front-doors N` processes all listen on host:port (SO_REUSEPORT: the kernel spreads connections over
them), so the HTTP and SSE work scales apart from the engine. Each writes its streams straight to its sockets: a
token crosses one Ray message (engine -> front door, batched per iteration), never a proxy (an HTTP proxy process
in between cost more CPU per token than the engine, and one process of it capped the served tokens per second).
`k3ray serve` starts a new front door in place of one that died (`Serving.keep_doors`).

A host other than loopback is served only with an API key, unless `--insecure` (`check_exposure`).
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
import ray.util.scheduling_strategies
import uvicorn

from k3ray.steering.auth import API_KEY_ENV

log = logging.getLogger("k3ray.serve")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, insecure: bool) -> None:
    """Refuse (ValueError) to serve a host other than loopback without an API key, unless `insecure`."""
    if api_key is None and not insecure and not is_loopback(host):
        raise ValueError(f"--host {host}: reachable from other machines without an API key; pass --api-key-file F "
                         f"(or set {API_KEY_ENV}), or --insecure to serve it open")


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that other processes may bind too (SO_REUSEPORT): the kernel spreads new
    connections over every front door listening there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


@ray.remote(num_cpus=0)
class FrontDoorProcess:
    """One front-door process: uvicorn serving `build_app` on host:port, shared with the other front
    doors, in a thread of its own (its event loop also awaits the engine's stream). It may be started with the
    engine: its process start and imports overlap the engine's, and it listens once the engine is ready."""

    def __init__(self, engine, api_key: str | None, host: str, port: int, timeout_s: float = 600.0):
        # the routes import torch (the request shapes' sampling parameters): imported in this process only, so
        # `k3ray serve`, which imports this module, imports none
        from k3ray.serve.front_door import build_app

        info = ray.get(engine.ready.remote(), timeout=timeout_s)
        sock = shared_port_socket(host, port)
        config = uvicorn.Config(build_app(engine, info, api_key), log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="front-door",
                                       daemon=True)  # uvloop and httptools where installed
        self.thread.start()

    def ready(self, timeout_s: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the front door's HTTP server did not start")
            time.sleep(0.01)
        return True

    def stop(self) -> bool:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        return True


@dataclass
class Serving:
    """A running `k3ray serve`: the engine actor and its front doors (`keep_doors` replaces those that died)."""
    engine: object
    info: dict
    doors: list
    url: str
    start_door: Callable
    start_seconds: dict[str, float]  # the engine's start, then the front doors' wait beyond it

    def keep_doors(self, timeout_s: float = 30.0) -> int:
        """Start a new front door in place of each that died; how many were replaced."""
        replaced = 0
        for i, door in enumerate(self.doors):
            try:
                ray.get(door.ready.remote(), timeout=timeout_s)
            except ray.exceptions.RayActorError:
                self.doors[i] = self.start_door()
                ray.get(self.doors[i].ready.remote(), timeout=timeout_s)
                replaced += 1
        return replaced


def start_serving(checkpoint: str, pp: int = 1, ep: int = 1, host: str = "127.0.0.1", port: int = 8000,
                  serve_overrides: dict | None = None, front_doors: int = 1, observers: list | None = None,
                  spares: int = 0, api_key: str | None = None, insecure: bool = False,
                  standbys: bool | str = "auto") -> Serving:
    """Start the engine (workers loaded from the checkpoint) and `front_doors` HTTP processes on host:port. With
    `api_key` every route but /health needs it (`check_exposure` first: ValueError)."""
    from k3ray.serve.engine import ServingEngine
    from k3ray.serve.launch import hold_weights

    check_exposure(host, api_key, insecure)
    t0 = time.perf_counter()
    # the read starts before the engine's process: the weights are then held by the time its workers are up
    reading = list(hold_weights(checkpoint))
    engine = ServingEngine.options(num_cpus=0).remote(checkpoint, pp, ep, serve_overrides, observers=observers,
                                                      spares=spares, standbys=standbys, reading=reading)
    here = ray.get_runtime_context().get_node_id()  # the front doors listen on this machine's host:port
    pin = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(here, soft=False)

    def start_door():
        return FrontDoorProcess.options(scheduling_strategy=pin).remote(engine, api_key, host, port)

    doors = [start_door() for _ in range(front_doors)]  # beside the engine's start: they wait for it to listen
    try:
        info = ray.get(engine.ready.remote())
    except BaseException:
        for door in doors:
            ray.kill(door)
        raise
    t_engine = time.perf_counter()
    ray.get([d.ready.remote() for d in doors])
    url = f"http://{host}:{port}"
    log.info("serving %s (step %d) at %s/v1 through %d front doors", info["model"], info["step"], url, front_doors)
    return Serving(engine, info, doors, url, start_door,
                   {"engine": t_engine - t0, "front_doors_after_engine": time.perf_counter() - t_engine})


def stop_serving(serving: Serving) -> None:
    try:
        ray.get([d.stop.remote() for d in serving.doors], timeout=30)
    except ray.exceptions.RayError:
        pass  # a front door already gone: killed below anyway
    for door in serving.doors:
        ray.kill(door)
    try:
        ray.get(serving.engine.shutdown.remote(), timeout=120)
    finally:
        ray.kill(serving.engine, no_restart=True)
