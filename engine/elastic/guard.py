"""The surviving guard (``trainer.on_failure=continue``): the part of the elastic component through which the
trainer runs each part of its loop that holds a collective (``Surviving.run``).

A part that fails because a peer is gone is redone on the survivors' group once they agree who is gone
(``engine/elastic/failures.py``); whatever the error's text says, the store decides whether anyone is. The guard
knows where the loop is (a :class:`Position` and a :class:`Site`), keeps the latest records (the logging rank may
be healed and must write those it missed), writes the ``rank_lost`` event once what was in flight is done again,
and heals a survivor left a collective behind through the trainer's ``state_dict()`` / ``load_state_dict()``: that
rank raises :class:`CatchUp` up to the loop, which enters again where the front is.

The sync algorithm learns of the change the way it learns of any: the trainer's ``apply`` takes it from the
trainer's one reader of the changes, calls the algorithm's ``on_membership_change(change)`` and carries out the
report it returns.
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from algorithms.base import SyncReport
from distributed.comm import tensor_bytes
from distributed.membership import Membership, host_names
from engine.elastic.failures import Failures, may_be_a_loss, unreachable
from engine.elastic.heartbeat import BEAT_S
from engine.elastic.positions import Entry, Phase, Position, Site

HISTORY = 4096  # records kept for a peer that falls behind by a collective and must write them


class CatchUp(Exception):  # noqa: N818 - a control-flow signal, like StopIteration
    """Raised on a survivor left behind once it holds the front's state: it unwinds to the training loop, which
    enters again at the front's part, the parts before it returning what the front carried from them."""

    def __init__(self, entry: Entry):
        super().__init__(f"catch up at the {entry.position.phase.value} of step {entry.position.step}")
        self.entry = entry


class Host(Protocol):
    """What the surviving guard uses of the trainer."""

    run: Any  # engine.state.RunState
    recorder: Any  # engine.metrics.Recorder
    sync: Any  # the sync algorithm

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def apply(self, report: SyncReport, epoch: int) -> None: ...


