"""Shrink in place (``trainer.on_failure: continue``): when a peer dies or hangs, the survivors agree who is gone,
form a new group and redo the part of the loop they were in, under whatever sync algorithm runs. This module is
the agreement; ``engine/elastic/guard.py`` is the component that wraps the loop's parts in it.

Every collective of such a run has a deadline, ``trainer.hang_timeout_s`` (the timeout of the training process
group), and every rank beats a counter in the c10d store from a background thread (:class:`Heartbeat`). When a
peer is gone a collective then fails on the survivors in one of two ways: at once, with a closed connection
(the peer died and its kernel closed its sockets), or after ``hang_timeout_s`` (the peer hangs: stopped by a
signal, stuck in a file system or a driver). Either way :meth:`Failures.recover` runs on each survivor:

1. it checks in under the membership's generation and waits until every other active rank has either checked
   in too (it saw the failure as well), or has not beaten for :data:`SILENT_S` seconds by this rank's clock, or
   was seen to end by a rank watching its process (``distributed/presence.py``: at once, where a process ends),
   or until another survivor has decided;
2. it proposes the silent ranks for removal (first writer wins, :meth:`Membership.propose`) and adopts what was
   agreed: the survivors form a new group; a removed rank that is still alive (a hung one that wakes up) finds
   the decision already made when its own collective fails, and leaves with status 0 (``LeftRun``) without
   touching the new group;
3. every survivor writes where it was (its :class:`Position`: the step, and the :class:`Phase` of it) and reads
   the others'. What was in flight is redone on the new group. Usually all survivors were at the same point;
   when the peer died inside a collective that some survivors finished and some did not, those that got
   furthest (the front, one collective ahead) go on, and each one left behind is healed from the front
   (:meth:`Failures.heal`): the lowest rank of the front sends it what it needs to enter the loop where the front
   is, as torchft heals a replica from a live peer. Nobody applies a step that the others do not.

The store is torch's, with torchrun's agent on the first node (if that node dies there is nothing to agree
through, and the survivors stop with the store's error), or an etcd cluster that survives any node
(``trainer.store``; docs/failures.md). Either way it is one service for the whole run, so what each rank asks of it
does not grow with the number of ranks: beyond 17 ranks the heartbeat writes there every few seconds and reads
nothing (the watchers report silences: ``distributed/presence.py``). Up to 17 ranks the survivors check in and
write where they were on boards (``distributed/board.py``: on etcd a key per post, which no other post upsets); only
the first few to check in watch the others closely, the rest wait for the decision. Beyond, on torch's store, the
same; on a replicated one (etcd), a thousand survivors asking at the same moment is more than it answers in time,
so most ask it nothing (``engine/elastic/wide.py``): the first ranks of the ring decide from the watchers'
reports, one rank in eight reads the decision and passes it round the ring, and the positions travel
in one collective of the new group (docs/benchmarks/membership.md measures it at up to 1024 ranks).

A dead peer fails a collective at once only on the ranks that exchange with it; the others wait on survivors that
gave that collective up. So a rank that checks in passes an alarm round the ring through its presence, and (up to
17 ranks) every rank's heartbeat thread also looks for a check-in to a failure of the current generation; either
rings the membership's alarm, which ends every wait of that generation on its rank (``distributed/alarm.py``): the
rank then checks in like the others.
"""

from __future__ import annotations

import datetime
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from distributed import board, runstore
from distributed.membership import Change, LeftRun, Membership
from distributed.presence import ended
from distributed.presence import silent as silent_ranks
from distributed.transfer import recv_state, send_state
from engine.elastic.heartbeat import BEAT_S, SILENT_S, WATCHED, Heartbeat
from engine.elastic.positions import Position, left_behind
from engine.elastic.wide import DECIDERS, WideAgreement, gather_positions, wide

TIMED_OUT = re.compile(r"timed out", re.IGNORECASE)
# An agreement that nobody is gone (an alarm that found every rank alive: a collective that failed on its own, a
# flapping link) is survived by regrouping the same ranks and redoing the part; at one part of one step no more
# than this many times, after which the error is this run's own and is raised.
RENEWALS = 3
NOBODY_GONE = "nobody gone"
# What a survivor reads when the peer's process is gone (gloo; NCCL's ncclRemoteError): the loss is "died";
# any other failure of a collective is counted "hung" unless another survivor saw one of these.
DIED = re.compile(r"connection (closed|reset) by peer|broken pipe|remote process exiting prematurely", re.IGNORECASE)


