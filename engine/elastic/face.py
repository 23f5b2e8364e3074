"""The one face the trainer sees of a world that changes mid-run, chosen once (``engine/elastic/build.py``):
:class:`Fixed` under ``trainer.on_failure=abort`` (nothing per step) and :class:`Surviving` under ``continue``
(losses survived by the guard, joiners admitted at agreed steps; ``engine/elastic/joiner.py`` is the joiner's way in).

A component never assigns the trainer's attributes: an admission hands the trainer a :class:`Resize`, which the
trainer applies itself (``Trainer.resize``); :class:`Host` is all a component uses of the trainer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

from algorithms.base import SyncReport
from distributed.membership import Membership
from distributed.transfer import Parcel
from engine.elastic.admissions import Admissions, InAveraging
from engine.elastic.guard import SurvivingGuard
from engine.elastic.handover import Sending, split
from engine.elastic.positions import Phase, Site
from engine.elastic.records import Decision

SEND_GRACE_S = 10.0  # how long a member that ends waits for a state it still sends


@dataclass(frozen=True)
class Resize:
    """What the trainer takes when the world changes size under it (an admission): it goes on as a run resumed from
    ``state`` (a checkpoint's content at the admission step) at the membership's new size."""

    state: dict[str, Any]
    own: dict[str, Any] | None  # this rank's own sync algorithm state (None: a joiner's starts fresh)
    replica: bool = False  # take the model, optimizer and AMP state of ``state`` first (a joiner)
    partial_model: bool = False  # ``state`` holds part of the model: the rest was taken in an averaging (a joiner)
    # what arrives later (a joiner): loads it into the optimizer and the sync algorithm it is given
    rest: Callable[[Any, Any], None] | None = field(default=None, compare=False)


class Host(Protocol):
    """What the elastic component uses of the trainer (10 members)."""

    run: Any  # engine.state.RunState: where the loop is
    recorder: Any  # engine.metrics.Recorder
    sync: Any  # the sync algorithm: its join hooks and own state

    def settle(self) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def apply(self, report: SyncReport, epoch: int) -> None: ...
    def resize(self, resize: Resize) -> None: ...
    def rehearse(self) -> None: ...
    def joined_at(self, step: int) -> None: ...


class Fixed:
    """``trainer.on_failure=abort``: a world that does not change. Every part runs as it is, nobody joins, nothing
    is kept (a failed collective ends the run; torchrun or a new command resumes from the last checkpoint)."""

    lost_ranks: tuple[int, ...] = ()
    guests = None  # (``SyncContext.guests``: nobody is ever admitted)

    def rejected_connections(self) -> int:
        """Connections to this rank's port refused for not proving the run's secret: none (it listens on none)."""
        return 0

    def resume(self, load: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
        """The state this process starts from: ``load()``, the checkpoint's."""
        return load()

    def attach(self, host: Host, begin: Callable[[], None]) -> None:
        begin()

    def start(self, step: int) -> None:
        pass

    def run(self, phase: Phase, part: Callable[[], Any], epoch: int, site: Site = Site.NONE, carry=None) -> Any:
        return part()

    def entry(self, site: Site) -> dict[str, Any] | None:
        """Never: no rank catches up."""
        return None

    def repeat(self, part: Callable[[], Any]) -> Any:
        return part()

    def admit_if_due(self, epoch: int, site: Site) -> bool:
        return False

    def close(self) -> None:
        pass

    def stop(self, farewell: bool = True) -> None:
        pass


class Surviving:
    """``trainer.on_failure=continue`` on a member: every part of the loop runs under the surviving guard
    (``engine/elastic/guard.py``), and joiners are admitted at the steps the members agree on (:class:`Admissions`),
    each admission handing the trainer a :class:`Resize`."""

    def __init__(self, membership: Membership, comm: Any, hang_timeout_s: float, run_dir: str):
        self.membership, self.comm, self.hang_timeout_s, self.run_dir = membership, comm, hang_timeout_s, run_dir
        self.host: Host | None = None
        self.guard: SurvivingGuard | None = None
        self.admissions = Admissions(membership, hang_timeout_s, lambda steps: self.host.sync.agreement_at(steps))
        self.sending: list[Sending] = []  # states still on their way to joiners
        self.advanced = 0  # the last admission round the advance state was sent (or found not needed) for

    # ---- the face ------------------------------------------------------------------------------------------------
    @property
    def lost_ranks(self) -> list[int]:
        return self.guard.lost_ranks

    def rejected_connections(self) -> int:
        """Connections to this rank's presence port closed for not proving the run's secret, so far
        (``distributed/presence.py``)."""
        presence = self.guard.failures.heartbeat.presence if self.guard is not None else None
        return presence.rejected if presence is not None else 0

    def resume(self, load: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
        return load()

    def attach(self, host: Host, begin: Callable[[], None]) -> None:
        """Take the trainer (before it writes its first record: the guard keeps them) and let it ``begin``."""
        self.host, self.guard = host, SurvivingGuard(self.membership, self.hang_timeout_s, host)
        begin()

    def start(self, step: int) -> None:
        self.guard.start()
        self.admissions.start(step, self.run_dir)

    def run(self, phase: Phase, part: Callable[[], Any], epoch: int, site: Site = Site.NONE, carry=None) -> Any:
        return self.guard.run(phase, part, epoch, site, carry)

    def entry(self, site: Site) -> dict[str, Any] | None:
        return self.guard.entry(site)

    def repeat(self, part: Callable[[], Any]) -> Any:
        return self.guard.repeat(part)

    def guests(self, steps: int) -> InAveraging | None:
        """For the averaging that completes ``steps`` steps (``SyncContext.guests``): the joiners admitted there."""
        decision = self.admissions.decision
        if decision is None or decision.at != steps:
            return None
        return InAveraging(self.admissions, decision, self.comm)

    def close(self) -> None:
        """The run has ended: joiners still waiting are told; states on their way get a grace to arrive."""
        self.admissions.close()
        for sending in self.sending:  # (a process ending while its thread sends would abort; a joiner gone ends it)
            sending.wait(SEND_GRACE_S)

    def stop(self, farewell: bool = True) -> None:
        if self.guard is not None:
            self.guard.stop(farewell)

    # ---- admissions (the members' side) ---------------------------------------------------------------------------
    def admit_if_due(self, epoch: int, site: Site) -> bool:
        """Admit the joiners if the members agreed on this step (the trainer asks between steps only while the epoch
        has steps left: at its end, the next epoch's start admits them). Returns whether it did."""
        host = self.host
        decision = self.guard.run(Phase.JOIN, partial(self.admissions.due, host.run.step), epoch, site)
        if decision is None:
            self.send_advance()
            return False
        self.guard.run(Phase.JOIN, partial(self.admit, decision, epoch), epoch, site)
        return True

    def admit(self, decision: Decision, epoch: int) -> None:
        """On the members, at the agreed step: settle as for a checkpoint, admit the joiners into a new group, send
        them the state (the sender: the lowest member) and have the trainer go on as resumed at the new size
        (:class:`Resize`). Redone after a loss in it: those admitted already are not admitted again."""
        host, admissions, m, clock = self.host, self.admissions, self.membership, [time.perf_counter()]

        def lap() -> float:
            clock.append(time.perf_counter())
            return clock[-1] - clock[-2]

        host.settle()
        state = host.state_dict()  # (before the admission: a checkpoint's content at this step)
        settle_s = lap()
        joiners = admissions.joiners(decision)
        record = admissions.announce(decision, joiners)
        ahead = record.ahead and record.generation == m.generation  # (not where a loss came in between)
        if not any(change.added == sorted(joiners) for change in m.changes):  # (redone: admitted once is enough)
            m.admit(list(joiners), joiners, ahead=ahead, nodes=record.nodes)
        group_s = lap()
        if m.rank == sender(m, joiners):
            parts = split(state, host.sync.late_shared_state)
            if record.inline:  # (they have the averaged tensors: the rest of the model only)
                averaged = set(admissions.inline[record.generation])
                parts[0]["model"] = {k: v for k, v in parts[0]["model"].items() if k not in averaged}
            parcels = [Parcel.of(part) for part in parts]  # (copies)
            self.sending = [s for s in self.sending if s.alive()]
            self.sending += [Sending(m, r, parcels).start() for r in joiners if r in m.ranks]
        pack_s = lap()
        host.resize(Resize(state, own=host.sync.local_state_dict()))
        admissions.done(record)
        event = {"event": "rank_joined", "ranks": sorted(joiners), "hosts": joiners, "world_size": m.size}
        event["formed_ahead"] = ahead  # (the new group was formed before the admission step)
        event["in_averaging"] = record.inline  # (they took the model in the averaging of the admission step)
        took = {"settle_s": settle_s, "group_s": group_s, "pack_s": pack_s, "reshape_s": lap()}
        host.recorder.event({**event, "admission_s": clock[-1] - clock[0], **took}, epoch, host.run.step)

    def send_advance(self) -> None:
        """On the sender, once an admission is agreed: the state its joiners need before the averaging of the
        admission step (``SyncAlgorithm.guest_state``: DiLoCo's outer state, final from the outer step before), sent
        from a thread once it is final, while everyone trains; once per admission."""
        a, host, m = self.admissions, self.host, self.membership
        decision, round_ = a.decision, a.rounds + 1
        if decision is None or self.advanced == round_ or m.backend != "gloo":  # (InAveraging's only)
            return
        state = host.sync.guest_state(decision.at, host.run.step)
        if state is None:
            return
        self.advanced, joiners = round_, a.joiners(decision)
        if m.rank != sender(m, joiners):
            return
        parcel = Parcel.of(state)
        self.sending += [Sending(m, r, [parcel], advance=True).start() for r in joiners]
        for t in a.tickets(decision):
            m.store.set(a.keys.advance_from(t, m.generation), str(m.rank))
        m.store.set(a.keys.advance_sent(round_), str(m.generation))


def sender(membership: Membership, joiners: dict[int, str]) -> int:
    """Who sends the state to the joiners: the lowest member (after any loss in the admission)."""
    return min(r for r in membership.ranks if r not in joiners)
