"""Presence: a rank learns at once that a watched peer's process has ended, without waiting for it to fall silent.

When a process ends, however it ends (``kill -9``, an out-of-memory kill, a crash), its kernel closes its sockets,
and the other end of each reads an end of file at once. A heartbeat cannot tell that quickly: a rank must miss
several beats before the others may call it gone, and a shorter silence would take a rank on a loaded machine for
a dead one. So every rank (under ``trainer.on_failure=continue``) listens on a TCP port of its own, published in
the run's store, and holds one connection to each of the peers it watches: its two neighbours in the ring of the
active ranks ordered by local index, then node (so that each neighbour is on another node whenever there are two
nodes or more: a whole node lost is seen from the nodes that remain). Nothing is ever sent on these connections
but a farewell: a rank that leaves the run on purpose (it finished, was evicted, or was removed as hung and woke
up) writes ``bye`` on each connection it accepted before it closes them. An end of file without it is the mark of
a process that ended unplanned; the watcher appends the peer's rank to one list in the store, and the survivors
agreeing on a loss (``engine/elastic/failures.py``) take a rank on that list for gone at once instead of after
:data:`~engine.elastic.heartbeat.SILENT_S` of silence.

A hung process (stopped, stuck in a driver) keeps its sockets open: it is still found by its silence and by the
deadline of its collective, as before. So is a machine that loses power or its network, whose kernel sends
nothing. The connections are kept (``distributed/connections.py``) so that cutting a replaced gloo group never
shuts one of them down, which would read as a farewell-less end of file on both sides.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from typing import Any

from distributed.connections import Connections, _inode, forget, keep

BYE = b"bye"
CONNECT_TIMEOUT_S = 0.5  # a connection to a peer's port that takes longer is tried again at the next look
LOOK_S = 0.5  # how often the thread looks again for the addresses of peers it does not reach yet
_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` (Linux), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return True


def reachable_address(env: dict[str, str] | os._Environ = os.environ) -> str:
    """The address the other ranks reach this process at: that of ``GLOO_SOCKET_IFNAME``'s interface where it is set
    (the one gloo uses), else the one this host sends from towards the store (``MASTER_ADDR``), else the host
    name's; the loopback address where every rank is on this host."""
    ifname = env.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if ifname and (address := interface_address(ifname)):
        return address
    master = env.get("MASTER_ADDR")
    if master:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(env.get("MASTER_PORT", "1") or 1)))  # (UDP: nothing is sent)
            if not _loopback(address := s.getsockname()[0]):
                return address
    with contextlib.suppress(OSError):
        if not _loopback(address := socket.gethostbyname(socket.gethostname())):
            return address
    return "127.0.0.1"


def ring_neighbours(rank: int, ranks: list[int], nodes: list[str]) -> set[int]:
    """The ranks ``rank`` watches: its two neighbours among ``ranks`` (the active ones; ``nodes``: rank -> node name)
    ordered by their index on their node, then by node, so that a neighbour is on another node whenever the ranks
    span two nodes or more."""
    order_of_nodes: dict[str, int] = {}
    place: dict[int, tuple[int, int]] = {}  # rank -> (its index on its node, its node's order)
    seen: dict[str, int] = {}
    for r in ranks:  # (ranks in order: a node's lowest rank first, so node order is that of the lowest ranks)
        node = nodes[r] if r < len(nodes) else f"rank{r}"  # (a rank whose node is not known yet: one of its own)
        order_of_nodes.setdefault(node, len(order_of_nodes))
        place[r] = (seen.get(node, 0), order_of_nodes[node])
        seen[node] = place[r][0] + 1
    ring = sorted(ranks, key=place.__getitem__)
    if rank not in ring or len(ring) < 2:
        return set()
    i = ring.index(rank)
    return {ring[i - 1], ring[(i + 1) % len(ring)]} - {rank}