@dataclass(frozen=True)
class Recovery:
    """What the survivors agreed after a failed collective."""

    change: Change  # the ranks removed and the survivors' new group
    event: dict[str, Any]  # the ``rank_lost`` event, the same on every survivor
    where: dict[int, list]  # each survivor's ``[step, phase]`` when its collective failed (read alike by all)
    # Worked out from ``where`` once, when made (a thousand survivors' positions are not read again at every use):
    front: Position = field(init=False)  # the furthest position, where the survivors go on from
    behind: list[int] = field(init=False)  # the survivors one collective short of the front: healed from the source
    source: int = field(init=False)  # the lowest rank at the front

    def __post_init__(self) -> None:
        front, behind = left_behind(self.where)
        object.__setattr__(self, "front", Position.read(front))
        object.__setattr__(self, "behind", behind)
        object.__setattr__(self, "source", min(set(self.where) - set(behind)))


class StoreUnreachable(RuntimeError):
    """The c10d store cannot be reached to agree through: its host is gone, and no survivor can go on."""


def unreachable(rank: int, what: str, error: BaseException, store: Any) -> StoreUnreachable:
    """The error of a rank that cannot reach ``store`` (``what`` it was doing), saying what that means."""
    if runstore.of(store).replicated:  # (etcd answers only where a majority of its members is)
        where = (
            "the etcd cluster of trainer.store has no majority on this side: this rank is cut off from the others, "
            "which go on without it if they hold the majority. It stops rather than train on as a second run"
        )
    else:
        where = (
            "the store lives with torchrun's agent on the first node, which is probably gone too. Continue from the "
            "last checkpoint with trainer.resume=auto (trainer.store=etcd://... survives any node)"
        )
    return StoreUnreachable(
        f"rank {rank} {what} cannot reach the c10d store to agree with the others ({error}); {where}"
    )


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error``'s text says a peer went away (a closed connection, a timed-out collective)."""
    return isinstance(error, RuntimeError) and (TIMED_OUT.search(str(error)) or DIED.search(str(error))) is not None


def may_be_a_loss(error: BaseException) -> bool:
    """Whether a part that raised ``error`` may have lost a peer: any error torch raises (gloo and NCCL raise
    ``RuntimeError`` or its ``DistError`` subclasses), whatever its text, because the texts differ by backend,
    version and moment. The store decides (:meth:`Failures.recover`): when every peer is still beating, ``error``
    is raised again, as it was. Python's own errors (a ``KeyError``, a ``ValueError``), ``NotImplementedError``
    ``LeftRun`` and :class:`StoreUnreachable` never are."""
    ours = (NotImplementedError, RecursionError, StoreUnreachable)
    return isinstance(error, RuntimeError) and not isinstance(error, ours)


