"""The TCP connections of a gloo process group, so that a group replaced after a loss can be cut off at once.

A gloo group's destructor waits for every collective still on it, each until the group's timeout
(``trainer.hang_timeout_s``). After a loss the survivors abandon the group with whatever was in flight: a bucket
one survivor issued and another never reached, a round only some of them posted. Where each of two survivors
holds such a collective waiting on the other, both destructors wait the whole timeout (20 s of a 20 s timeout in
a two-process test; 60 s once in a benchmark's kill), wherever the last reference to the group goes, on the
training thread. A peer that has nothing pending closes its side at once, which fails the other's collective and
frees it: the wait needs both sides stuck.

So each group's connections are noted when gloo makes them (all at once, when the group is built: a full mesh),
and a survivor shuts them down before it lets the group go. Every collective still on the group then fails at
once, on this side and on the peer's, and both destructors return. The connections are found in ``/proc``: the
sockets this process opened while the group was built, less listening ones and any to the run's store. Elsewhere
(no ``/proc``) nothing is noted and a group is let go as before.

A process can make connections in two threads at once: a group formed ahead of a change in the background while
the training thread forms another, or a state's pipe to a joining process. Each block then notes the other's
connections as well as its own (their sockets appear at the same moments), and nothing in ``/proc`` tells them
apart. So every noted set is kept (:func:`keep`) for as long as its connections live, and :func:`cut` shuts down
only the sockets that no other kept set holds: a group let go never takes a live group's connections with it.
(Two sets noted at overlapping moments then protect each other's sockets: whichever is let go first is destroyed
without its connections cut, as where nothing is noted.)
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Hashable, Iterable, Iterator
from typing import Any

_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"  # (the state column of /proc/net/tcp)
_kept: dict[Hashable, Connections] = {}  # what keep() was given, by key, until cut() or forget()
_keeping = threading.Lock()


class Connections:
    """Sockets noted for one group: (file descriptor, socket inode), the inode checked again before each use (a
    descriptor closed by gloo can be reused by anything)."""

    def __init__(self, sockets: list[tuple[int, str]]):
        self.sockets = sockets

    def shut_down(self) -> int:
        """Shut down (both directions) each noted socket that is still the one noted; how many were."""
        shut = 0
        for fd, inode in self.sockets:
            if _inode(fd) != inode:
                continue
            try:
                with socket.socket(fileno=os.dup(fd)) as dup:  # (the same socket; closing the duplicate leaves fd)
                    dup.shutdown(socket.SHUT_RDWR)
                shut += 1
            except OSError:  # (closed or reset meanwhile: nothing left to cut)
                pass
        return shut


def store_port() -> int | None:
    """The port of the run's c10d store (MASTER_PORT), whose connections a group's never are."""
    port = os.environ.get("MASTER_PORT")
    return int(port) if port and port.isdigit() else None


def keep(key: Hashable, made: list[Connections]) -> None:
    """Keep the connections a :func:`noted` block made (``made``, its value) under ``key`` (a group's or a pipe's
    id), for :func:`cut`; until then no other set's cut touches them."""
    if made and made[0].sockets:
        with _keeping:
            _kept[key] = made[0]


def forget(key: Hashable) -> None:
    """Stop keeping ``key``'s connections (they are closed, or no longer worth protecting)."""
    with _keeping:
        _kept.pop(key, None)


def cut(keys: Iterable[Hashable]) -> int:
    """Shut down the connections kept under ``keys`` and stop keeping them, less any socket another kept set holds
    too (noted at an overlapping moment, it may be that set's); how many were shut down."""
    with _keeping:
        cutting = [_kept.pop(key) for key in keys if key in _kept]
        others = {s for connections in _kept.values() for s in connections.sockets}
    return Connections(sorted({s for c in cutting for s in c.sockets} - others)).shut_down()


@contextlib.contextmanager
def noted(store_port: int | None = None) -> Iterator[list[Connections]]:
    """Note the TCP connections this process opens inside the block (a gloo group being built); the block's value
    holds the :class:`Connections` once it ends. Connections to or from ``store_port`` (the run's store, which
    another thread may reach meanwhile) and listening sockets are left out."""
    out: list[Connections] = []
    before = _sockets()
    yield out
    if before is None:
        return
    new = {fd: inode for fd, inode in (_sockets() or {}).items() if before.get(fd) != inode}
    table = _tcp_table()
    kept = []
    for fd, inode in new.items():
        row = table.get(inode)
        if row is None or row["state"] == _LISTEN:  # (not TCP, gone already, or gloo's listener)
            continue
        if store_port is not None and store_port in (row["local_port"], row["remote_port"]):
            continue
        kept.append((fd, inode))
    out.append(Connections(sorted(kept)))


def _inode(fd: int) -> str | None:
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return link[len("socket:[") : -1] if link.startswith("socket:[") else None


def _sockets() -> dict[int, str] | None:
    """This process's sockets: descriptor -> inode (None without /proc)."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    out = {}
    for name in fds:
        inode = _inode(int(name))
        if inode is not None:
            out[int(name)] = inode
    return out


def _tcp_table() -> dict[str, dict[str, Any]]:
    """inode -> state and ports of every TCP socket of this network namespace."""
    table: dict[str, dict[str, Any]] = {}
    for path in _TCP_TABLES:
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            table[fields[9]] = {
                "state": fields[3],
                "local_port": int(fields[1].rsplit(":", 1)[1], 16),
                "remote_port": int(fields[2].rsplit(":", 1)[1], 16),
            }
    return table
