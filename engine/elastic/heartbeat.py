"""Every rank's heartbeat (``trainer.on_failure=continue``): a background thread that beats this rank's counter in
the store and, in a small world, reads its peers' in turn, so that when a collective fails how long each peer has
been silent is already known (``failures.py`` decides with it), and that rings the membership's alarm once another
rank checked in to a failure of the current generation. Beside it, the rank's presence (``distributed/presence.py``)
beats to its watchers directly, reports its watched neighbours' ends and silences, and passes alarms round the ring:
in a world of more than :data:`WATCHED` + 1 ranks that is how silences and alarms travel, and the store hears each
rank's beat only every :func:`store_period` (the store then serves :data:`STORE_BEATS_S` beats a second in all)."""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from distributed.membership import LOOKS_S, SMALL_WORLD, Membership, StoreLoop, look_period
from distributed.presence import Presence, ring_neighbours

BEAT_S = 0.2  # heartbeat period
SILENT_S = 2.0  # a rank that has not beaten for this long (10 beats) is gone
WATCHED = SMALL_WORLD - 1  # peers whose beats one tick reads, in turn (all of them every tick up to 17 ranks)
# A rank whose beats have not reached the store for this long may be on the side of a partition that the others are
# about to give up (after SILENT_S): it stops where it is until the store answers again (engine/elastic/guard.py).
FENCE_S = SILENT_S / 2
STORE_BEATS_S = LOOKS_S  # beyond WATCHED + 1 ranks: the beats a second the store is asked to take, from all ranks


def store_period(ranks: int) -> float:
    """How often a rank of a world of ``ranks`` beats in the store: every :data:`BEAT_S` up to :data:`WATCHED` + 1
    ranks (each tick reads every peer's beat there); beyond, so that all of them together write
    :data:`STORE_BEATS_S` beats a second (every 10 s at 1024 ranks: an etcd cluster serves a few thousand writes a
    second, where 1024 ranks beating every 0.2 s would ask 5,000), their silences being reported by their
    watchers instead (``distributed/presence.py``)."""
    return look_period(BEAT_S, ranks)  # (WATCHED + 1 = SMALL_WORLD, STORE_BEATS_S = LOOKS_S)


