"""Joins without a restart (``trainer.on_failure: continue``): a process that asks to join a running world is
admitted at a step every member agrees on; nobody stops but for the admission itself.

torchrun admits a node by re-rendezvous, which stops and restarts every worker of the world. Here the world does
not change at all: the training group is ours (``Membership.form``, on the run's c10d store), so a process outside
the default group can be in the next one, as torchft's replicas join at its next quorum.

1. The run's logging rank publishes where its store is, ``<run dir>/join.json`` (:class:`JoinFile`).
2. A process started with ``trainer.join=true`` builds everything it trains with, then takes a ticket from the
   store (its id in the run: the initial world size plus the ticket, less one, never a rank used before) and
   waits (:class:`Request`).
3. Every member's watcher thread (:class:`Admissions`) sees the ticket within :data:`POLL_S` and promises, for
   the next admission, a step it will not pass until the admission step is agreed: its own step plus
   :data:`MARGIN`. The admission step is the largest promise, so no member has passed it when it learns it: a
   rank that reaches its own promise first (gossip and local SGD do not move in lockstep) waits there for the
   others' promises, a fraction of a second.
4. At that step (between two steps, or at the start of the next epoch when it is an epoch's last) the members
   settle the replicas as for a checkpoint, write the ticket's admission (their view of the membership) and
   form the new group with the joining process; the lowest member sends it the trainer's state; and every one
   of them goes on as a run resumed from that checkpoint at the new world size would: the sync algorithm built
   for the new world from the shared state (each member keeping its own per-rank state, the new one starting
   fresh), the rest of the epoch sharded over the new world, the LR of its size.
5. The state travels while everyone trains (``engine/handover.py``): the lowest member packs it
   (copies) and sends it from a thread, over a connection of the two processes' own, in two parts. The first,
   the model and all the joining process needs before its first forward, it waits for; the rest, the optimizer's
   state (and the sync algorithm's shared state where that is read only at a step: DiLoCo's outer state),
   arrives while it computes its first step, and is loaded before that step's optimizer step. The new group is
   formed ahead too, once the admission is agreed (:meth:`Admissions._prepare`). The members stand still for the
   rebuild alone; the joining process starts one first part's transfer after them, not one whole state's.
6. Where the admission step ends with an averaging of the whole model (local SGD's, :data:`ALIGN` steps at most
   away), the joining process takes the model in it (:class:`InAveraging`): the members average over the group
   formed ahead, the process adding nothing, and the first part carries only what was not averaged. A transfer
   of the model after the averaging would hold the members up at their next one, where they wait for the new
   process's first steps; inside it, it costs the averaging a third process in its ring. Where the averaging
   needs a state the process lacks (DiLoCo's whole outer step: the outer parameters and momentum, to take the
   outer step itself), the lowest member sends it ahead, once it is final (:meth:`Joins.send_ahead`).

A join is a membership change like a loss: a member lost in the middle of one is survived as anywhere else
(``engine/failures.py``), and the admission is redone by who is left. A joining process whose sender is lost before
it has the whole state leaves the run (it can ask again): to the members, a loss like any other.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from hydra.utils import instantiate

from algorithms.base import SyncContext
from distributed.membership import LeftRun, Membership, StoreLoop
from distributed.transfer import Parcel
from distributed.world import init_distributed, nccl_environment
from engine.failures import Phase
from engine.guard import Site, training_membership
from engine.handover import Receiving, Sending, receive_ahead, split
from engine.optim import build_schedule
from engine.state import LoopState

POLL_S = 0.2  # how often a member looks for tickets
MARGIN = 3  # steps on that a member promises; it waits for the others' promises one step before its own
ALIGN = 16  # steps further a promise may go to reach the sync algorithm's own agreement (local SGD's averaging)
JOIN_FILE = "join.json"
SEND_GRACE_S = 10.0  # how long a member that ends waits for a state it still sends
FORM_WAIT_S = 5.0  # how long the averaging of an admission step waits for the group formed ahead (InAveraging)


@dataclass(frozen=True)
class JoinFile:
    """Where a run's store is, for a process that joins it: ``<run dir>/join.json``."""

    address: str
    port: int
    prefix: str  # the membership's keys
    initial_size: int
    backend: str

    @staticmethod
    def path(run_dir: str) -> str:
        return os.path.join(run_dir, JOIN_FILE)

    def write(self, run_dir: str) -> None:
        """Atomically (a joining process never reads half a file)."""
        path = self.path(run_dir)
        with open(f"{path}.tmp", "w") as f:
            json.dump(self.__dict__, f)
        os.replace(f"{path}.tmp", path)

    @classmethod
    def read(cls, run_dir: str) -> JoinFile:
        with open(cls.path(run_dir)) as f:
            return cls(**json.load(f))

    @classmethod
    def of(cls, membership: Membership) -> JoinFile | None:
        """The file for ``membership``'s run; None where its store cannot be reached from elsewhere."""
        address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not (address and port and membership.backend):
            return None
        return cls(address, int(port), membership.prefix, membership.initial_size, membership.backend)


