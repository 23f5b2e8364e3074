"""Presence (distributed/presence.py): a watched peer's process that ends unplanned is reported at once; one that
says farewell, or that is only stopped (hung), is not; cutting a gloo group noted beside it leaves it alone."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from distributed.connections import cut, keep, noted
from distributed.presence import Presence, ended, reachable_address, ring_neighbours, silent

ROOT = Path(__file__).resolve().parents[1]
SECRET = b"the presence tests' run secret"
PEER = textwrap.dedent(
    """
    import sys, time, datetime
    import torch.distributed as dist
    from distributed.presence import Presence
    SECRET = b"the presence tests' run secret"
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=30))
    presence = Presence(1, store, lambda name: "run/" + name, address="127.0.0.1", secret=SECRET).start()
    print("ready", flush=True)
    if sys.stdin.readline().strip() == "farewell":
        presence.stop(farewell=True)
    print("done", flush=True)
    time.sleep(0.2)
    """
)


def key(name: str) -> str:
    return "run/" + name


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))
    yield server


def start_peer(store) -> subprocess.Popen:
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, str(store.port)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert peer.stdout.readline().strip() == "ready"
    return peer


def watching(store, peers=(1,), **options) -> Presence:
    presence = Presence(0, store.clone(), key, address="127.0.0.1", secret=SECRET, **options).start()
    presence.watch(peers)
    deadline = time.monotonic() + 10
    while not all(p in presence._watching for p in peers):
        assert time.monotonic() < deadline, "never connected to the peer's port"
        time.sleep(0.01)
    return presence


def wait_reported(presence: Presence, timeout_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while not presence.reported and time.monotonic() < deadline:
        time.sleep(0.01)
    return list(presence.reported)


@pytest.mark.parametrize("descriptors", ["few", "above 1024"])
def test_a_killed_peer_is_reported_in_the_store_at_once(store, descriptors):
    """Also where the process holds so many files that the presence's sockets are numbered above 1024 (as a worker
    with many loaders and libraries may): ``select`` cannot wait on those, ``poll`` can."""
    held = [os.dup(0) for _ in range(1100)] if descriptors != "few" else []
    peer = start_peer(store)
    presence = watching(store)
    assert descriptors == "few" or min(s.fileno() for s in presence._watching.values()) > 1024
    try:
        killed = time.monotonic()
        peer.send_signal(signal.SIGKILL)
        peer.wait()
        assert wait_reported(presence) == [1]
        assert ended(store, key) == {1}
        # (not a time limit on this machine: that its end is read as it happens, not after a silence of seconds)
        assert time.monotonic() - killed < 5
    finally:
        presence.stop(farewell=False)
        for fd in held:
            os.close(fd)


def test_a_peer_that_says_farewell_is_not_reported_and_a_stopped_one_neither(store):
    peer = start_peer(store)
    presence = watching(store)
    try:
        peer.send_signal(signal.SIGSTOP)  # hung: its sockets stay open, so only its silence can tell
        time.sleep(0.5)
        assert presence.reported == [] and ended(store, key) == set()
        peer.send_signal(signal.SIGCONT)
        peer.stdin.write("farewell\n")
        peer.stdin.flush()
        assert peer.stdout.readline().strip() == "done"
        peer.wait(timeout=10)
        time.sleep(0.3)
        assert presence.reported == [] and ended(store, key) == set()
        assert 1 not in presence._watching  # its connection ended and is not dialled again
    finally:
        presence.stop(farewell=False)


def test_a_stopped_peer_is_reported_silent_under_the_generation_and_withdrawn_once_it_beats_again(store):
    """Its beats stop coming (SIGSTOP keeps its sockets open): after ``silent_s`` its watcher reports it silent under
    the membership's generation, in the store, without anyone reading beats there; when it beats again the report
    is withdrawn. A new generation's list starts with the silences that go on."""
    generation = [3]
    peer = start_peer(store)
    presence = watching(store, generation=lambda: generation[0], silent_s=1.2)
    try:
        time.sleep(1.5)
        assert silent(store, key, 3) == set() and presence.unheard_for() < 1.2  # (beating: heard every 0.5 s)
        peer.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while silent(store, key, 3) != {1}:
            assert time.monotonic() < deadline, "never reported silent"
            time.sleep(0.05)
        assert presence.unheard_for() >= 1.2 and presence.reported == []  # (silent, not ended)
        generation[0] = 4
        deadline = time.monotonic() + 5
        while silent(store, key, 4) != {1}:
            assert time.monotonic() < deadline, "not reported again under the new generation"
            time.sleep(0.05)
        peer.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 5
        while silent(store, key, 4):
            assert time.monotonic() < deadline, "the report was never withdrawn"
            time.sleep(0.05)
        assert ended(store, key) == set()
    finally:
        peer.send_signal(signal.SIGCONT)
        presence.stop(farewell=False)
        peer.kill()
        peer.wait()


