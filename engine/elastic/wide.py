"""The failure agreement of a large world on a replicated store (``engine/elastic/failures.py`` runs it beyond
:data:`WATCHED` + 1 ranks on etcd): a thousand survivors asking the store at the same moment is more than a
replicated store answers in time, so most of them ask it nothing. Nobody checks in; the first ranks of the
presences' ring (:func:`roles`) decide from what the watchers report (a rank seen to end, or silent long enough);
one rank in :data:`RELAY_EVERY` along the ring reads the decision in the store and passes it round the ring
(``Presence.announce``), from which the others hear it; and the survivors' positions travel in one collective of
their new group (:func:`gather_positions`) instead of through the store."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from distributed import runstore
from distributed.membership import Membership, Wait, look_period
from distributed.presence import ended, ring_order, silences
from distributed.presence import silent as silent_ranks
from engine.elastic.heartbeat import BEAT_S, SILENT_S, WATCHED, Heartbeat
from engine.elastic.positions import Phase, Position

DECIDERS = 4  # the first survivors to check in (a large world: the first ranks of the ring), which decide
# One rank in RELAY_EVERY along the ring (and every decider) reads the decision in the store, every RELAY_POLL_S, and
# passes it on round the ring; the others wait to hear it from a neighbour, and ask the store themselves only when
# nothing came for HEARD_WITHIN_S.
RELAY_EVERY = 8
RELAY_POLL_S = 0.5  # (128 relays at 1024 ranks: 256 reads a second)
DECIDER_POLL_S = BEAT_S  # (a decider reads three things: 4 deciders ask the store 60 times a second in all)
# Nobody checks in, so a rank that is alive but was held (a stalled machine) cannot say so: a rank reported silent is
# given up only once nothing came from it for SILENT_S + CONFIRM_S (a rank seen to end, at once).
CONFIRM_S = SILENT_S
HEARD_WITHIN_S = 2 * SILENT_S
# The deciders decide this long after the first rank was reported gone, so that the ranks lost with it (a node's other
# processes, seen by their own watchers a moment later) are removed with it, not one change later.
GRACE_S = 0.5


def wide(ranks: int, store: Any) -> bool:
    """Whether a world of ``ranks`` on ``store`` agrees as this module says: beyond :data:`WATCHED` + 1 ranks on a
    replicated store (``EtcdStore``), which serves a thousand or so requests a second where torch's ``TCPStore``, one
    process holding everything in memory, serves tens of thousands and answers a wait when the key is written, at no
    cost while it waits."""
    return ranks > WATCHED + 1 and runstore.of(store).replicated


def roles(ranks: list[int], nodes: list[str]) -> tuple[list[int], list[int]]:
    """Among the active ``ranks`` (``nodes``: rank -> node): the deciders, the first :data:`DECIDERS` ranks of the
    presences' ring (the first rank of each of the first nodes: a node lost takes one of them, not all), and the
    relays, one in :data:`RELAY_EVERY` along the ring and the deciders (a decision read in the store is a few hops of
    the ring from every rank)."""
    ring = ring_order(ranks, nodes)
    deciders = sorted(ring[:DECIDERS])
    return deciders, sorted(set(ring[::RELAY_EVERY]) | set(deciders))


def gather_positions(group: Any, at: Position, wait: Wait) -> dict[int, list]:
    """Collective over ``group`` (the survivors' new group): every member's ``[step, phase]``, this one's ``at``, by
    its rank (waited for with ``wait``, which a loss elsewhere cuts short)."""
    ranks = dist.get_process_group_ranks(group)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    phases = list(Phase)
    mine = torch.tensor([at.step, phases.index(at.phase)], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in ranks]
    wait([dist.all_gather(every, mine, group=group, async_op=True)])
    return {r: [int(t[0]), phases[int(t[1])].value] for r, t in zip(ranks, every)}


class WideAgreement:
    """One rank's side of the agreement. ``decision(generation)``: the name the decision of that generation's failure
    is proposed under (first writer wins, ``Membership.propose``), the same as in a small world."""

    def __init__(
        self, membership: Membership, heartbeat: Heartbeat, hang_timeout_s: float, decision: Callable[[int], str]
    ):
        self.membership, self.heartbeat, self.hang_timeout_s = membership, heartbeat, hang_timeout_s
        self.decision = decision

    def agree(self, generation: int, at: Position) -> dict[str, Any]:
        """The decision on ``generation``'s failure, seen at ``at``: made here if this rank decides, read in the store
        if it relays, heard from a neighbour otherwise (``"ranks": []`` when nobody was reported gone within
        ``hang_timeout_s`` and a silence: the error was not a loss)."""
        m, heartbeat = self.membership, self.heartbeat
        heartbeat.alarm(generation)  # (every rank enters the agreement: a decider may be waiting on a collective)
        deciders, relays = roles(m.ranks, m.nodes)
        if m.rank not in deciders and m.rank not in relays:
            agreed = self._hear(generation)
            if agreed is not None:
                return agreed
            deciders = [m.rank]  # (nothing came, and this rank is among the first of the ring still there: it decides)
        decider, others = m.rank in deciders, set(m.ranks) - {m.rank}
        start, first_gone = time.monotonic(), None
        give_up_s = self.hang_timeout_s + SILENT_S + heartbeat.period_s
        while True:
            agreed = self._read(generation)
            if agreed is not None:
                return agreed
            if decider:
                closed, heard = ended(m.store, m.key), silences(m.store, m.key, generation)
                quiet = {r for r, last in heard.items() if time.time() - last >= SILENT_S + CONFIRM_S}
                gone = sorted((closed | quiet) & others)
                now = time.monotonic()
                first_gone = first_gone if first_gone is not None or not gone else now
                if (gone and now - first_gone >= GRACE_S) or now - start > give_up_s:
                    died = bool(gone) and set(gone) <= closed  # (seen to end; else silent: Failures._recover)
                    proposal = {
                        "ranks": gone,
                        "cause": "died" if died else "hung",
                        "noticed": "ended" if died else "silence",
                        "step": at.step,
                        "time": time.time(),
                        "ahead": m.ready([r for r in m.ranks if r not in gone]),
                    }
                    agreed = m.propose(self.decision(generation), proposal)
                    heartbeat.announce(generation, json.dumps(agreed).encode())
                    return agreed
            heard = heartbeat.decision(generation, DECIDER_POLL_S if decider else RELAY_POLL_S)
            if heard is not None:  # (from a neighbour: passed on already, as every decision heard is)
                return json.loads(heard)

    def _read(self, generation: int) -> dict[str, Any] | None:
        """The decision, if it is in the store yet; passed round the ring when it is."""
        store, key = self.membership.store, self.membership.key(self.decision(generation))
        if not store.check([key]):
            return None
        value = store.get(key)
        self.heartbeat.announce(generation, value)
        return json.loads(value)

    def _hear(self, generation: int) -> dict[str, Any] | None:
        """A survivor that neither decides nor relays: the decision, as a neighbour passes it on. Should none come
        within :data:`HEARD_WITHIN_S` (its relays lost too?), it reads the store itself, every ``look_period`` of
        :data:`RELAY_POLL_S` (10 s at 1024 ranks) from a moment of its own, so that a thousand ranks in this case do
        not ask at once; and should none be there either a silence later (the deciders lost as well), returns None
        when this rank is among the first of the ring once the ranks reported gone are left out: it decides then."""
        m, heartbeat = self.membership, self.heartbeat
        period_s = look_period(RELAY_POLL_S, len(m.ranks))
        start, wait_s = time.monotonic(), HEARD_WITHIN_S + random.uniform(0, period_s)
        while True:
            heard = heartbeat.decision(generation, wait_s)
            if heard is not None:
                return json.loads(heard)
            agreed = self._read(generation)
            if agreed is not None:
                return agreed
            if time.monotonic() - start > HEARD_WITHIN_S + SILENT_S + period_s:
                gone = ended(m.store, m.key) | silent_ranks(m.store, m.key, generation)
                if m.rank in roles([r for r in m.ranks if r not in gone], m.nodes)[0]:
                    return None
            wait_s = period_s