def joining_membership(run_dir: str, hang_timeout_s: float, timeout_s: float) -> Membership:
    """The membership of a process that joins the run in ``run_dir``: no ranks yet, the run's store and keys."""
    try:
        where = JoinFile.read(run_dir)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"trainer.join=true: no {JoinFile.path(run_dir)}: the run to join writes it once it trains "
            f"(trainer.on_failure=continue); give its run dir with trainer.run_dir"
        ) from None
    if where.backend == "nccl":  # (its groups survive failures as the members' do: joins are under continue only)
        os.environ.update(nccl_environment(True))
    deadline = datetime.timedelta(seconds=hang_timeout_s)
    membership = Membership(-1, 0, hosts=[], timeout=deadline, backend=where.backend, prefix=where.prefix)
    membership.initial_size, membership.group = where.initial_size, None
    try:  # (reached within hang_timeout_s, or the run it names has ended: its store went with its first node)
        store = dist.TCPStore(where.address, where.port, is_master=False, timeout=deadline)
    except dist.DistError as error:
        raise RuntimeError(
            f"trainer.join=true: the run in {run_dir} is not reachable at {where.address}:{where.port} "
            f"({type(error).__name__}); it has ended, or its first node is gone"
        ) from None
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    membership._store = store
    return membership


def worker_membership(t: dict[str, Any], device: Any, rank: int, world_size: int, run_dir: str) -> Membership:
    """A worker's membership (``t``: the trainer section): the active ranks and their group; on a process that
    joins (``trainer.join``), the run's store and no ranks yet."""
    if t["join"]:
        return joining_membership(run_dir, t["hang_timeout_s"], t["timeout_s"])
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_distributed(backend, t["timeout_s"], t["on_failure"] == "continue")
    return training_membership(t["on_failure"], t["hang_timeout_s"], rank, world_size)


def ticket_rank(initial_size: int, ticket: int) -> int:
    """The id in the run of the process that took ``ticket`` (from 1): never one a rank had before."""
    return initial_size + ticket - 1