class Presence:
    """This rank's listening port and its connections to the peers it watches (the module docstring). ``store``:
    a store connection for this object's thread alone; ``key``: a name -> the run's key for it."""

    def __init__(self, rank: int, store: Any, key: Callable[[str], str], address: str | None = None):
        self.rank, self.store, self.key = rank, store, key
        self.address = address or reachable_address()
        self._listener = socket.create_server(("0.0.0.0", 0))
        self._listener.setblocking(False)
        self._accepted: list[socket.socket] = []  # the watchers' connections to this rank
        self._watching: dict[int, socket.socket] = {}  # peer -> this rank's connection to its port
        self._wanted: set[int] = set()
        self._ended: set[int] = set()  # peers whose connection ended (with or without a farewell): not redialled
        self.reported: list[int] = []  # peers whose process this rank saw end unplanned, in order
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def _keep(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        keep(("presence", fd), [Connections([(fd, _inode(fd) or "")])])

    def _close(self, sock: socket.socket) -> None:
        forget(("presence", sock.fileno()))
        sock.close()

    # ---- the training side -----------------------------------------------------------------------------------------
    def start(self) -> Presence:
        port = self._listener.getsockname()[1]
        self.store.set(self.key(f"presence/{self.rank}"), f"{self.address}:{port}")
        self._thread = threading.Thread(target=self._run, name="relaxsync-presence", daemon=True)
        self._thread.start()
        return self

    def watch(self, peers: Iterable[int]) -> None:
        """Watch ``peers`` from now on (connections to the others are closed, quietly)."""
        peers = set(peers) - {self.rank}
        with self._lock:
            if peers == self._wanted:
                return
            self._wanted = peers
        self._wake_w.send(b"w")

    def stop(self, farewell: bool) -> None:
        """Stop watching and close every connection; with ``farewell`` (this rank leaves the run on purpose), first
        tell each watcher so, so that none takes this end for a loss."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"s")
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        for sock in self._accepted:
            if farewell:
                with contextlib.suppress(OSError):
                    sock.setblocking(True)
                    sock.settimeout(0.5)
                    sock.sendall(BYE)
            self._close(sock)
        for sock in self._watching.values():
            self._close(sock)
        self._accepted, self._watching = [], {}
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # ---- the thread ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            with self._lock:
                wanted = set(self._wanted)
            for peer in [p for p in self._watching if p not in wanted]:
                self._close(self._watching.pop(peer))
            self._dial([p for p in wanted if p not in self._watching and p not in self._ended])
            watched = {sock: peer for peer, sock in self._watching.items()}
            # (every wanted peer reached: nothing to do until a connection or the watch changes, or stop)
            look = LOOK_S if any(p not in self._watching and p not in self._ended for p in wanted) else None
            # (poll, not select: a process with many files has descriptors above select's limit of 1024)
            by_fd = {sock.fileno(): sock for sock in [self._listener, self._wake_r, *self._accepted, *watched]}
            poller = select.poll()
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            try:
                events = poller.poll(None if look is None else look * 1000)
            except OSError:  # (interrupted: look again)
                continue
            for fd, _ in events:
                sock = by_fd[fd]
                if sock is self._listener:
                    self._accept()
                elif sock is self._wake_r:
                    with contextlib.suppress(OSError):
                        sock.recv(64)
                elif sock in watched:
                    self._read(watched[sock], sock)
                else:  # a watcher's connection: nothing comes on it but its end (the watcher left or moved on)
                    self._accepted.remove(sock)
                    self._close(sock)

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            sock, _ = self._listener.accept()
            sock.setblocking(False)
            self._keep(sock)
            self._accepted.append(sock)

    def _dial(self, peers: list[int]) -> None:
        for peer in peers:
            key = self.key(f"presence/{peer}")
            try:
                if not self.store.check([key]):
                    continue
                host, port = self.store.get(key).decode().rsplit(":", 1)
                sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
            except Exception:  # (not published yet, not listening yet, the store's error: the next look tries again)
                continue
            sock.setblocking(False)
            self._keep(sock)
            self._watching[peer] = sock

    def _read(self, peer: int, sock: socket.socket) -> None:
        try:
            data = sock.recv(64)
        except BlockingIOError:
            return
        except OSError:  # (reset: the peer's kernel dropped the connection)
            data = b""
        farewell = bool(data)  # (nothing but the farewell is ever written on these connections)
        del self._watching[peer]
        self._close(sock)
        self._ended.add(peer)
        if farewell:
            return
        with self._lock:
            still_wanted = peer in self._wanted
        if still_wanted:
            with contextlib.suppress(Exception):  # (the store gone too: the silence decides, as before)
                self.store.append(self.key("presence/ended"), f"{peer},")
            self.reported.append(peer)  # (after the store has it: a reader of both sees it there first)


def ended(store: Any, key: Callable[[str], str]) -> set[int]:
    """The ranks some watcher saw end without a farewell, so far (read from ``store``)."""
    name = key("presence/ended")
    if not store.check([name]):
        return set()
    return {int(r) for r in store.get(name).decode().split(",") if r}