def test_a_peer_heard_while_this_thread_was_held_is_not_reported_silent(store):
    """Beats that came while the watcher's own thread could not run (its process stopped, its machine busy) wait in
    the socket: they are read before a silence is reported."""
    import socket
    import threading

    presence = Presence(0, store.clone(), key, address="127.0.0.1", secret=SECRET, silent_s=0.5)
    presence._writer = threading.Thread(target=presence._write, daemon=True)  # (its writes; not its own thread)
    presence._writer.start()
    ours, theirs = socket.socketpair()
    try:
        ours.setblocking(False)
        presence._watching[1] = ours
        presence._heard[1] = time.monotonic() - 5  # (nothing read for 5 s...)
        theirs.send(b"...")  # (...but its beats are there)
        presence._check_silences()
        time.sleep(0.3)
        assert silent(store, key, 0) == set() and 1 not in presence._silent
        presence._heard[1] = time.monotonic() - 5
        presence._check_silences()  # (now nothing waits: silent)
        deadline = time.monotonic() + 5
        while silent(store, key, 0) != {1}:
            assert time.monotonic() < deadline, "never reported"
            time.sleep(0.02)
    finally:
        presence._watching.clear()
        ours.close()
        theirs.close()
        presence.stop(farewell=False)


def connect_ring(ring: list[Presence]) -> None:
    """Each presence of ``ring`` (rank = its place) watches its two neighbours; returns once every one is connected."""
    for r, presence in enumerate(ring):
        presence.watch(ring_neighbours(r, list(range(len(ring))), ["node"] * len(ring)))
    deadline = time.monotonic() + 10
    while not all(len(p._watching) == 2 and len(p._accepted) == 2 for p in ring):
        assert time.monotonic() < deadline, "the ring never connected"
        time.sleep(0.02)


def test_an_alarm_goes_round_the_ring_both_ways_once(store):
    """A rank that saw a collective fail passes an alarm to its peers; each passes it on once, on its watchers'
    connections and its own: every rank of the ring hears of it, the one that raised it does not hear it back."""
    heard: dict[int, list[int]] = {r: [] for r in range(5)}
    ring = [
        Presence(
            r, store.clone(), key, address="127.0.0.1", secret=SECRET, on_alarm=lambda g, r=r: heard[r].append(g)
        ).start()
        for r in range(5)
    ]
    try:
        connect_ring(ring)
        ring[2].alarm(7)
        ring[2].alarm(7)  # (once)
        deadline = time.monotonic() + 5
        while not all(heard[r] for r in (0, 1, 3, 4)):
            assert time.monotonic() < deadline, f"not everyone heard: {heard}"
            time.sleep(0.02)
        time.sleep(0.3)
        assert heard == {0: [7], 1: [7], 2: [], 3: [7], 4: [7]}
        ring[4].alarm(6)  # (an older generation than one passed on already: nothing)
        time.sleep(0.3)
        assert heard[0] == [7]
    finally:
        for presence in ring:
            presence.stop(farewell=False)