class Admissions:
    """The members' side: tickets seen, promises made, the admission step agreed (:meth:`due`)."""

    def __init__(self, membership: Membership, wait_s: float, agreement_at: Callable[[int], int] = lambda n: n):
        self.membership, self.wait_s = membership, wait_s
        self.agreement_at = agreement_at  # the sync algorithm's (SyncAlgorithm.agreement_at)
        self.admitted = 0  # tickets admitted so far (1..admitted)
        self.rounds = 0  # admissions carried out so far
        self.decision: dict[str, Any] | None = None  # the next admission, once agreed
        self._lock = threading.Lock()
        self._at = 0  # steps completed, as the main thread last said
        self._promise: int | None = None  # the step this rank will not pass before the next admission's is agreed
        self._watcher: StoreLoop | None = None
        # generation -> the model's tensors (by name) the processes admitted took in the averaging of the admission
        # step (:class:`InAveraging`), or None where it was tried and did not hold on every member
        self.inline: dict[int, list[str] | None] = {}

    def key(self, name: str) -> str:
        return self.membership.key(f"join/{name}")

    def start(self, step: int, run_dir: str = "") -> None:
        """Watch for tickets from ``step`` on; the logging rank publishes the run's :class:`JoinFile`."""
        self._at = step
        where = JoinFile.of(self.membership)
        if where is not None and self.membership.is_logging_rank:
            where.write(run_dir)
        self._watcher = self.membership.every(POLL_S, self._look, "relaxsync-joins").start()

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    def close(self) -> None:
        """The run has ended: processes still waiting for a ticket's admission give up."""
        self.stop()
        if self.membership.is_logging_rank:
            self.membership.store.set(self.key("closed"), "1")

    def _look(self, store: Any) -> bool:
        """In the watcher thread: a ticket not yet admitted makes this rank promise (once per admission)."""
        if self._promise is not None or int(store.add(self.key("tickets"), 0)) <= self.admitted:
            return False
        with self._lock:
            self._promise = promise = self.promise(self._at)
            round_ = self.rounds + 1
        store.set(self.key(f"{round_}/promise/{self.membership.rank}"), str(promise))
        return False

    def promise(self, at: int) -> int:
        """The step this rank promises at ``at`` steps completed: :data:`MARGIN` steps on, or, within :data:`ALIGN`
        steps after that, where the replicas next agree by the sync algorithm's own exchange (the largest promise,
        the admission step, is then such a step too where the period is the same on every rank: local SGD at
        k_steps <= ALIGN, DiLoCo at inner_steps <= ALIGN)."""
        early = at + MARGIN
        aligned = self.agreement_at(early)
        return aligned if early <= aligned <= early + ALIGN else early

    def due(self, step: int) -> dict[str, Any] | None:
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
            keys = [self.key(f"{round_}/promise/{r}") for r in m.ranks]
            if step < promise - 1 and not m.store.check(keys):
                return None
            m.store.wait(keys, datetime.timedelta(seconds=self.wait_s))
            at = max(int(value) for value in m.store.multi_get(keys))
            tickets = int(m.store.add(self.key("tickets"), 0))
            self.decision = m.propose(f"join/{round_}/decision", {"at": at, "tickets": tickets})
            self._prepare(self.decision)
        if step < self.decision["at"]:
            return None
        if step > self.decision["at"]:
            raise RuntimeError(f"rank {m.rank} is at step {step}, past the agreed admission step {self.decision['at']}")
        return self.decision

    def _prepare(self, decision: dict[str, Any]) -> None:
        """Once this rank knows the admission: form the group it will have in the background (each process it admits
        learns of it from its ticket's ``ahead`` key and does the same), so that at the admission step nobody stands
        still for it (:meth:`Membership.prepare`)."""
        m = self.membership
        ranks = self.after(self.joiners(decision))
        for t in self.tickets(decision):
            m.store.compare_set(self.key(f"ticket/{t}/ahead"), "", json.dumps([m.generation, ranks]))
        m.prepare(ranks, m.generation)

    def after(self, joiners: dict[int, str]) -> list[int]:
        """The ranks the admission of ``joiners`` makes."""
        return sorted(set(self.membership.ranks) | set(joiners))

    def tickets(self, decision: dict[str, Any]) -> range:
        """The tickets ``decision`` admits."""
        return range(self.admitted + 1, decision["tickets"] + 1)

    def prepared(self, decision: dict[str, Any], generation: int, wait_s: float) -> bool:
        """Whether every process ``decision`` admits has the state the lowest member sent it ahead of the admission
        in ``generation`` (:meth:`Joins.send_ahead`); waits up to ``wait_s`` for it."""
        m, deadline = self.membership, time.monotonic() + wait_s
        sent = self.key(f"{self.rounds + 1}/ahead")
        keys = [self.key(f"ticket/{t}/prepared/{generation}") for t in self.tickets(decision)]
        try:
            m.store.wait([sent], datetime.timedelta(seconds=wait_s))
            if int(m.store.get(sent)) != generation:  # (sent before a loss: perhaps not the state of this step)
                return False
            m.store.wait(keys, datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except dist.DistError:
            return False
        return True

    def joiners(self, decision: dict[str, Any]) -> dict[int, str]:
        """The ids admitted by ``decision``, each with its host (written with its ticket)."""
        m = self.membership
        ids = {t: ticket_rank(m.initial_size, t) for t in self.tickets(decision)}
        return {r: m.store.get(self.key(f"ticket/{t}/host")).decode() for t, r in ids.items()}

    def announce(self, decision: dict[str, Any], joiners: dict[int, str]) -> dict[str, Any]:
        """Write each ticket's admission: the members' view just before it (the first writer's, for all)."""
        m = self.membership
        record = {**m.view(), "added": joiners, "at": decision["at"], "rounds": self.rounds + 1}
        record["admitted"] = decision["tickets"]
        inline = self.inline.get(m.generation, False)
        # (formed here: formed on all of them; not after a collective on it failed, where it may be broken)
        record["ahead"] = m.ready(self.after(joiners)) and inline is not None
        record["inline"] = bool(inline)  # (the processes admitted have the model's averaged tensors)
        for t in self.tickets(decision):
            record = json.loads(m.store.compare_set(self.key(f"ticket/{t}/admission"), "", json.dumps(record)))
        return record

    def done(self, record: dict[str, Any]) -> None:
        """An admission carried out (on the members, and on the process admitted by it, which watches from now)."""
        with self._lock:
            self.admitted, self.rounds = record["admitted"], record["rounds"]
            self._promise, self.decision, self.inline = None, None, {}


class InAveraging:
    """The members' side of a join whose processes take their model in the averaging that ends at the admission
    step (``SyncContext.guests``, local SGD's): one collective over the members and them, on the group formed
    ahead for the admission, where each of them adds -0.0 (nothing, bit for bit) and divides by the members'
    count, as the members do. Nothing then follows the averaging but the small rest of the state: a transfer of the
    model after it would hold the members up at their next averaging, waiting for the new process's first steps.

    Whether the processes take part is decided once for all (the first member to get here writes it, and each
    ticket's ``inline`` key tells its process), and only where the group is formed (within :data:`FORM_WAIT_S`:
    a process that asked and died never forms it, and is found lost at the admission) and, where the processes need
    a state before it (``ahead``: DiLoCo's outer state, to take the outer step themselves), where they have it
    (:meth:`Joins.send_ahead`). Whether it held is agreed on
    the members' own group: where the collective failed on any of them, all of them average on their own group as
    they would have, and the processes take the model from the sender; a member lost there is survived as in any
    averaging (the guard redoes it, without the processes: the group formed ahead went with the change)."""

    def __init__(self, admissions: Admissions, decision: dict[str, Any], comm: Any):
        self.admissions, self.decision, self.comm = admissions, decision, comm

    def sum(self, flat: torch.Tensor, names: list[str], ahead: bool = False) -> bool:
        a, m = self.admissions, self.admissions.membership
        ranks, generation = a.after(a.joiners(self.decision)), m.generation
        key = a.key(f"{a.rounds + 1}/inline/{generation}")
        if m.store.check([key]):  # (decided: no waiting again for what the first member waited for)
            decided = m.store.get(key).decode()
        else:
            offer = None
            if m.backend == "gloo" and flat.device.type == "cpu" and m.ready(ranks, generation, FORM_WAIT_S):
                if not ahead or a.prepared(self.decision, generation, FORM_WAIT_S):
                    offer = {"contributors": m.size, "names": names, "numel": flat.numel(), "ahead": ahead}
            decided = m.store.compare_set(key, "", json.dumps(offer)).decode()
        for t in a.tickets(self.decision):
            m.store.compare_set(a.key(f"ticket/{t}/inline/{generation}"), "", decided)
        if json.loads(decided) is None:
            return False
        summed, held = flat.clone(), torch.ones(1, device=flat.device)
        try:
            self.comm.all_reduce(summed, group=m.formed_ahead(ranks, generation))
        except Exception as error:  # (a process admitted, or a member, gone: agreed on the members' group next)
            print(f"relaxsync: rank {m.rank}: the averaging with the processes joining failed: {error}", flush=True)
            held.zero_()
        if self.comm.all_reduce(held).item() < m.size:  # (a member lost: survived here, as in any averaging)
            a.inline[generation] = None
            return False
        flat.copy_(summed)
        a.inline[generation] = names
        return True


class Request:
    """The joining process's side: its ticket, then the admission that names it."""

    def __init__(
        self,
        membership: Membership,
        patience_s: float | None = None,
        averaging: Callable[[dict[str, Any], list[int], int], None] | None = None,
        receive: Callable[[int, int], bool] | None = None,
    ):
        self.membership, self.patience_s = membership, patience_s
        self.averaging = averaging  # takes part in the members' averaging (:class:`InAveraging`), where they ask
        self.receive = receive  # takes the state sent ahead by (source, generation); returns whether it did
        self.ticket: int | None = None
        self.asked_at: float | None = None

    def key(self, name: str) -> str:
        return self.membership.key(f"join/{name}")

    def ask(self) -> int:
        """Take a ticket; returns this process's id in the run."""
        m = self.membership
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.ticket = int(m.store.add(self.key("tickets"), 1))
        m.store.set(self.key(f"ticket/{self.ticket}/host"), host)
        self.asked_at = time.time()
        return ticket_rank(m.initial_size, self.ticket)

    def admission(self) -> dict[str, Any] | None:
        """Wait for the admission that names this ticket; None if the run ended first."""
        m = self.membership
        key, ahead = self.key(f"ticket/{self.ticket}/admission"), self.key(f"ticket/{self.ticket}/ahead")
        inline, sent, poll_s = "", "", POLL_S / 2
        while True:
            if m.store.check([key]):
                return json.loads(m.store.get(key))
            if ahead and m.store.check([ahead]):  # (the members know of the admission: its group forms meanwhile)
                generation, ranks = json.loads(m.store.get(ahead))
                m.prepare(ranks, generation)
                ahead, inline = "", self.key(f"ticket/{self.ticket}/inline/{generation}")
                sent = self.key(f"ticket/{self.ticket}/state/{generation}") if self.receive is not None else ""
                poll_s = POLL_S / 20  # (the members may wait for this process in their averaging)
            if sent and m.store.check([sent]):  # (a state it needs before that averaging: taken while they train)
                if self.receive(int(m.store.get(sent)), generation):
                    m.store.set(self.key(f"ticket/{self.ticket}/prepared/{generation}"), "1")
                sent = ""
            if inline and m.store.check([inline]):
                asked = json.loads(m.store.get(inline))
                if asked is not None and self.averaging is not None:
                    self.averaging(asked, ranks, generation)
                inline = ""
            if m.store.check([self.key("closed")]):
                return None
            if self.patience_s is not None and time.time() - self.asked_at > self.patience_s:
                raise TimeoutError(f"ticket {self.ticket} was not admitted within {self.patience_s:.0f} s")
            time.sleep(poll_s)


class Host(Protocol):
    """What the joins component uses of the trainer."""

    membership: Membership
    run: Any  # engine.state.RunState
    recorder: Any  # engine.metrics.Recorder
    guard: Any  # engine.guard.SurvivingGuard
    sync: Any
    loaders: Any  # data.common.Loaders
    checkpointer: Any
    rank: int
    run_dir: str

    cfg: dict[str, Any]
    data: Any  # data.common.Data
    batch_size: int
    schedule: Any  # engine.optim's LR schedule
    comm: Any  # distributed.comm.Communicator
    raw_model: Any
    optimizer: Any
    device: Any
    amp: Any  # engine.amp's backend
    criterion: Any
    loop: Any  # engine.state.LoopState

    def settle(self) -> None: ...
    def context(self, replicas_agree: bool = False) -> SyncContext: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_replica(self, state: dict[str, Any]) -> None: ...


class Joins:
    """The trainer's component for joins: on the members, an admission at each agreed step; on a process started
    with ``trainer.join=true``, its way in. Every part runs under the failure guard (:class:`Phase` ``JOIN``)."""

    def __init__(self, membership: Membership, hang_timeout_s: float, host: Host):
        self.admissions = Admissions(membership, hang_timeout_s, lambda steps: host.sync.agreement_at(steps))
        self.host = host
        self.sending: list[Sending] = []  # states still on their way to processes admitted
        self.awaiting: Callable[[], None] | None = None  # the part of its state a joining process still receives
        self.averaged_at: int | None = None  # on a joining process: the generation whose averaging gave it its model
        self.ahead: dict[int, Any] = {}  # on a joining process: the state sent ahead of its admission, by generation
        self.sent_ahead = 0  # on a member: the last admission round it sent (or skipped sending) a state ahead for

    def guests(self, steps: int) -> InAveraging | None:
        """For the averaging that completes ``steps`` steps (``SyncContext.guests``): the processes admitted there,
        if any."""
        decision = self.admissions.decision
        if decision is None or decision["at"] != steps:
            return None
        return InAveraging(self.admissions, decision, self.host.comm)

    def start(self, step: int) -> None:
        self.admissions.start(step, self.host.run_dir)

    def complete(self) -> None:
        """On a process that joined: load the rest of its state, once (:meth:`Trainer.complete` says when)."""
        awaiting, self.awaiting = self.awaiting, None
        if awaiting is not None:
            awaiting()

    def close(self) -> None:
        self.admissions.close()
        for sending in self.sending:  # (a process ending while its thread sends would abort; a joiner gone ends it)
            sending.wait(SEND_GRACE_S)

    def admit_if_due(self, epoch: int, site: Site) -> bool:
        """Admit the processes that asked to join if the members agreed on this step; between steps only while the
        epoch has steps left (at its end, the next epoch's start admits them). Returns whether it did."""
        host = self.host
        if site is Site.BETWEEN_STEPS and host.run.step_in_epoch >= host.loaders.steps_per_epoch:
            return False
        decision = host.guard.run(Phase.JOIN, partial(self.admissions.due, host.run.step), epoch, site)
        if decision is None:
            self.send_ahead()
            return False
        host.guard.run(Phase.JOIN, partial(self.admit, decision, epoch), epoch, site)
        return True

    def admit(self, decision: dict[str, Any], epoch: int) -> None:
        """On the members, at the agreed step: settle as for a checkpoint, admit the joining processes into a new
        group, send them the state (the lowest member) and go on as resumed at the new size (``reshape``). Redone
        after a loss in it: those admitted already are not admitted again."""
        host, admissions, clock = self.host, self.admissions, [time.perf_counter()]
        m = host.membership

        def lap() -> float:
            clock.append(time.perf_counter())
            return clock[-1] - clock[-2]

        host.settle()
        state = host.state_dict()  # (before the admission: a checkpoint's content at this step)
        settle_s = lap()
        joiners = admissions.joiners(decision)
        record = admissions.announce(decision, joiners)
        ahead = record["ahead"] and record["generation"] == m.generation  # (not where a loss came in between)
        if not any(change.added == sorted(joiners) for change in m.changes):  # (redone: admitted once is enough)
            m.admit(list(joiners), joiners, ahead=ahead)
        group_s = lap()
        if m.rank == _source(m, joiners):
            parts = split(state, host.sync.late_shared_state)
            if record["inline"]:  # (they have the averaged tensors: the rest of the model only)
                averaged = set(admissions.inline[record["generation"]])
                parts[0]["model"] = {k: v for k, v in parts[0]["model"].items() if k not in averaged}
            parcels = [Parcel.of(part) for part in parts]  # (copies)
            self.sending = [s for s in self.sending if s.alive()]
            self.sending += [Sending(m, r, parcels).start() for r in joiners if r in m.ranks]
        pack_s = lap()
        reshape(host, state, own=host.sync.local_state_dict())
        admissions.done(record)
        event = {"event": "rank_joined", "ranks": sorted(joiners), "hosts": joiners, "world_size": m.size}
        event["formed_ahead"] = ahead  # (the new group was formed before the admission step)
        event["in_averaging"] = record["inline"]  # (they took the model in the averaging of the admission step)
        took = {"settle_s": settle_s, "group_s": group_s, "pack_s": pack_s, "reshape_s": lap()}
        host.recorder.event({**event, "admission_s": clock[-1] - clock[0], **took}, epoch, host.run.step)

    def enter(self) -> None:
        """On a joining process: take a ticket, wait to be admitted, take the state from the lowest member and go on
        as the members do. Leaves the run (``LeftRun``) if it ends first."""
        host = self.host
        warm_up(host)
        request = Request(host.membership, averaging=self._average, receive=self._receive_ahead)
        host.rank = host.membership.rank = host.checkpointer.rank = request.ask()
        host.guard.start()  # beating from now: once admitted, the members watch this process like any other
        print(f"relaxsync: rank {host.rank} asked to join the run in {host.run_dir}", flush=True)
        record = request.admission()
        if record is None:
            raise LeftRun(host.rank, "was not admitted: the run ended first")
        host.run.step = record["at"]  # (where the members are: a loss in the admission finds it there)
        host.guard.run(Phase.JOIN, partial(self._enter, record), host.run.epoch + 1, Site.BETWEEN_STEPS)

    def _enter(self, record: dict[str, Any]) -> None:
        host, m = self.host, self.host.membership
        joiners = {int(r): name for r, name in record["added"].items()}
        if m.rank not in m.ranks:
            m.enter(record)
            m.admit(list(joiners), joiners, ahead=record["ahead"])
        receiving = Receiving(m, _source(m, joiners))
        first = receiving.first()
        if record["inline"]:  # the averaged tensors came in the members' averaging, the rest of the model here
            if self.averaged_at != record["generation"]:
                raise LeftRun(m.rank, "missed the averaging that was to give it the model")
            first = {**first, "model": {**host.raw_model.state_dict(), **first["model"]}}
        self.ahead.clear()
        host.load_replica(first)
        reshape(host, first, own=None)
        self.admissions.done(record)
        self.awaiting = partial(_complete, host, receiving.start())

    def _average(self, asked: dict[str, Any], ranks: list[int], generation: int) -> None:
        host, state = self.host, self.ahead.get(generation)
        if asked.get("ahead") and state is None:  # (not asked without it: the members wait for it to be here)
            raise RuntimeError(f"rank {host.rank} was asked into an averaging without the state sent ahead of it")
        share = partial(host.sync.take_share, host.raw_model, asked=asked, state=state)
        if take_average(host.membership, asked, ranks, generation, share):
            self.averaged_at = generation

    def _receive_ahead(self, source: int, generation: int) -> bool:
        """On a joining process: the state its sender sends before the admission step (:meth:`send_ahead`)."""
        m = self.host.membership
        try:
            self.ahead[generation] = receive_ahead(m, source, generation)
        except Exception as error:  # (its sender lost: the members do without it, and find the sender lost)
            print(f"relaxsync: rank {m.rank}: the state sent ahead of the admission did not come: {error}", flush=True)
            return False
        return True

    def send_ahead(self) -> None:
        """On the lowest member, once an admission is agreed: the state the processes it admits need before the
        averaging of the admission step (``SyncAlgorithm.guest_state``: DiLoCo's outer state, final from the outer
        step before), sent from a thread once it is final, while everyone trains; once per admission."""
        a, host = self.admissions, self.host
        decision, m, round_ = a.decision, host.membership, a.rounds + 1
        if decision is None or self.sent_ahead == round_ or m.backend != "gloo":  # (InAveraging's only)
            return
        state = host.sync.guest_state(decision["at"], host.run.step)
        if state is None:
            return
        self.sent_ahead, joiners = round_, a.joiners(decision)
        if m.rank != _source(m, joiners):
            return
        parcel = Parcel.of(state)
        self.sending += [Sending(m, r, [parcel], ahead=True).start() for r in joiners]
        for t in a.tickets(decision):
            m.store.set(a.key(f"ticket/{t}/state/{m.generation}"), str(m.rank))
        m.store.set(a.key(f"{round_}/ahead"), str(m.generation))


def take_average(
    membership: Membership, asked: dict[str, Any], ranks: list[int], generation: int, share: Callable[..., None]
) -> bool:
    """On a joining process, while it waits for its admission: its part in the members' averaging of the admission
    step (:class:`InAveraging`, which ``asked`` it), adding -0.0 to their sum; ``share`` sets the model from the sum
    (``SyncAlgorithm.take_share``). Returns whether the collective held here (the members agree whether it held on
    all of them, and the admission says)."""
    flat = torch.full((asked["numel"],), -0.0, device=torch.device("cpu"))  # (asked only where it is on the CPU)
    try:
        dist.all_reduce(flat, group=membership.formed_ahead(ranks, generation))
    except Exception as error:
        print(f"relaxsync: rank {membership.rank}: the averaging that was to give it the model failed: {error}")
        return False
    share(flat)
    return True


def warm_up(host: Host) -> None:
    """On a process about to ask to join: one forward and backward pass on a batch shaped like the training data,
    thrown away. Its first step once admitted then runs at the members' pace, not at a new process's (kernels
    chosen, memory allocated), which the members would wait for at their next exchange. What it changes is replaced
    at the admission (the model, its gradients) or restored here (every random generator it may draw from)."""
    devices = [host.device] if host.device.type == "cuda" else []
    python, numpy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=devices):
        batch, target = host.loaders.example_batch(host.batch_size)
        with host.amp.autocast():
            loss = host.criterion(host.raw_model(batch), target)
        loss.backward()
    random.setstate(python)
    np.random.set_state(numpy)
    host.amp.zero_grad(host.optimizer)


