"""The members' side of a join: tickets seen, promises made, the admission step agreed (:class:`Admissions`), and
the averaging of the admission step that a joiner takes part in (:class:`InAveraging`). Steps 3, 4 and 6 of the
protocol (``engine/elastic/__init__.py``)."""

from __future__ import annotations

import datetime
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from distributed.membership import Membership, StoreLoop
from engine.elastic.records import (
    Admission,
    Decision,
    JoinFile,
    Keys,
    NodeTicket,
    Notice,
    Offer,
    ticket_rank,
    whole_nodes,
)

POLL_S = 0.2  # how often a member looks for tickets (beyond 17 ranks: distributed.membership.look_period)
MARGIN = 3  # steps on that a member promises; it waits for the others' promises one step before its own
ALIGN = 16  # steps further a promise may go to reach the sync algorithm's own agreement (local SGD's averaging)
FORM_WAIT_S = 5.0  # how long the averaging of an admission step waits for the group formed ahead (InAveraging)


class Admissions:
    """The members' side: tickets seen, promises made, the admission step agreed (:meth:`due`)."""

    def __init__(self, membership: Membership, wait_s: float, agreement_at: Callable[[int], int] = lambda n: n):
        self.membership, self.wait_s, self.keys = membership, wait_s, Keys(membership)
        self.agreement_at = agreement_at  # the sync algorithm's (SyncAlgorithm.agreement_at)
        self.admitted = 0  # tickets admitted so far (1..admitted)
        self.rounds = 0  # admissions carried out so far
        self.decision: Decision | None = None  # the next admission, once agreed
        self._lock = threading.Lock()
        self._at = 0  # steps completed, as the main thread last said
        self._promise: int | None = None  # the step this rank will not pass before the next admission's is agreed
        self._watcher: StoreLoop | None = None
        # generation -> the model's tensors (by name) the joiners took in the averaging of the admission step
        # (:class:`InAveraging`), or None where it was tried and did not hold on every member
        self.inline: dict[int, list[str] | None] = {}

    def start(self, step: int, run_dir: str = "") -> None:
        """Watch for tickets from ``step`` on; the logging rank publishes the run's :class:`JoinFile`."""
        self._at = step
        where = JoinFile.of(self.membership)
        if where is not None and self.membership.is_logging_rank:
            where.write(run_dir)
        self._watcher = self.membership.every(POLL_S, self._look, "relaxsync-joins", spread=True).start()

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    def close(self) -> None:
        """The run has ended: joiners still waiting for their admission give up."""
        self.stop()
        if self.membership.is_logging_rank:
            self.membership.store.set(self.keys.closed(), "1")

    def _look(self, store: Any) -> bool:
        """In the watcher thread: a ticket not yet admitted makes this rank promise (once per admission); where nodes
        join whole, a node whose every process has its ticket."""
        if self._promise is not None or self._waiting(store) <= self.admitted:
            return False
        with self._lock:
            self._promise = promise = self.promise(self._at)
            round_ = self.rounds + 1
        store.set(self.keys.promise(round_, self.membership.rank), str(promise))
        return False

    def promise(self, at: int) -> int:
        """The step this rank promises at ``at`` steps completed: :data:`MARGIN` steps on, or, within :data:`ALIGN`
        steps after that, where the replicas next agree by the sync algorithm's own exchange (the largest promise,
        the admission step, is then such a step too where the period is the same on every rank: local SGD at
        k_steps <= ALIGN, DiLoCo at inner_steps <= ALIGN)."""
        early = at + MARGIN
        aligned = self.agreement_at(early)
        return aligned if early <= aligned <= early + ALIGN else early

    def due(self, step: int) -> Decision | None:
        """At a step boundary, ``step`` steps completed: the admission to carry out now, if one is agreed for this
        step. Waits (at most ``wait_s``) for the other members' promises only one step before its own, so that
        every member knows the admission step before the step that ends there (whose averaging may admit:
        :class:`InAveraging`)."""
        with self._lock:
            self._at, promise, round_ = step, self._promise, self.rounds + 1
        if promise is None:
            return None
        m = self.membership
        if self.decision is None:
            keys = [self.keys.promise(round_, r) for r in m.ranks]
            if step < promise - 1 and not m.store.check(keys):
                return None
            m.store.wait(keys, datetime.timedelta(seconds=self.wait_s))
            at = max(int(value) for value in m.store.multi_get(keys))
            tickets = self._waiting(m.store)
            self.decision = Decision.read(m.propose(Keys.decision(round_), Decision(at, tickets).wire()))
            self._prepare(self.decision)
        if step < self.decision.at:
            return None
        if step > self.decision.at:
            raise RuntimeError(f"rank {m.rank} is at step {step}, past the agreed admission step {self.decision.at}")
        return self.decision

    def _waiting(self, store: Any) -> int:
        """The tickets an admission now would admit up to: all of them, or, where nodes join whole (node scope),
        those of the nodes all of whose processes have theirs (:func:`whole_nodes`)."""
        tickets = int(store.add(self.keys.tickets(), 0))
        if not self.membership.whole_nodes or tickets <= self.admitted:
            return tickets
        told = [self.keys.node(t) for t in range(self.admitted + 1, tickets + 1)]
        if not store.check(told):  # (a ticket taken, its node not yet written)
            return self.admitted
        return whole_nodes(self.admitted, [NodeTicket.read(value) for value in store.multi_get(told)])

    def _prepare(self, decision: Decision) -> None:
        """Once this rank knows the admission: form the group it will have in the background (each joiner learns of
        it from its ticket's :class:`Notice` and does the same), so that at the admission step nobody stands still
        for it (:meth:`Membership.prepare`)."""
        m = self.membership
        ranks = self.after(self.joiners(decision))
        for t in self.tickets(decision):
            m.store.compare_set(self.keys.notice(t), "", Notice(m.generation, ranks).wire())
        m.prepare(ranks, m.generation)

    def after(self, joiners: dict[int, str]) -> list[int]:
        """The ranks the admission of ``joiners`` makes."""
        return sorted(set(self.membership.ranks) | set(joiners))

    def tickets(self, decision: Decision) -> range:
        """The tickets ``decision`` admits."""
        return range(self.admitted + 1, decision.tickets + 1)

    def prepared(self, decision: Decision, generation: int, wait_s: float) -> bool:
        """Whether every joiner ``decision`` admits has the advance state the sender sent it in ``generation``
        (``Surviving.send_advance``); waits up to ``wait_s`` for it."""
        m, deadline = self.membership, time.monotonic() + wait_s
        sent = self.keys.advance_sent(self.rounds + 1)
        keys = [self.keys.prepared(t, generation) for t in self.tickets(decision)]
        try:
            m.store.wait([sent], datetime.timedelta(seconds=wait_s))
            if int(m.store.get(sent)) != generation:  # (sent before a loss: perhaps not the state of this step)
                return False
            m.store.wait(keys, datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except dist.DistError:
            return False
        return True

    def joiners(self, decision: Decision) -> dict[int, str]:
        """The ids admitted by ``decision``, each with its host (written with its ticket)."""
        m = self.membership
        ids = {t: ticket_rank(m.initial_size, t) for t in self.tickets(decision)}
        return {r: m.store.get(self.keys.host(t)).decode() for t, r in ids.items()}

    def nodes(self, decision: Decision) -> dict[int, str]:
        """The ids admitted by ``decision``, each with its node's name (written with its ticket)."""
        m = self.membership
        ids = {t: ticket_rank(m.initial_size, t) for t in self.tickets(decision)}
        told = {t: self.keys.node(t) for t in ids}
        try:  # (a process that died between its ticket and its node's name never writes it: it is named "")
            m.store.wait(list(told.values()), datetime.timedelta(seconds=self.wait_s))
        except dist.DistError:
            pass
        named = {t: NodeTicket.read(m.store.get(key)).node for t, key in told.items() if m.store.check([key])}
        return {r: named.get(t, "") for t, r in ids.items()}

    def announce(self, decision: Decision, joiners: dict[int, str]) -> Admission:
        """Write each ticket's admission: the members' view just before it (the first writer's, for all)."""
        m = self.membership
        inline = self.inline.get(m.generation, False)
        # (formed here: formed on all of them; not after a collective on it failed, where it may be broken)
        ahead = m.ready(self.after(joiners)) and inline is not None
        record = Admission(
            m.view(), joiners, decision.at, self.rounds + 1, decision.tickets, ahead, bool(inline), self.nodes(decision)
        )
        for t in self.tickets(decision):
            record = Admission.read(m.store.compare_set(self.keys.admission(t), "", record.wire()))
        return record

    def done(self, record: Admission) -> None:
        """An admission carried out (on the members, and on the joiner admitted by it, which watches from now)."""
        with self._lock:
            self.admitted, self.rounds = record.admitted, record.round
            self._promise, self.decision, self.inline = None, None, {}


class InAveraging:
    """The members' side of a join whose joiners take their model in the averaging that ends at the admission step
    (``SyncContext.guests``, local SGD's and DiLoCo's): one collective over the members and them, on the group formed
    ahead for the admission, where each joiner adds -0.0 (nothing, bit for bit) and divides by the members' count,
    as the members do. Nothing then follows the averaging but the small rest of the state: a transfer of the model
    after it would hold the members up at their next averaging, waiting for the joiner's first steps.

    Whether the joiners take part is decided once for all (the first member to get here writes the :class:`Offer`,
    and each ticket's copy tells its joiner), and only where the group is formed (within :data:`FORM_WAIT_S`: a
    joiner that asked and died never forms it, and is found lost at the admission) and, where the joiners need the
    advance state (DiLoCo's outer state, to take the outer step themselves), where they have it. Whether it held is
    agreed on the members' own group: where the collective failed on any of them, all of them average on their own
    group as they would have, and the joiners take the model from the sender; a member lost there is survived as in
    any averaging (the guard redoes it, without the joiners: the group formed ahead went with the change)."""

    def __init__(self, admissions: Admissions, decision: Decision, comm: Any):
        self.admissions, self.decision, self.comm = admissions, decision, comm

    def sum(self, flat: torch.Tensor, names: list[str], advance: bool = False) -> bool:
        """``Guests.sum``: ``advance``, the joiners need the advance state for their share."""
        a, m = self.admissions, self.admissions.membership
        ranks, generation = a.after(a.joiners(self.decision)), m.generation
        key = a.keys.offer(a.rounds + 1, generation)
        if m.store.check([key]):  # (decided: no waiting again for what the first member waited for)
            decided = m.store.get(key).decode()
        else:
            offer = None
            if m.backend == "gloo" and flat.device.type == "cpu" and m.ready(ranks, generation, FORM_WAIT_S):
                if not advance or a.prepared(self.decision, generation, FORM_WAIT_S):
                    offer = Offer(m.size, names, flat.numel(), advance).wire()
            decided = m.store.compare_set(key, "", json.dumps(offer)).decode()
        for t in a.tickets(self.decision):
            m.store.compare_set(a.keys.ticket_offer(t, generation), "", decided)
        if Offer.read(json.loads(decided)) is None:
            return False
        summed, held = flat.clone(), torch.ones(1, device=flat.device)
        try:
            self.comm.all_reduce(summed, group=m.formed_ahead(ranks, generation))
        except Exception as error:  # (a joiner, or a member, gone: agreed on the members' group next)
            print(f"relaxsync: rank {m.rank}: the averaging with the joiners failed: {error}", flush=True)
            held.zero_()
        if self.comm.all_reduce(held).item() < m.size:  # (a member lost: survived here, as in any averaging)
            a.inline[generation] = None
            return False
        flat.copy_(summed)
        a.inline[generation] = names
        return True
