"""The TCP connections of one grid generation's gloo groups, found while the groups are built, so that a worker
leaving the grid can end them itself.

Why: a gloo group closes its connections only when it is freed, and neither `abort()` nor `shutdown()` of a gloo
backend ends a wait, on either side (torch 2.13). A worker that left a grid while something still holds one of its
groups (a failed call's frames, the C++ side) keeps its end of every pair open, and a peer waiting on it in a recv
waits out parallel.collective_timeout_s. Shutting a connection down (`shutdown(SHUT_RDWR)` on a duplicate of its
descriptor: the group's own descriptor stays valid, only the connection ends) makes every peer still blocked on it
fail at once ("Connection closed by peer"), whatever holds the group.

Which sockets: a gloo pair is a TCP connection with a gloo listener at one end, either accepted on one of this
worker's listeners or made to a peer's. This worker's listeners are its LISTEN sockets that appeared while the groups
were built (the c10d store's own port left out); the peers' come from an all-gather over the new world group. Ray's
connections (gRPC to the raylet, the GCS, other workers) never end at a gloo listener, so they are never touched.
Linux only (/proc); elsewhere nothing is found, and leaving relies on the groups being freed."""
from __future__ import annotations

import ipaddress
import os
import socket
import sys
from typing import NamedTuple

import torch.distributed as dist

LISTEN = "0A"  # the state column of /proc/net/tcp for a listening socket

Endpoint = tuple[str, int]  # (ip, port)


class TcpSocket(NamedTuple):
    fd: int
    listening: bool
    local: Endpoint
    remote: Endpoint


def _endpoint(field: str) -> Endpoint:
    """An address of /proc/net/tcp{,6} ("0100007F:1F90": 32-bit words in host order, the port in hex) as (ip, port)."""
    address, port = field.split(":")
    raw = bytes.fromhex(address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def _socket_fds() -> dict[int, int]:
    """This process's sockets: inode -> descriptor."""
    fds = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return fds
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed since it was listed
            continue
        if target.startswith("socket:["):
            fds[int(target[8:-1])] = int(name)
    return fds


def tcp_sockets() -> dict[int, TcpSocket]:
    """This process's TCP sockets (IPv4 and IPv6): inode -> TcpSocket."""
    fds, found = _socket_fds(), {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            inode = int(fields[9])
            if inode in fds:
                found[inode] = TcpSocket(fds[inode], fields[3] == LISTEN, _endpoint(fields[1]), _endpoint(fields[2]))
    return found


class GlooConnections:
    """The gloo pairs of one grid generation's groups: `listening` before the groups are built, `find` after,
    `shut_down` when the grid is left."""

    def __init__(self):
        self._listeners_before: set[int] = set()
        self._pairs: list[tuple[int, int]] = []  # (descriptor, inode) of each pair's socket in this process

    def listening(self) -> None:
        """Note the listeners that exist before the groups are built (call it right before)."""
        self._listeners_before = {inode for inode, s in tcp_sockets().items() if s.listening}

    def find(self, world, store_port: int) -> int:
        """Find the pairs of the groups just built, this worker one of `world`'s ranks (a collective over it: every
        rank calls it); store_port is the c10d store's (its connections are not gloo's). Returns how many."""
        sockets = tcp_sockets()
        mine = [s.local for inode, s in sockets.items()
                if s.listening and inode not in self._listeners_before and s.local[1] != store_port]
        everyone: list = [None] * dist.get_world_size(world)
        dist.all_gather_object(everyone, mine, group=world)
        my_ports = {port for _, port in mine}
        listeners = {tuple(endpoint) for endpoints in everyone for endpoint in endpoints}
        wildcard_ports = {port for ip, port in listeners if ipaddress.ip_address(ip).is_unspecified}
        self._pairs = [(s.fd, inode) for inode, s in sockets.items() if not s.listening and (
            s.local[1] in my_ports or s.remote in listeners or s.remote[1] in wildcard_ports)]
        return len(self._pairs)

    def shut_down(self) -> int:
        """End every pair found that is still open (a descriptor since closed, or reused by another socket, is left
        alone): each peer blocked on one fails at once. Returns how many were ended."""
        ended = 0
        for fd, inode in self._pairs:
            try:
                dup = os.dup(fd)
            except OSError:  # closed since: the group was freed
                continue
            try:
                same = os.readlink(f"/proc/self/fd/{dup}") == f"socket:[{inode}]"
            except OSError:
                same = False
            if not same:  # the descriptor now names another file or socket
                os.close(dup)
                continue
            with socket.socket(fileno=dup) as conn:  # owns the duplicate only: closing it leaves the group's fd
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                    ended += 1
                except OSError:  # already disconnected
                    pass
        self._pairs = []
        return ended