def _complete(host: Host, receiving: Receiving) -> None:
    """On a joining process, at its first optimizer step (or before anything reads its state): the rest of it."""
    rest = receiving.rest()
    host.optimizer.load_state_dict(rest["optimizer"])
    if "sync" in rest:
        host.sync.load_state_dict(rest["sync"])
    print(f"relaxsync: rank {host.rank} has its whole state: {receiving}", flush=True)


def reshape(host: Host, state: dict[str, Any], own: dict[str, Any] | None) -> None:
    """Go on as a run resumed from ``state`` (a checkpoint's content) at the membership's new size: the position at
    that size, its LR, the sync algorithm built for it with the shared state and this rank's ``own`` (None: a new
    rank's starts fresh), the rest of the epoch sharded over it."""
    m = host.membership
    host.run.resume(state, len(host.data.train), m.size, host.batch_size)
    host.schedule = build_schedule(host.cfg, len(host.data.train), m.size)
    host.sync = None  # (the old algorithm's hooks on the model, DDP's, go with it before the new one's)
    host.sync = instantiate(host.cfg["sync"])
    host.sync.setup(host.raw_model, host.optimizer, host.context(replicas_agree=True))
    if "sync" in state:  # (a joining process may take a late shared state later: split)
        host.sync.load_state_dict(state["sync"])
    if own is not None:
        host.sync.load_local_state_dict(own)
    host.loaders.build(m.size, m.index)
    host.loop = LoopState(epochs_this_run=host.loop.epochs_this_run, changes_applied=len(m.changes))
    host.recorder.elect()


def _source(membership: Membership, joiners: dict[int, str]) -> int:
    """Who sends the state to the processes admitted: the lowest member (after any loss in the admission)."""
    return min(r for r in membership.ranks if r not in joiners)