def test_a_decision_goes_round_the_ring_both_ways_once_and_arrives_whole(store):
    """A decision announced by one rank reaches every other rank of the ring through its neighbours, each hearing it
    once, byte for byte (a line longer than one read of a connection, split across reads), while the beats go on."""
    heard: dict[int, list[tuple[int, bytes]]] = {r: [] for r in range(6)}
    ring = [
        Presence(
            r,
            store.clone(),
            key,
            address="127.0.0.1",
            secret=SECRET,
            on_decision=lambda g, d, r=r: heard[r].append((g, d)),
        ).start()
        for r in range(6)
    ]
    decision = json.dumps({"ranks": [9], "cause": "died", "pad": "x" * 6000}).encode()
    try:
        connect_ring(ring)
        ring[1].announce(4, decision)
        ring[1].announce(4, b"something else")  # (once per generation: the first one holds)
        deadline = time.monotonic() + 5
        while not all(heard[r] for r in (0, 2, 3, 4, 5)):
            assert time.monotonic() < deadline, f"not everyone heard: {[r for r in heard if not heard[r]]}"
            time.sleep(0.02)
        time.sleep(0.3)
        assert heard == {r: ([] if r == 1 else [(4, decision)]) for r in range(6)}
        assert all(p.unheard_for() < 1.0 for p in ring)  # (the beats read as beats around it)
        with pytest.raises(ValueError, match="one line"):
            ring[0].announce(5, b"two\nlines")
    finally:
        for presence in ring:
            presence.stop(farewell=False)


def test_a_peer_no_longer_watched_is_dropped_quietly_and_its_end_is_not_reported(store):
    peer = start_peer(store)
    presence = watching(store)
    try:
        presence.watch([])
        deadline = time.monotonic() + 5
        while 1 in presence._watching:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        peer.kill()
        peer.wait()
        time.sleep(0.3)
        assert presence.reported == [] and ended(store, key) == set()
    finally:
        presence.stop(farewell=False)


def test_cutting_a_group_noted_while_a_presence_connection_was_made_leaves_that_connection_alone(store):
    """A group noted while the presence thread dialled holds the presence socket in its noted set; cutting the group
    must not shut it down (it would read as an unplanned end on both sides)."""
    peer = start_peer(store)
    try:
        with noted(store.port) as made:
            presence = watching(store)
        assert made and made[0].sockets, "the presence connection was made inside the block"
        keep("a group", made)
        cut(["a group"])
        time.sleep(0.3)
        assert presence.reported == [] and 1 in presence._watching
        presence.stop(farewell=False)
    finally:
        peer.kill()
        peer.wait()


def test_the_watched_ranks_are_the_ring_neighbours_by_local_index_then_node():
    nodes = ["a", "a", "b", "b", "c", "c"]  # 3 nodes of 2: ring a0 b0 c0 a1 b1 c1
    assert ring_neighbours(0, list(range(6)), nodes) == {5, 2}
    assert ring_neighbours(2, list(range(6)), nodes) == {0, 4}
    for r in range(6):  # every neighbour on another node, and every rank watched by two
        assert all(nodes[n] != nodes[r] for n in ring_neighbours(r, list(range(6)), nodes))
    assert sum(r in ring_neighbours(w, list(range(6)), nodes) for w in range(6) for r in [3]) == 2
    assert ring_neighbours(0, [0, 1], ["a", "b"]) == {1}
    assert ring_neighbours(0, [0], ["a"]) == set()
    assert ring_neighbours(7, [0, 1], ["a", "b"]) == set()  # not active: watches nobody
    assert ring_neighbours(3, [0, 3, 5], ["a", "a", "a", "a", "a", "a"]) == {0, 5}  # one node: its own ranks


def test_the_address_published_is_the_gloo_interfaces_or_the_one_towards_the_store():
    assert reachable_address({"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    ipaddress.ip_address(reachable_address({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}))


def test_a_rank_that_cannot_listen_still_beats_and_says_so(store, monkeypatch, capsys):
    """No port to listen on (an OSError from the presence) leaves the heartbeat beating: a loss of this rank is then
    seen by its silence, as before."""
    import engine.elastic.heartbeat as heartbeat_module
    from distributed.membership import Membership

    def refuse(*args, **kwargs):
        raise OSError(99, "Cannot assign requested address")

    monkeypatch.setattr(heartbeat_module, "Presence", refuse)
    membership = Membership(0, 2, group=None)
    membership._store = store
    beat = heartbeat_module.Heartbeat(membership)
    beat.start()
    try:
        deadline = time.monotonic() + 5
        while not (store.check([beat.key(0)]) and int(store.get(beat.key(0))) >= 2):
            assert time.monotonic() < deadline, "the heartbeat never beat"
            time.sleep(0.05)
    finally:
        beat.stop()
    assert beat.presence is None
    assert "cannot listen for its watchers" in capsys.readouterr().err