class Failures:
    """Agreement on who is gone after a failed collective, and on what the survivors redo."""

    def __init__(self, membership: Membership, hang_timeout_s: float):
        self.membership, self.hang_timeout_s = membership, hang_timeout_s
        self.renewals: dict[tuple[int, str], int] = {}  # (step, phase) -> regroups there with nobody gone
        self.heartbeat = Heartbeat(
            membership, lambda store, generation: board.count(store, self._key(generation, "in"))
        )
        self.wide = WideAgreement(membership, self.heartbeat, hang_timeout_s, lambda g: self._name(g, "decision"))

    @staticmethod
    def _name(generation: int, name: str) -> str:
        return f"failure{generation}/{name}"

    def _key(self, generation: int, name: str) -> str:
        return self.membership.key(self._name(generation, name))

    def recover(self, error: BaseException, at: Position) -> Recovery:
        """Collective over the ranks still alive, after ``error`` (a part that failed, :func:`may_be_a_loss`) at
        ``at``. Returns what was agreed (with nobody gone, every rank there: the same ranks in a new group, a
        ``regrouped`` event; :data:`RENEWALS` times at most at one part of one step); raises ``LeftRun`` on a rank
        that was removed, ``error`` again, as it was, when a peer kept beating without reaching the failure or the
        same part was regrouped too often, and the error of the store or of the new group when another survivor is
        lost while they agree (the caller agrees again, over who is left)."""
        try:
            recovery = self._recover(error, at)
        except runstore.RunEnded:  # (this rank was away, hung, while the others finished and deleted the run's keys)
            raise LeftRun(self.membership.rank, f"found the run ended after its failure at step {at.step}") from None
        except dist.DistError as store_error:
            if self._store_answers():  # a survivor went away during the agreement (a key it never wrote, the new
                raise  # group's first collective): another loss, which the caller agrees on in turn
            m = self.membership
            raise unreachable(m.rank, f"lost a peer at step {at.step} and", store_error, m.store) from error
        if recovery is None:  # (raised out here: an NCCL error is a DistError too, and is not the store's)
            raise error
        return recovery

    def _store_answers(self) -> bool:
        try:
            self.membership.store.check([self._key(self.membership.generation, "decision")])
            return True
        except Exception:  # DistNetworkError: its host is gone
            return False

    def _recover(self, error: BaseException, at: Position) -> Recovery | None:
        m, generation = self.membership, self.membership.generation
        cause = "died" if DIED.search(str(error)) else "hung"
        large = wide(len(m.ranks), m.store)
        if large:
            agreed = self.wide.agree(generation, at)
        else:
            agreed = self.decided(generation)  # (decided without this rank: it was hung, or it is late)
        if agreed is None:
            arrived = self._check_in(generation, m.rank, cause)
            gone, undecided = self._silent_peers(generation, decider=arrived <= DECIDERS)
            if undecided:  # alive, and elsewhere: an error of this rank's own, not a loss
                error.add_note(
                    f"relaxsync: rank(s) {undecided} kept beating but never reached this failure in "
                    f"{self.hang_timeout_s + SILENT_S:.0f} s: no peer is gone"
                )
                return None
            agreed = self.decided(generation)
        if agreed is None:
            # A rank died where its watchers saw its process end (``ended``), at once; one only silent may have hung
            # (a stopped process keeps its connections open). What the survivors' own collectives raised does not
            # tell: a wait cut short by another survivor reads as a closed connection although the peer only hung.
            closed = ended(m.store, m.key)
            died = bool(gone) and set(gone) <= closed
            proposal = {
                "ranks": gone,
                "cause": "died" if died else "hung",
                "noticed": "ended" if died else "silence",  # how the survivors knew
                "step": at.step,
                "time": time.time(),
                "ahead": m.ready([r for r in m.ranks if r not in gone]),  # (the survivors' group is formed already)
            }
            agreed = m.propose(self._name(generation, "decision"), proposal)
        if not agreed["ranks"]:  # (every rank checked in, none silent, none ended: the same ranks go on)
            place = (at.step, at.phase.value)
            self.renewals[place] = self.renewals.get(place, 0) + 1
            if self.renewals[place] > RENEWALS:
                error.add_note(
                    f"relaxsync: every rank was still there after this failure, and the {RENEWALS} regroups at the "
                    f"{at.phase.value} of step {at.step} before it failed the same way"
                )
                return None
            change = m.renew({**agreed, "cause": NOBODY_GONE})
        else:
            what = f"as {agreed['cause']} at step {agreed['step']}"
            reasons = {r: f"was removed from the run {what}" for r in agreed["ranks"]}
            change = m.adopt(agreed, reasons, abort_replaced=True)
            assert change is not None  # adopt raises on a removed rank, and the agreed ranks were active
        if large:  # (in the new group: a thousand survivors do not each write to the store and read every other)
            where = gather_positions(m.group, at, m.wait)
        else:
            where = self._positions(generation, change.ranks, at)
        # Every survivor read the same positions, so all agree on the front and on who is healed from it.
        front, behind = left_behind(where)
        event = {
            "event": "rank_lost" if change.removed else "regrouped",
            "ranks": change.removed,
            "caught_up": behind,  # alive, one collective short of the others: healed from the front
            "cause": change.cause,
            "failed_step": agreed["step"],
            "failed_at": agreed["time"],  # wall clock when the first survivor proposed the removal
            "formed_ahead": bool(agreed.get("ahead")),  # the survivors' group was formed before the failure
            "noticed": agreed.get("noticed", "silence"),  # "ended": seen at once (distributed/presence.py)
            "world_size": len(change.ranks),
            "redo": front[1],
        }
        return Recovery(change, event, where)

    def heal(self, recovery: Recovery, snapshot: Callable[[Position], Any]) -> Any:
        """Collective over the survivors of ``recovery``: its source sends each rank left behind
        ``snapshot(position)`` (built for where that rank was); returns what this rank received (None on a rank
        that was not behind). Over the new group, point to point; nothing is sent when nobody is behind."""
        m = self.membership
        if m.rank == recovery.source:
            for r in recovery.behind:
                send_state(snapshot(Position.read(recovery.where[r])), r, m.group)
        elif m.rank in recovery.behind:
            return recv_state(recovery.source, m.group)
        return None

    def decided(self, generation: int) -> dict[str, Any] | None:
        """What the survivors of ``generation``'s failure agreed, if one of them has decided yet."""
        decision = self._key(generation, "decision")
        return json.loads(self.membership.store.get(decision)) if self.membership.store.check([decision]) else None

    def _check_in(self, generation: int, rank: int, cause: str) -> int:
        """Write that ``rank`` saw the failure of ``generation``, as ``cause`` ("died" or "hung"), and return how many
        ranks have checked in so far, itself included. One list and one counter for all ranks, not a key each: who
        has checked in is then learnt with two reads, whatever the number of ranks."""
        arrived = board.post(self.membership.store, self._key(generation, "in"), rank, cause)
        self.heartbeat.alarm(generation)  # (the peers hear of it from this rank's presence, and pass it on)
        return arrived

    def _checked_in(self, generation: int) -> dict[int, str]:
        """Each rank checked in under ``generation`` (one has, at least), with the cause it saw."""
        return {int(r): cause for r, cause in board.entries(self.membership.store, self._key(generation, "in")).items()}

    def _positions(self, generation: int, ranks: list[int], at: Position) -> dict[int, list]:
        """Collective over ``ranks``, the survivors of ``generation``'s failure: each writes where it was, ``at``; all
        read every survivor's ``[step, phase]``. One list the survivors append to, and a counter; the last to write
        marks the list complete, which the others wait for (at most ``hang_timeout_s``: a survivor lost meanwhile
        makes the wait fail, and the caller agrees again)."""
        store, complete, name = self.membership.store, self._key(generation, "at/complete"), self._key(generation, "at")
        if board.post(store, name, self.membership.rank, f"{at.step} {at.phase.value}") == len(ranks):
            store.set(complete, "1")
        store.wait([complete], datetime.timedelta(seconds=self.hang_timeout_s))
        survivors, where = set(ranks), {}
        for rank, entry in board.entries(store, name).items():
            step, phase = entry.split(" ", 1)  # (a phase's name may have a space)
            if int(rank) in survivors:
                where[int(rank)] = [int(step), phase]
        return where

    def _silent_peers(self, generation: int, decider: bool = True) -> tuple[list[int], list[int]]:
        """Wait until every other active rank has checked in under ``generation`` or been silent for
        :data:`SILENT_S`, or another survivor has decided (the caller then adopts that, whatever this rank saw); return
        the silent ones, and those still beating without having checked in when the wait ends (``hang_timeout_s`` +
        ``SILENT_S``).

        Only a ``decider`` (one of the first :data:`DECIDERS` to check in) watches from the start, every ``BEAT_S /
        4``, reading the beats of the ranks not checked in yet. The others wait for the decision in the store (one
        request, answered when it is written) and watch as a decider does only when none came in ``2 * SILENT_S``
        (the deciders may be lost as well). So the first to decide is as quick as when everyone watched everyone, and
        the store is not asked the same question by a thousand ranks twenty times a second."""
        m = self.membership
        decision, checked_in = self._key(generation, "decision"), self._key(generation, "in")
        start = time.monotonic()
        if not decider:
            try:
                m.store.wait([decision], datetime.timedelta(seconds=2 * SILENT_S))
                return [], []
            except dist.DistStoreError:  # (its timeout)
                pass
        # rank -> (last beat count read, when it was first read at that count, by our clock): from the heartbeat
        # thread's reads
        seen = self.heartbeat.seen()
        missing = {r for r in m.ranks if r != m.rank}  # not checked in (yet)
        # A rank's beats reach the store every period (BEAT_S in a small world, seconds in a large one, where its
        # watchers report its silence first): silent is a period late by SILENT_S.
        small, quiet_s = len(m.ranks) <= WATCHED + 1, SILENT_S + self.heartbeat.period_s - BEAT_S
        arrived, beats, read_at = 0, {}, -float("inf")
        while True:
            if m.store.check([decision]):
                return [], []
            now_arrived = board.count(m.store, checked_in)
            if now_arrived != arrived:
                arrived = now_arrived
                missing.difference_update(self._checked_in(generation))
            silent, waiting = [], []
            # their processes ended (a watcher saw their connection close), or their watchers hear nothing from them
            gone = (ended(m.store, m.key) | silent_ranks(m.store, m.key, generation)) & missing
            if small or time.monotonic() - read_at >= self.heartbeat.period_s:  # (in the store once a period)
                beats, read_at = self._beats(sorted(missing - gone), seen), time.monotonic()
            now = time.monotonic()
            for r, beats_read in beats.items():
                if r in gone or r not in missing:
                    continue
                if r not in seen or seen[r][0] != beats_read:
                    seen[r] = (beats_read, now)
                (silent if now - seen[r][1] >= quiet_s else waiting).append(r)
            waiting += [r for r in missing - gone if r not in beats]  # (not read yet)
            silent = sorted(silent + list(gone))
            if not waiting or now - start > self.hang_timeout_s + quiet_s:
                return silent, sorted(waiting)
            time.sleep(BEAT_S / 4)

    def _beats(self, ranks: list[int], seen: dict[int, tuple[int, float]]) -> dict[int, int]:
        """The beat counters of ``ranks`` (-1 for a rank that never beat), with one read when each has beaten."""
        store, keys = self.membership.store, [self.heartbeat.key(r) for r in ranks]
        if not keys:
            return {}
        if all(seen.get(r, (-1, 0.0))[0] >= 0 for r in ranks) or store.check(keys):
            return {r: int(value) for r, value in zip(ranks, store.multi_get(keys))}
        return {r: int(store.get(k)) if store.check([k]) else -1 for r, k in zip(ranks, keys)}