class SurvivingGuard:
    """``trainer.on_failure=continue``: a lost peer is survived in any part of the loop."""

    def __init__(self, membership: Membership, hang_timeout_s: float, host: Host):
        self.failures, self.host = Failures(membership, hang_timeout_s), host
        self.lost_ranks: list[int] = []
        self.history: deque[tuple[Position, dict[str, Any]]] = deque(maxlen=HISTORY)  # (where it was written, record)
        self._at = Entry(Position(0, Phase.STEP), Site.NONE)  # the part in progress
        self._entering: Entry | None = None  # on a rank healed from the front, until it reaches the front's part
        self._lost: list[dict[str, Any]] = []  # rank_lost events waiting for what was in flight to be done again
        self._replaying = False
        self._named = 0  # the generation through which a rank_lost event has named the ranks removed
        host.recorder.observers.append(self._observe)

    def start(self) -> None:
        self.failures.heartbeat.start()

    def stop(self, farewell: bool = True) -> None:
        self.failures.heartbeat.stop(farewell)

    def run(self, phase: Phase, part: Callable[[], Any], epoch: int, site: Site = Site.NONE, carry=None) -> Any:
        """``part()``; if a collective in it fails because a peer is gone, agree with the other survivors on who is
        gone, regroup, and run it again. ``carry`` is what a rank healed from this one needs to enter here. On a
        rank catching up with the front, every part before the front's returns what the front carried from it."""
        entering, step = self._entering, self.host.run.step
        if entering is not None:
            if (phase, site) != (entering.position.phase, entering.site):
                return entering.carry.get(phase)
            if step != entering.position.step:
                raise RuntimeError(f"entered the {phase.value} at step {step}, not {entering.position.step}")
            self._entering = None
        self._at = Entry(Position(step, phase), site, carry or {})
        if self.failures.heartbeat.cut_off():
            self._fence(epoch)
        while True:
            try:
                result = part()
                break
            except Exception as error:
                self._survive(error, epoch)
        if phase not in (Phase.STEP, Phase.EXCHANGE, Phase.EXIT):  # (a step's, after its record; none after exit)
            self._write_losses(epoch, step)
        return result

    def entry(self, site: Site) -> dict[str, Any] | None:
        """On a rank catching up with a front that is at ``site``: the loop's values there; otherwise None."""
        entering = self._entering
        return entering.carry.get("loop", {}) if entering is not None and entering.site == site else None

    def repeat(self, part: Callable[[], Any]) -> Any:
        """``part()`` until it returns without this rank having been healed in it (:class:`CatchUp`)."""
        while True:
            try:
                return part()
            except CatchUp:
                pass  # this rank now holds the front's state: enter where the front is

    def _fence(self, epoch: int) -> None:
        """This rank's beats have not reached the store for :data:`FENCE_S` past their period, or nothing came from
        the peers it watches for as long (``Heartbeat.cut_off``): it may be cut off from the others, who
        give it up after :data:`SILENT_S`. Nothing more is trained or written here (a step on its own, a record, a
        checkpoint) until the store answers: then, if the others agreed on a failure meanwhile, this rank joins that
        agreement (and leaves, if it was removed); if the store does not answer within ``hang_timeout_s``, this rank
        is on the side without the store and stops (:class:`StoreUnreachable`)."""
        failures = self.failures
        m, heartbeat = failures.membership, failures.heartbeat
        deadline = time.monotonic() + failures.hang_timeout_s
        while True:
            try:
                decided = failures.decided(m.generation)
                break
            except Exception as error:  # (DistNetworkError, or whatever the store's client raises)
                if time.monotonic() > deadline:
                    silent = heartbeat.silent_for()
                    what = f"has not reached the store for {silent:.0f} s at step {self.host.run.step} and"
                    raise unreachable(m.rank, what, error, m.store) from None
                time.sleep(BEAT_S)
        heartbeat.revive()
        if decided is not None:  # (the others agreed on a failure while this rank was away: removed, or one of them)
            self._survive(RuntimeError("relaxsync: the store was out of reach while the others agreed"), epoch)

    # ---- recovery ---------------------------------------------------------------------------------------------
    def _survive(self, error: BaseException, epoch: int) -> None:
        """Recover from ``error`` if it may be a loss (else raise it). Another peer lost during the recovery (while
        the survivors agree, form their group, follow the change or heal) is a failure of the recovery like any
        other: they agree again, over who is left, and each loss is written once. An error after which they agree
        that nobody is gone is survived by regrouping the same ranks, a few times at one part at most; past that
        (``recover`` raises it again) it is this rank's own, and is raised."""
        self._named = self.failures.membership.generation  # (the changes before this failure were named already)
        while True:
            if not (may_be_a_loss(error) or self._alarm_rang()):
                raise error
            try:
                self._recover(error, epoch)
                return
            except CatchUp:
                raise
            except Exception as again:
                if again is error:  # (every peer is there: agreeing again would find the same, for ever)
                    raise
                error = again

    def _alarm_rang(self) -> bool:
        """Whether another rank saw a collective of this generation fail. On NCCL that aborted the generation's
        groups (distributed/alarm.py), and a collective this rank then issued on one raised an error of Python's
        own (``ValueError``: the group has left torch's registry): the loss's doing, not this rank's code."""
        membership = self.failures.membership
        return membership.alarm.rung(membership.generation) is not None

    def _recover(self, error: BaseException, epoch: int) -> None:
        """After ``error``: agree on who is gone, regroup and follow the change; on a survivor one collective
        behind the others, take the front's state and raise :class:`CatchUp`."""
        detected, host, membership = time.time(), self.host, self.failures.membership
        recovery = self.failures.recover(error, self._at.position)
        # the ranks removed since the last event: an agreement cut short by another loss removed some already
        removed = sorted(r for c in membership.changes if c.generation > self._named for r in c.removed)
        self._named = membership.generation
        event = {**recovery.event, "ranks": removed}
        own = sum(tensor_bytes(t) for t in _tensors(host.sync.local_state_dict()))
        self._lost.append({**event, "detected_at": detected, "lost_state_bytes": own})  # what the lost rank took
        self.lost_ranks += removed
        healed = ""
        if recovery.behind:
            healed = f"; rank(s) {recovery.behind} were a collective behind: they take rank {recovery.source}'s state"
        going_on = len(recovery.change.ranks)
        who = f"rank(s) {removed} {event['cause']}" if removed else "a collective failed with every rank still there"
        regroup = "go on" if removed else "regroup"
        host.recorder.console(
            f"relaxsync: {who} at step {event['failed_step']}; "
            f"{going_on} ranks {regroup} and redo the {event['redo']} of step {recovery.front.step}{healed}"
        )
        host.apply(SyncReport(), epoch)  # the algorithm answers the change (on_membership_change)
        snapshot = self.failures.heal(recovery, lambda behind: self._snapshot(behind, recovery.front))
        if snapshot is not None:
            host.load_state_dict(snapshot["state"])  # the front's replica; this rank's own algorithm state stays
            self._replaying = True  # (the front's train records do not complete this rank's step)
            try:
                host.recorder.replay(snapshot["records"])
            finally:
                self._replaying = False
            # A loss the front has written already (this rank was healed after a later one, during whose recovery
            # the front went on and redid what the earlier loss had in flight) is not written again.
            losses = [record for record in snapshot["records"] if record.get("event") == "rank_lost"]
            written = {r for record in losses for r in record["ranks"]}
            regroups = {r["failed_at"] for r in snapshot["records"] if r.get("event") == "regrouped"}
            pending = [{**e, "ranks": [r for r in e["ranks"] if r not in written]} for e in self._lost]
            # (a regroup removed nobody: it is told by when its failure was proposed, not by ranks)
            unwritten = [e for e in pending if e["event"] == "regrouped" and e["failed_at"] not in regroups]
            self._lost = [e for e in pending if e["ranks"] or e in unwritten]
            self._entering = snapshot["entry"]
            raise CatchUp(self._entering)

    def _snapshot(self, behind: Position, front: Position) -> dict[str, Any]:
        """What a survivor that failed at ``behind`` needs to go on from here, the ``front``: the trainer's state,
        the records written since ``behind`` (it may be the logging rank) and where to enter."""
        records = [r for at, r in self.history if behind.key <= at.key < front.key]
        # On the CPU: a pickled CUDA tensor would come back on the sender's device index, and the receiver's
        # load_state_dict copies each tensor onto its own device anyway.
        return {"state": _on_cpu(self.host.state_dict()), "records": records, "entry": self._at}

    def _observe(self, record: dict[str, Any]) -> None:
        """Every record the recorder writes (on every rank), kept with where the loop was; a step's losses are
        written right after its train record."""
        if record["kind"] == "summary":
            return
        self.history.append((self._at.position, record))
        if record["kind"] == "train" and not self._replaying:
            self._write_losses(record["epoch"], record["step"])

    def _write_losses(self, epoch: int, step: int) -> None:
        """The ``rank_lost`` events of losses recovered from, now that what was in flight is done again."""
        lost, self._lost = self._lost, []
        for event in lost:
            event["recovery_s"] = time.time() - event["detected_at"]  # from the failure to this completion
            self.host.recorder.event(event, epoch, step)


def training_membership(on_failure: str, hang_timeout_s: float, rank: int, world_size: int) -> Membership:
    """The active ranks and their group. Under ``continue`` every training collective gets a deadline, so that a
    hung peer makes it fail instead of waiting ``trainer.timeout_s``."""
    hosts, nodes = host_names()
    if on_failure != "continue":
        return Membership(rank, world_size, hosts=hosts, nodes=nodes)
    deadline = datetime.timedelta(seconds=hang_timeout_s)
    membership = Membership(rank, world_size, hosts=hosts, timeout=deadline, backend=dist.get_backend(), nodes=nodes)
    membership.group = membership.form(list(range(world_size)))  # (one that joiners can be in later)
    return membership


def _on_cpu(state: Any) -> Any:
    """``state`` with every tensor in it copied to the CPU (the same objects where they are there already)."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {key: _on_cpu(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_on_cpu(value) for value in state)
    return state


def _tensors(state: Any):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _tensors(value)
