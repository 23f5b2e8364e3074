"""Presence: a rank learns at once that a watched peer's process has ended, and within a silence that it hangs,
without asking the run's store.

When a process ends, however it ends (``kill -9``, an out-of-memory kill, a crash), its kernel closes its sockets,
and the other end of each reads an end of file at once. A heartbeat cannot tell that quickly: a rank must miss
several beats before the others may call it gone, and a shorter silence would take a rank on a loaded machine for
a dead one. So every rank (under ``trainer.on_failure=continue``) listens on a TCP port of its own, published in
the run's store, and holds one connection to each of the peers it watches: its two neighbours in the ring of the
active ranks ordered by local index, then node (so that each neighbour is on another node whenever there are two
nodes or more: a whole node lost is seen from the nodes that remain).

On these connections a rank writes, to each of its watchers, a beat (one byte) every ``beat_s``; and a farewell
when it leaves the run on purpose (it finished, was evicted, or was removed as hung and woke up), before it closes
them. An end of file without a farewell is the mark of a process that ended unplanned: the watcher appends the
peer's rank to one list in the store, and the survivors agreeing on a loss (``engine/elastic/failures.py``) take a
rank on that list for gone at once. A watched peer from which nothing came for ``silent_s`` (a hung process keeps
its sockets open; a machine that lost power or its network sends nothing) is reported silent, under the
membership's generation, and the report is withdrawn when it is heard again: the survivors take it for gone too,
without reading its beats in the store, which is what lets a world of a thousand ranks beat without a thousand
writes to the store every 0.2 s (the heartbeat then writes there far less often: ``engine/elastic/heartbeat.py``).

A rank that sees a collective fail passes an alarm on to its peers, both ways, and each passes it on in turn, once:
every rank learns of the failure within a few hops of the ring and ends its own wait, without polling the store. The
survivors' decision travels the same way (:meth:`Presence.announce`), from the few ranks that read it in the store:
in a large world the others learn it from their neighbours instead of each asking the store.

The connections are kept (``distributed/connections.py``) so that cutting a replaced gloo group never shuts one of
them down, which would read as a farewell-less end of file on both sides.

**Only the run's ranks are heard.** Every connection proves, both ways, that its two ends hold the run's secret
(``distributed/secret.py``) before a byte of it is read as a message: the rank that dials sends a nonce, the one
that accepts answers with a nonce of its own and an HMAC-SHA256 of both under the secret, the dialer answers with
its own HMAC (:data:`MAGIC`). A connection that does not (a stranger's, a port scanner's, a run's of another secret)
is closed within :data:`HANDSHAKE_S` and counted (``rejected``); its bytes are never read as a beat, an alarm or a
decision, and its end is never taken for a peer's. The port listens on the address the others reach this rank at,
not on every interface.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import ipaddress
import os
import queue
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from distributed import board
from distributed.connections import Connections, _inode, forget, keep

BEAT = b"."  # sent to each watcher every beat_s
BYE = b"bye"
ALARM = b"!"  # b"!<generation>\n": a collective of that generation failed
DECISION = b"="  # b"=<generation> <what the survivors of its failure agreed, one line>\n"
SILENT_S = 2.0  # a watched peer that sent nothing for this long is reported silent (the heartbeat's SILENT_S)
BEAT_S = SILENT_S / 4  # a beat to each watcher this often: a silence is four beats missed
CONNECT_TIMEOUT_S = 0.5  # a connection to a peer's port that takes longer is tried again at the next look
LOOK_S = 0.5  # how often the thread looks again for the addresses of peers it does not reach yet
_SIOCGIFADDR = 0x8915
MAGIC = b"RSP1"  # a dialer's first bytes: then its nonce
NONCE_BYTES, MAC_BYTES = 16, 32
HANDSHAKE_S = 2.0  # a connection that has not proved it holds the secret by then is closed
MAX_HANDSHAKES = 64  # connections proving at once; one more is closed at once (a flood holds no more descriptors)


def _mac(secret: bytes, side: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, side + first + second, hashlib.sha256).digest()


def _listen(address: str) -> socket.socket:
    """A port on ``address`` (where this host has it), else on every interface."""
    try:
        return socket.create_server((address, 0))
    except OSError:
        return socket.create_server(("0.0.0.0", 0))


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


def ring_order(ranks: list[int], nodes: list[str]) -> list[int]:
    """``ranks`` (the active ones; ``nodes``: rank -> node name) in the order of the ring the presences form: by
    their index on their node, then by node, so that ranks next to each other are on different nodes whenever the
    ranks span two nodes or more (a node's first rank, then every other node's first rank, then their seconds...)."""
    order_of_nodes: dict[str, int] = {}
    place: dict[int, tuple[int, int]] = {}  # rank -> (its index on its node, its node's order)
    seen: dict[str, int] = {}
    for r in ranks:  # (ranks in order: a node's lowest rank first, so node order is that of the lowest ranks)
        node = nodes[r] if r < len(nodes) else f"rank{r}"  # (a rank whose node is not known yet: one of its own)
        order_of_nodes.setdefault(node, len(order_of_nodes))
        place[r] = (seen.get(node, 0), order_of_nodes[node])
        seen[node] = place[r][0] + 1
    return sorted(ranks, key=place.__getitem__)


def ring_neighbours(rank: int, ranks: list[int], nodes: list[str]) -> set[int]:
    """The ranks ``rank`` watches: its two neighbours in :func:`ring_order` of ``ranks``, so that a neighbour is on
    another node whenever the ranks span two nodes or more."""
    ring = ring_order(ranks, nodes)
    if rank not in ring or len(ring) < 2:
        return set()
    i = ring.index(rank)
    return {ring[i - 1], ring[(i + 1) % len(ring)]} - {rank}


class Presence:
    """This rank's listening port and its connections to the peers it watches (the module docstring). ``store``:
    a store connection for this object's thread alone; ``key``: a name -> the run's key for it; ``generation``: the
    membership's current generation (silences are reported under it); ``on_alarm(generation)``: called on this
    object's thread when a peer passes on an alarm (:meth:`alarm`); ``on_decision(generation, decision)``: the same
    for a decision (:meth:`announce`); ``neighbours()``: the peers to watch, asked at each beat (without it,
    :meth:`watch` says); ``secret``: the run's, which every connection proves (the module's doc)."""

    def __init__(
        self,
        rank: int,
        store: Any,
        key: Callable[[str], str],
        address: str | None = None,
        generation: Callable[[], int] = lambda: 0,
        on_alarm: Callable[[int], None] | None = None,
        neighbours: Callable[[], set[int]] | None = None,
        beat_s: float = BEAT_S,
        silent_s: float = SILENT_S,
        on_decision: Callable[[int, bytes], None] | None = None,
        secret: bytes = b"",
    ):
        if not secret:
            raise ValueError("a presence needs the run's secret (distributed/secret.py)")
        self.rank, self.store, self.key, self.secret = rank, store, key, secret
        self.generation, self.on_alarm, self.beat_s, self.silent_s = generation, on_alarm, beat_s, silent_s
        self.address = address or reachable_address()
        self._listener = _listen(self.address)
        self._listener.setblocking(False)
        self._accepted: list[socket.socket] = []  # the watchers' connections to this rank, proved
        # Connections still to prove they hold the secret: accepted ones (-> what is expected next, the nonce this
        # rank sent or b"", the deadline, the bytes so far) and dialled ones (peer -> the socket, this rank's nonce,
        # the deadline, the bytes so far).
        self._greeting: dict[socket.socket, list[Any]] = {}
        self._dialling: dict[int, list[Any]] = {}
        self.rejected = 0  # connections closed for not proving they hold the secret
        self._watching: dict[int, socket.socket] = {}  # peer -> this rank's connection to its port
        self._wanted: set[int] = set()
        self._ended: set[int] = set()  # peers whose connection ended (with or without a farewell): not redialled
        self.reported: list[int] = []  # peers whose process this rank saw end unplanned, in order
        self._heard: dict[int, float] = {}  # watched peer -> when something last came from it (time.monotonic)
        self._silent: set[int] = set()  # watched peers reported silent and not heard since
        self._reported_in = -1  # the generation under which this rank's silent peers were reported
        self._farewell: set[int] = set()  # watched peers that said farewell (their end follows)
        self._pending: dict[int, bytes] = {}  # a connection's bytes not yet a whole message (by file descriptor)
        self._alarmed = -1  # the latest generation this rank passed an alarm on for
        self._alarm_due = False
        self.on_decision = on_decision
        self._announced: dict[int, bytes] = {}  # generation -> the decision passed on for it (the latest few)
        self._announce_due: list[bytes] = []
        self._beaten = 0.0
        self._rewatch = False  # (the thread's next wake-up looks at the watch again)
        self.neighbours = neighbours  # the peers to watch, asked at each beat (without it: watch())
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # What this rank writes in the store (ends and silences it saw) goes through a thread of its own: a store that
        # is slow to answer (a replicated one under load) must not hold the beats, or its watchers would take this
        # rank for silent in turn.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None

    def _keep(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        keep(("presence", fd), [Connections([(fd, _inode(fd) or "")])])

    def _close(self, sock: socket.socket) -> None:
        self._pending.pop(sock.fileno(), None)
        forget(("presence", sock.fileno()))
        sock.close()

    # ---- the training side -----------------------------------------------------------------------------------------
    def start(self) -> Presence:
        port = self._listener.getsockname()[1]
        self.store.set(self.key(f"presence/{self.rank}"), f"{self.address}:{port}")
        self._thread = threading.Thread(target=self._run, name="relaxsync-presence", daemon=True)
        self._thread.start()
        self._writer = threading.Thread(target=self._write, name="relaxsync-presence-writes", daemon=True)
        self._writer.start()
        return self

    def _write(self) -> None:
        """The writer thread: each write queued, in order, until stopped (a None)."""
        while (job := self._outbox.get()) is not None:
            with contextlib.suppress(Exception):  # (the store gone: the others find the silence by the store's beats)
                job()

    def watch(self, peers: Iterable[int]) -> None:
        """Watch ``peers`` from now on (connections to the others are closed, quietly)."""
        peers = set(peers) - {self.rank}
        with self._lock:
            if peers == self._wanted:
                return
            self._wanted = peers
        self._wake_w.send(b"w")

    def alarm(self, generation: int) -> None:
        """Pass on to every connected peer, both ways, that a collective of ``generation`` failed (once for each
        generation: a peer that learns of it passes it on in turn, so it goes round the ring in both directions)."""
        with self._lock:
            if generation <= self._alarmed:
                return
            self._alarmed, self._alarm_due = generation, True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"a")

    def announce(self, generation: int, decision: bytes) -> None:
        """Pass on to every connected peer, both ways, what the survivors of ``generation``'s failure agreed
        (``decision``: one line, as the store holds it), once for each generation, as :meth:`alarm` does."""
        if b"\n" in decision:
            raise ValueError("a decision passed round the ring is one line")
        with self._lock:
            if generation in self._announced:
                return
            self._announced[generation] = decision
            for old in sorted(self._announced)[:-4]:  # (a few kept: a late copy of an old one is not passed on)
                if old < generation:
                    del self._announced[old]
            self._announce_due.append(DECISION + str(generation).encode() + b" " + decision + b"\n")
        with contextlib.suppress(OSError):
            self._wake_w.send(b"d")

    def unheard_for(self) -> float:
        """Seconds since anything came from the peers this rank watches (0 while it is connected to none)."""
        heard = [self._heard.get(p) for p in list(self._watching)]
        heard = [h for h in heard if h is not None]
        return time.monotonic() - max(heard) if heard else 0.0

    def stop(self, farewell: bool) -> None:
        """Stop watching and close every connection; with ``farewell`` (this rank leaves the run on purpose), first
        tell each watcher so, so that none takes this end for a loss."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"s")
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._outbox.put(None)
        if self._writer is not None:
            self._writer.join(timeout=2.0)  # (what was queued is written first, unless the store holds it)
        for sock in self._accepted:
            if farewell:
                with contextlib.suppress(OSError):
                    sock.setblocking(True)
                    sock.settimeout(0.5)
                    sock.sendall(BYE)
            self._close(sock)
        for sock in [*self._watching.values(), *self._greeting, *(state[0] for state in self._dialling.values())]:
            self._close(sock)
        self._accepted, self._watching, self._greeting, self._dialling = [], {}, {}, {}
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # ---- the thread ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        """Each wake-up reads what came (a beat costs a read and little else: a thousand ranks in one machine's
        simulation each wake several times a second); the rest (the watch, dialling, beats, silences) is done once a
        beat, or when the watch changes."""
        poller, by_fd, due = select.poll(), {}, 0.0  # (poll, not select: descriptors above 1024 work too)
        while not self._stopping:
            now = time.monotonic()
            if now >= due or self._rewatch:
                self._rewatch = False
                if self.neighbours is not None:
                    with contextlib.suppress(Exception):
                        self.watch(self.neighbours())
                with self._lock:
                    wanted = set(self._wanted)
                for peer in [p for p in self._watching if p not in wanted]:
                    self._unwatch(peer)
                for peer in [p for p in self._dialling if p not in wanted]:
                    self._close(self._dialling.pop(peer)[0])
                self._expire_handshakes()
                self._dial([p for p in wanted if p not in self._watching and p not in self._dialling
                            and p not in self._ended])  # fmt: skip
                unreached = any(p not in self._watching and p not in self._ended for p in wanted)
                self._send()
                self._check_silences()
                # (the next beat; a peer not reached yet is tried again every LOOK_S)
                due = min(self._beaten + self.beat_s, now + LOOK_S) if unreached else self._beaten + self.beat_s
                sockets = [self._listener, self._wake_r, *self._accepted, *self._watching.values(), *self._greeting,
                           *(state[0] for state in self._dialling.values())]  # fmt: skip
                if {s.fileno() for s in sockets} != set(by_fd):
                    poller, by_fd = select.poll(), {sock.fileno(): sock for sock in sockets}
                    for fd in by_fd:
                        poller.register(fd, select.POLLIN)
            try:
                events = poller.poll(max(0.0, due - time.monotonic()) * 1000)
            except OSError:  # (interrupted: look again)
                continue
            watched = None
            for fd, _ in events:
                sock = by_fd.get(fd)
                if sock is None:
                    continue
                if sock is self._listener:
                    self._accept()
                    self._rewatch = True  # (a new connection to listen on)
                elif sock is self._wake_r:
                    with contextlib.suppress(OSError):
                        sock.recv(64)
                    self._rewatch = True  # (the watch changed, an alarm is due, or stop)
                elif sock in self._greeting:
                    self._greet(sock)
                    self._rewatch = True  # (a watcher more, or a connection less)
                elif (dialled := next((p for p, st in self._dialling.items() if st[0] is sock), None)) is not None:
                    self._answer(dialled, sock)
                    self._rewatch = True
                else:
                    watched = watched or {s: peer for peer, s in self._watching.items()}
                    if sock in watched:
                        self._read(watched[sock], sock)
                    elif sock in self._accepted:
                        self._read_watcher(sock)
                    if sock.fileno() == -1:  # (closed in there: it leaves the poll)
                        self._rewatch = True
                        with contextlib.suppress(KeyError, ValueError):
                            poller.unregister(fd)
                        by_fd.pop(fd, None)

    def _accept(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            sock, _ = self._listener.accept()
            if len(self._greeting) >= MAX_HANDSHAKES:
                sock.close()
                self.rejected += 1
                return
            sock.setblocking(False)
            self._keep(sock)
            self._greeting[sock] = [b"", time.monotonic() + HANDSHAKE_S, b""]

    def _reject(self, sock: socket.socket) -> None:
        self._close(sock)
        self.rejected += 1

    def _received(self, sock: socket.socket, so_far: bytes, need: int) -> tuple[bytes, bool]:
        """``so_far`` and what came on ``sock``, and whether it ended; reads no more than ``need`` bytes in all (what
        follows a handshake is messages, read as such)."""
        try:
            data = sock.recv(need - len(so_far))
        except BlockingIOError:
            return so_far, False
        except OSError:
            return so_far, True
        return so_far + data, not data

    def _greet(self, sock: socket.socket) -> None:
        """A handshake of a connection this rank accepted: the dialer's nonce, answered; then its proof."""
        state = self._greeting[sock]
        sent, _, so_far = state
        need = len(MAGIC) + NONCE_BYTES if not sent else MAC_BYTES
        so_far, end = self._received(sock, so_far, need)
        if end:
            del self._greeting[sock]
            self._reject(sock)
            return
        state[2] = so_far
        if len(so_far) < need:
            return
        if not sent:
            if not so_far.startswith(MAGIC):
                del self._greeting[sock]
                self._reject(sock)
                return
            theirs, mine = so_far[len(MAGIC) :], os.urandom(NONCE_BYTES)
            try:
                sock.send(mine + _mac(self.secret, b"accept", theirs, mine))  # (48 bytes: the buffer takes them)
            except OSError:
                del self._greeting[sock]
                self._reject(sock)
                return
            state[0], state[2] = mine + theirs, b""
            return
        del self._greeting[sock]
        mine, theirs = sent[:NONCE_BYTES], sent[NONCE_BYTES:]
        if not hmac.compare_digest(so_far, _mac(self.secret, b"dial", mine, theirs)):
            self._reject(sock)
            return
        self._accepted.append(sock)  # (proved: a watcher; its beats go out from the next one)

    def _answer(self, peer: int, sock: socket.socket) -> None:
        """A handshake of a connection this rank dialled: the peer's nonce and proof, then this rank's proof."""
        state = self._dialling[peer]
        _, mine, _, so_far = state
        so_far, end = self._received(sock, so_far, NONCE_BYTES + MAC_BYTES)
        state[3] = so_far
        if not end and len(so_far) < NONCE_BYTES + MAC_BYTES:
            return
        del self._dialling[peer]
        theirs, proof = so_far[:NONCE_BYTES], so_far[NONCE_BYTES:]
        if end or not hmac.compare_digest(proof, _mac(self.secret, b"accept", mine, theirs)):
            self._reject(sock)  # (not the peer's port, or not the peer: tried again at the next look)
            return
        try:
            sock.send(_mac(self.secret, b"dial", theirs, mine))
        except OSError:
            self._reject(sock)
            return
        self._watching[peer] = sock
        self._heard[peer] = time.monotonic()  # (proved: its beats come from now on)

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        for sock in [s for s, state in self._greeting.items() if now > state[1]]:
            del self._greeting[sock]
            self._reject(sock)
        for peer in [p for p, state in self._dialling.items() if now > state[2]]:
            self._reject(self._dialling.pop(peer)[0])

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
            nonce = os.urandom(NONCE_BYTES)
            try:
                sock.sendall(MAGIC + nonce)
            except OSError:
                sock.close()
                continue
            sock.setblocking(False)
            self._keep(sock)
            self._dialling[peer] = [sock, nonce, time.monotonic() + HANDSHAKE_S, b""]  # (watched once it proves)

    def _unwatch(self, peer: int) -> None:
        """Stop watching ``peer`` (no longer a neighbour): quietly, and a silence reported of it is withdrawn (its
        new watchers report it again if it is still silent)."""
        self._close(self._watching.pop(peer))
        self._heard.pop(peer, None)
        if peer in self._silent:
            self._silent.discard(peer)
            self._report(peer, False)

    def _messages(self, sock: socket.socket) -> tuple[list[bytes], bool]:
        """The whole messages that came on ``sock`` (beats, farewells, alarms), and whether it ended."""
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return [], False
        except OSError:  # (reset: the peer's kernel dropped the connection)
            data = b""
        if not data:
            return [], True
        buffer, messages = self._pending.pop(sock.fileno(), b"") + data, []
        while buffer:
            if buffer[:1] == BEAT:
                messages.append(BEAT)
                buffer = buffer[1:]
            elif buffer.startswith(BYE):
                messages.append(BYE)
                buffer = buffer[len(BYE) :]
            elif buffer[:1] in (ALARM, DECISION) and b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                messages.append(line)
            elif buffer[:1] in (ALARM, DECISION) or BYE.startswith(buffer):  # (the rest of it comes with the next read)
                self._pending[sock.fileno()] = buffer
                break
            else:  # (nothing this module writes: skipped)
                buffer = buffer[1:]
        return messages, False

    def _alarms(self, messages: list[bytes]) -> None:
        """Alarms and decisions among ``messages``: each heard once, and passed on at once, from this thread (not at
        its next wake-up: a decision crosses the ring in as many hops as there are ranks between its relays)."""
        passing = False
        for message in messages:
            if message[:1] == ALARM and message[1:].isdigit():
                generation = int(message[1:])
                if generation > self._alarmed and self.on_alarm is not None:
                    with contextlib.suppress(Exception):
                        self.on_alarm(generation)
                self.alarm(generation)  # (passed on, once)
                passing = True
            elif message[:1] == DECISION:
                head, _, decision = message[1:].partition(b" ")
                if not head.isdigit() or not decision:
                    continue
                generation = int(head)
                if generation not in self._announced and self.on_decision is not None:
                    with contextlib.suppress(Exception):
                        self.on_decision(generation, decision)
                self.announce(generation, decision)  # (passed on, once)
                passing = True
        if passing:
            self._send()

    def _read(self, peer: int, sock: socket.socket) -> None:
        """What came from a watched peer: beats, an alarm, its farewell, its end."""
        messages, end = self._messages(sock)
        if messages:
            self._heard[peer] = time.monotonic()
            if BYE in messages:
                self._farewell.add(peer)
            self._alarms(messages)
        if not end:
            return
        farewell = peer in self._farewell
        del self._watching[peer]
        self._heard.pop(peer, None)
        self._silent.discard(peer)
        self._close(sock)
        self._ended.add(peer)
        if farewell:
            return
        with self._lock:
            still_wanted = peer in self._wanted
        if still_wanted:

            def report() -> None:
                with contextlib.suppress(Exception):  # (the store gone too: the silence decides, as before)
                    self.store.append(self.key("presence/ended"), f"{peer},")
                self.reported.append(peer)  # (after the store has it: a reader of both sees it there first)

            self._outbox.put(report)

    def _read_watcher(self, sock: socket.socket) -> None:
        """What came from a watcher: an alarm, or its end (it left, or moved on to other neighbours)."""
        messages, end = self._messages(sock)
        self._alarms(messages)
        if end:
            self._accepted.remove(sock)
            self._close(sock)

    def _send(self) -> None:
        """A beat to every watcher when one is due, and an alarm or a decision to every peer, both ways, when one
        is."""
        now, out = time.monotonic(), []
        if now - self._beaten >= self.beat_s:
            self._beaten = now
            out += [(sock, BEAT) for sock in self._accepted]
        with self._lock:
            due, self._alarm_due = self._alarm_due, False
            alarm = ALARM + str(self._alarmed).encode() + b"\n"
            decisions, self._announce_due = self._announce_due, []
        if due:
            out += [(sock, alarm) for sock in [*self._accepted, *self._watching.values()]]
        out += [(sock, d) for d in decisions for sock in [*self._accepted, *self._watching.values()]]
        for sock, data in out:
            with contextlib.suppress(OSError):  # (a full buffer: the peer reads nothing, and its silence tells)
                sock.send(data)

    def _check_silences(self) -> None:
        """Report in the store each watched peer that has sent nothing for ``silent_s`` (hung, or cut off), under
        the current generation, and withdraw the report once it is heard again."""
        generation, now = self.generation(), time.monotonic()
        if generation != self._reported_in:  # (a new generation: its list starts with the silences that go on)
            self._reported_in = generation
            for peer in sorted(self._silent):
                self._report(peer, True)
        for peer, sock in list(self._watching.items()):
            silent = now - self._heard.get(peer, now) >= self.silent_s
            if silent and peer not in self._silent:
                self._read(peer, sock)  # (what waits unread came while this thread was held: not a silence)
                if peer not in self._watching or now - self._heard.get(peer, now) < self.silent_s:
                    continue
                self._silent.add(peer)
                self._report(peer, True)
            elif not silent and peer in self._silent:
                self._silent.discard(peer)
                self._report(peer, False)

    def _report(self, peer: int, silent: bool) -> None:
        """This rank's word on ``peer``, on the generation's board of silences: ``"+<when it was last heard>"`` (the
        wall clock's seconds) while it is ``silent``, ``"-"`` once heard again; one entry per peer and watcher, which
        only that watcher writes (on etcd, a key no one else touches: distributed/board.py)."""
        word = "-"
        if silent:  # (by the wall clock, for the other nodes to read how long it has been silent, give or take skew)
            quiet_s = time.monotonic() - self._heard.get(peer, time.monotonic() - self.silent_s)
            word = f"+{time.time() - quiet_s:.2f}"
        name, member = self.key(f"presence/silent/{self.generation()}"), f"{peer}.{self.rank}"
        self._outbox.put(lambda: board.post(self.store, name, member, word))


def ended(store: Any, key: Callable[[str], str]) -> set[int]:
    """The ranks some watcher saw end without a farewell, so far (read from ``store``)."""
    name = key("presence/ended")
    if not store.check([name]):
        return set()
    return {int(r) for r in store.get(name).decode().split(",") if r}


def silent(store: Any, key: Callable[[str], str], generation: int) -> set[int]:
    """The ranks a watcher reports silent under ``generation`` and has not heard again since (read from ``store``)."""
    return set(silences(store, key, generation))


def silences(store: Any, key: Callable[[str], str], generation: int) -> dict[int, float]:
    """:func:`silent`'s ranks, each with the latest moment one of its watchers last heard it (wall clock seconds; 0
    where a report does not say)."""
    heard: dict[int, float] = {}
    for member, word in board.entries(store, key(f"presence/silent/{generation}")).items():
        if word.startswith("+"):
            rank = int(member.split(".")[0])
            try:
                at = float(word[1:]) if len(word) > 1 else 0.0
            except ValueError:
                at = 0.0
            heard[rank] = max(heard.get(rank, 0.0), at)
    return heard