class Heartbeat:
    """A background thread that sets this rank's beat counter in the store, one more each :func:`store_period`.

    Up to :data:`WATCHED` + 1 ranks it beats every :data:`BEAT_S` and, in the same tick, reads every other rank's
    counter (one ``multi_get``): when a collective fails, how long each peer has already been silent is known by
    this rank's clock, so a peer that hung long before is recognised at once instead of after watching it for
    another :data:`SILENT_S`; the tick also checks whether another rank checked in to a failure of the current
    generation (:meth:`_listen`). Beyond, the thread wakes only to beat in the store, and reads nothing there: each
    rank's presence beats to its watchers, who report its silence, and passes alarms on round the ring. Reading
    every peer every tick would have the store serve N² keys per tick, 5 million a second at 1024 ranks; beating
    every tick, 5,000 writes a second, more than an etcd cluster serves."""

    def __init__(self, membership: Membership, alarmed: Callable[[Any, int], bool] | None = None):
        self.membership = membership
        self.alarmed = alarmed  # (store, generation) -> whether a rank checked in to a failure of it
        self._loop: StoreLoop | None = None
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (beat count, when it last changed: time.monotonic)
        self._next = 0  # where among the active ranks the next tick's reads begin
        self.presence: Presence | None = None  # this rank's port and its watch on its neighbours' processes
        self._neighbours_of: list[int] | None = None  # the active ranks the presence's watch was worked out for
        self._ring: set[int] = set()
        self.beaten_at: float | None = None  # when a beat last reached the store (time.monotonic)
        self.period_s = BEAT_S  # how often this rank beats in the store (store_period)
        self._decisions: dict[int, bytes] = {}  # generation -> the decision a peer passed on (Presence.announce)
        self._decided = threading.Condition()

    def key(self, rank: int) -> str:
        return self.membership.key(f"beat/{rank}")

    def seen(self) -> dict[int, tuple[int, float]]:
        """Each peer's last beat count read by the thread, and when it was first read at that count."""
        return dict(self._seen)

    def start(self) -> None:
        m = self.membership
        own = self.key(m.rank)
        try:
            generation = lambda: m.generation  # noqa: E731
            self.presence = Presence(
                m.rank, m.store.clone(), m.key, None, generation, self._passed_on, self._neighbours,
                on_decision=self._heard, secret=m.secret,
            ).start()  # fmt: skip
        except OSError as error:  # (no port to listen on: the peers still find this rank's end by its silence)
            print(f"relaxsync: rank {m.rank} cannot listen for its watchers ({error}); a loss of it is seen by its "
                  f"silence only", file=sys.stderr, flush=True)  # fmt: skip

        count, written = itertools.count(1), [0.0]

        def beat(store: Any) -> bool:
            small = len(m.ranks) <= WATCHED + 1
            self.period_s = store_period(len(m.ranks))
            if time.monotonic() - written[0] >= self.period_s - BEAT_S / 2:  # (every tick in a small world)
                store.set(own, str(next(count)))  # (a write of one key: not ``add``, which a replicated store reads)
                written[0] = time.monotonic()
                if self.overdue() <= FENCE_S:  # (after a longer silence the loop asks the store first: revive)
                    self.beaten_at = written[0]
            if self._loop is not None:  # (beyond a small world the thread wakes only to beat in the store)
                self._loop.period_s = BEAT_S if small else self.period_s
            try:
                if small:  # (beyond, the presence reports silences and passes alarms on)
                    self._watch(store)
                    self._listen(store)
            except Exception:  # a failed read must not stop the beats that tell the others this rank is alive
                pass
            return False  # beat until stopped

        self._beat, self.beaten_at = beat, time.monotonic()  # (silent from here until a beat reaches the store)
        self._loop = self.membership.every(BEAT_S, beat, "relaxsync-heartbeat", hurried=True).start()

    def silent_for(self) -> float:
        """Seconds since this rank's last beat reached the store, or since it started beating (0 when not beating)."""
        if self._loop is None or self.beaten_at is None:
            return 0.0
        return time.monotonic() - self.beaten_at

    def overdue(self) -> float:
        """Seconds by which this rank's next beat in the store is late (:meth:`silent_for` less the period)."""
        return max(0.0, self.silent_for() - (self.period_s - BEAT_S))

    def cut_off(self) -> bool:
        """Whether this rank may be cut off from the others: its beats have not reached the store for
        :data:`FENCE_S` past their period, or nothing came from the peers it watches for as long (where the store
        hears it only every few seconds, that is what tells first)."""
        presence = self.presence
        return self.overdue() > FENCE_S or (presence is not None and presence.unheard_for() > FENCE_S)

    def alarm(self, generation: int) -> None:
        """This rank saw a collective of ``generation`` fail: its peers hear of it through the presence."""
        if self.presence is not None:
            self.presence.alarm(generation)

    def announce(self, generation: int, decision: bytes) -> None:
        """Pass ``decision`` (what the survivors of ``generation``'s failure agreed, as the store holds it) round the
        ring: the peers that have not read it in the store learn it from their neighbours."""
        self._heard(generation, decision)
        if self.presence is not None:
            self.presence.announce(generation, decision)

    def decision(self, generation: int, timeout_s: float) -> bytes | None:
        """The decision on ``generation``'s failure that a peer passed on, waiting for it up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._decided:
            while generation not in self._decisions and (left := deadline - time.monotonic()) > 0:
                self._decided.wait(left)
            return self._decisions.get(generation)

    def _heard(self, generation: int, decision: bytes) -> None:
        """A peer passed on a decision (on the presence's thread): kept for :meth:`decision`, and the alarm rung if it
        is the current generation's (this rank may still be waiting on a collective that fails nowhere here)."""
        with self._decided:
            self._decisions[generation] = decision
            for old in [g for g in self._decisions if g < generation - 2]:
                del self._decisions[old]
            self._decided.notify_all()
        self._passed_on(generation)

    def _passed_on(self, generation: int) -> None:
        """A peer passed on an alarm of ``generation`` (on the presence's thread): ring it if it is the current one."""
        m = self.membership
        if generation == m.generation and m.alarm.rung(generation) is None:
            m.ring(generation, f"relaxsync: a peer saw a collective fail (failure {generation}): a peer is lost")

    def revive(self) -> None:
        """The loop has asked the store what the others decided while this rank was silent (``guard.py``): its
        beats count again, and it beats again if the store had stopped answering (the loop ends at a store error).

        Until then a beat does not end the silence: a rank stopped for seconds (a stopped process, a stalled
        machine) whose thread beats again first would otherwise go on with its loop as if nothing had happened,
        training local steps and writing their records, though the others may have removed it meanwhile."""
        self.beaten_at = time.monotonic()
        if self._loop is not None and not self._loop.running():
            self._loop = self.membership.every(BEAT_S, self._beat, "relaxsync-heartbeat", hurried=True).start()

    def _neighbours(self) -> set[int]:
        """This rank's ring neighbours among the active ranks, which its presence watches (asked on the presence's
        thread at each of its beats), worked out again only when the active ranks change (a change replaces the
        list)."""
        m, ranks = self.membership, self.membership.ranks
        if self._neighbours_of is not ranks:
            self._ring, self._neighbours_of = ring_neighbours(m.rank, ranks, m.nodes), ranks
        return self._ring

    def _watch(self, store: Any) -> None:
        """Read the next peers' beats. Peers silent for :data:`SILENT_S` are most likely gone: the group the others
        would form without them is formed now, in the background, for the recovery to take when a collective fails
        (up to ``WATCHED + 1`` ranks, where every tick reads every peer)."""
        m = self.membership
        generation, ranks = m.generation, m.ranks  # (a change replaces the list, never edits it)
        peers, i = [], self._next
        while len(peers) < min(WATCHED, len(ranks) - 1):
            if ranks[i % len(ranks)] != m.rank:
                peers.append(ranks[i % len(ranks)])
            i += 1
        self._next = i % max(len(ranks), 1)
        keys = [self.key(r) for r in peers]
        if any(r not in self._seen for r in peers) and not store.check(keys):
            peers = [r for r, k in zip(peers, keys) if store.check([k])]  # (a peer's first beat may not be there yet)
            keys = [self.key(r) for r in peers]
        if not keys:
            return
        now = time.monotonic()
        for r, value in zip(peers, store.multi_get(keys)):
            beats = int(value)
            if self._seen.get(r, (None, 0.0))[0] != beats:
                self._seen[r] = (beats, now)
        silent = [r for r in peers if now - self._seen[r][1] >= SILENT_S]
        survivors = [r for r in ranks if r not in silent]
        unchanged = generation == m.generation and ranks is m.ranks  # (read while no change was under way)
        if silent and len(survivors) > 1 and len(ranks) <= WATCHED + 1 and unchanged:
            m.prepare(survivors, generation)  # (every peer read every tick: the survivors see the same ones silent)

    def _listen(self, store: Any) -> None:
        """Ring the membership's alarm once another rank has checked in to a failure of the current generation:
        this rank may be waiting on a collective that nothing will fail here (distributed/alarm.py)."""
        m = self.membership
        generation = m.generation
        if self.alarmed is None or m.alarm.rung(generation) is not None:
            return
        if self.alarmed(store, generation):
            m.ring(generation, f"relaxsync: another rank saw a collective fail (failure {generation}): a peer is lost")

    def stop(self, farewell: bool = True) -> None:
        """Stop beating and watching; ``farewell``: this rank leaves the run on purpose (it finished, or was removed),
        which its watchers are told (an end without it is taken for a loss: ``distributed/presence.py``)."""
        if self._loop is not None:
            self._loop.stop()
            self._loop = None
        if self.presence is not None:
            self.presence.stop(farewell)
            self.presence = None
