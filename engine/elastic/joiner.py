"""The joiner's side of a join (steps 2, 5 and 6 of the protocol, ``engine/elastic/__init__.py``): its membership
on the run's store (:func:`joiner_membership`), its ticket and the wait for its admission (:class:`Request`), its
share in the members' averaging (:func:`take_average`), and the face it trains behind once admitted
(:class:`Joiner`, a :class:`Surviving` that first asks its way in)."""

from __future__ import annotations

import datetime
import json
import os
import socket
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from distributed.etcd import STORE_ENV, TLS_SCHEME, EtcdStore, Tls
from distributed.etcd import parse as parse_store
from distributed.membership import LeftRun, Membership
from distributed.world import nccl_environment, node_name
from engine.elastic.admissions import POLL_S
from engine.elastic.face import Host, Resize, Surviving, sender
from engine.elastic.guard import SurvivingGuard
from engine.elastic.handover import Receiving, receive_advance
from engine.elastic.positions import Phase, Site
from engine.elastic.records import Admission, JoinFile, Keys, NodeTicket, Notice, Offer, ticket_rank
from engine.launchers import WORLD_ENV
from errors import ConfigError


def joiner_membership(run_dir: str, hang_timeout_s: float, timeout_s: float) -> Membership:
    """The membership of a joiner of the run in ``run_dir``: no ranks yet, the run's store and keys."""
    try:
        where = JoinFile.read(run_dir)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"trainer.join=true: no {JoinFile.path(run_dir)}: the run to join writes it once it trains "
            f"(trainer.on_failure=continue); give its run dir with trainer.run_dir"
        ) from None
    if where.world:  # (one world with the run's: it may come to hold the run dir as its logging rank)
        os.environ[WORLD_ENV] = where.world
    if where.backend == "nccl":  # (its groups survive failures as the members' do: joins are under continue only)
        os.environ.update(nccl_environment(True))
    deadline = datetime.timedelta(seconds=hang_timeout_s)
    membership = Membership(-1, 0, hosts=[], timeout=deadline, backend=where.backend, prefix=where.prefix)
    membership.initial_size, membership.group = where.initial_size, None
    try:  # (reached within hang_timeout_s, or the run it names has ended: its store went with its first node)
        if where.store:  # (an etcd cluster's: every later part of this process opens it too)
            os.environ[STORE_ENV] = where.store
            tls = Tls.from_environ() if where.store.startswith(TLS_SCHEME) else None
            if where.store.startswith(TLS_SCHEME) and tls is None:
                needed = f"the CA, a certificate, a key: the run's store is {where.store}"
                raise ConfigError("trainer.store_tls", None, needed)
            store = EtcdStore(parse_store(where.store)[0], where.store_root, deadline, tls=tls)
            store.check(["joining"])
        else:
            store = dist.TCPStore(where.address, where.port, is_master=False, timeout=deadline)
    except dist.DistError as error:
        raise RuntimeError(
            f"trainer.join=true: the run in {run_dir} is not reachable at "
            f"{where.store or f'{where.address}:{where.port}'} "
            f"({type(error).__name__}); it has ended, or its first node is gone"
        ) from None
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    membership._store = store
    return membership


class Request:
    """The joiner's ticket, then the wait for the admission that names it."""

    def __init__(
        self,
        membership: Membership,
        patience_s: float | None = None,
        averaging: Callable[[Offer, list[int], int], None] | None = None,
        receive: Callable[[int, int], bool] | None = None,
    ):
        self.membership, self.patience_s, self.keys = membership, patience_s, Keys(membership)
        self.averaging = averaging  # takes part in the members' averaging (``InAveraging``), where offered
        self.receive = receive  # takes the advance state by (sender, generation); returns whether it did
        self.ticket: int | None = None
        self.asked_at: float | None = None

    def ask(self) -> int:
        """Take a ticket; returns this joiner's id in the run."""
        m = self.membership
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.ticket = int(m.store.add(self.keys.tickets(), 1))
        m.store.set(self.keys.host(self.ticket), host)
        # (at node scope a node joins whole: how many processes its launcher starts there)
        processes = int(os.environ.get("RELAXSYNC_NODE_SIZE") or os.environ.get("LOCAL_WORLD_SIZE", "1"))
        m.store.set(self.keys.node(self.ticket), NodeTicket(node_name(), processes).wire())
        self.asked_at = time.time()
        return ticket_rank(m.initial_size, self.ticket)

    def admission(self) -> Admission | None:
        """Wait for the admission that names this ticket; None if the run ended first."""
        m, keys, ticket = self.membership, self.keys, self.ticket
        admitted, notice, offer, advance, poll_s = keys.admission(ticket), keys.notice(ticket), "", "", POLL_S / 2
        while True:
            if m.store.check([admitted]):
                return Admission.read(m.store.get(admitted))
            if notice and m.store.check([notice]):  # (the members know of the admission: its group forms meanwhile)
                told = Notice.read(m.store.get(notice))
                generation = told.generation
                m.prepare(told.ranks, generation)
                notice, offer = "", keys.ticket_offer(ticket, generation)
                advance = keys.advance_from(ticket, generation) if self.receive is not None else ""
                poll_s = POLL_S / 20  # (the members may wait for this joiner in their averaging)
            if advance and m.store.check([advance]):  # (a state it needs before that averaging: taken meanwhile)
                if self.receive(int(m.store.get(advance)), generation):
                    m.store.set(keys.prepared(ticket, generation), "1")
                advance = ""
            if offer and m.store.check([offer]):
                offered = Offer.read(json.loads(m.store.get(offer)))
                if offered is not None and self.averaging is not None:
                    self.averaging(offered, told.ranks, generation)
                offer = ""
            if m.store.check([keys.closed()]):
                return None
            if self.patience_s is not None and time.time() - self.asked_at > self.patience_s:
                raise TimeoutError(f"ticket {ticket} was not admitted within {self.patience_s:.0f} s")
            time.sleep(poll_s)


def take_average(
    membership: Membership, offer: Offer, ranks: list[int], generation: int, share: Callable[..., None]
) -> bool:
    """On a joiner, while it waits for its admission: its part in the members' averaging of the admission step
    (``InAveraging``, which offered it), adding -0.0 to their sum; ``share`` sets the model from the sum
    (``SyncAlgorithm.take_share``). Returns whether the collective held here (the members agree whether it held on
    all of them, and the admission says)."""
    flat = torch.full((offer.numel,), -0.0, device=torch.device("cpu"))  # (offered only where it is on the CPU)
    try:
        dist.all_reduce(flat, group=membership.formed_ahead(ranks, generation))
    except Exception as error:
        print(f"relaxsync: rank {membership.rank}: the averaging that was to give it the model failed: {error}")
        return False
    share(flat)
    return True


class Joiner(Surviving):
    """``trainer.join=true``: a process that asks its way into a running world, then trains as a member. Until its
    admission it has no state of its own to resume from and sets nothing up (its admission's :class:`Resize` does)."""

    def __init__(self, membership: Membership, comm: Any, hang_timeout_s: float, run_dir: str, model: Any):
        super().__init__(membership, comm, hang_timeout_s, run_dir)
        self.model = model  # the replica it sets from its share of an averaging, before anything else is set up
        self.averaged_at: int | None = None  # the generation whose averaging gave it its model
        self.advance: dict[int, Any] = {}  # the advance state, by the members' generation

    def resume(self, load: Callable[[], dict[str, Any] | None]) -> None:
        """None: its state comes with its admission."""
        return None

    def attach(self, host: Host, begin: Callable[[], None]) -> None:
        """(It begins at its admission, :meth:`enter`, with the :class:`Resize` that carries it out.)"""
        self.host, self.guard = host, SurvivingGuard(self.membership, self.hang_timeout_s, host)

    def start(self, step: int) -> None:
        """Ask, be admitted (the guard beats from the ticket on), then watch for joiners as a member does."""
        self.enter()
        self.admissions.start(self.host.run.step, self.run_dir)

    def enter(self) -> None:
        """Take a ticket, wait to be admitted, take the state from the sender and go on as the members do. Leaves
        the run (``LeftRun``) if it ends first."""
        host, m = self.host, self.membership
        host.rehearse()
        request = Request(m, averaging=self._average, receive=self._receive_advance)
        m.rank = request.ask()
        self.guard.start()  # beating from now: once admitted, the members watch this joiner like any other
        print(f"relaxsync: rank {m.rank} asked to join the run in {self.run_dir}", flush=True)
        record = request.admission()
        if record is None:
            raise LeftRun(m.rank, "was not admitted: the run ended first")
        host.joined_at(record.at)  # (where the members are: a loss in the admission finds it there)
        self.guard.run(Phase.JOIN, partial(self._enter, record), host.run.epoch + 1, Site.BETWEEN_STEPS)

    def _enter(self, record: Admission) -> None:
        m = self.membership
        if m.rank not in m.ranks:
            m.enter(record.view)
            m.admit(list(record.added), record.added, ahead=record.ahead, nodes=record.nodes)
        receiving = Receiving(m, sender(m, record.added))
        first = receiving.first()
        if record.inline and self.averaged_at != record.generation:
            raise LeftRun(m.rank, "missed the averaging that was to give it the model")
        self.advance.clear()
        rest = partial(_rest, receiving.start())
        # (inline: the averaged tensors came in the members' averaging, the rest of the model here)
        self.host.resize(Resize(first, own=None, replica=True, partial_model=record.inline, rest=rest))
        self.admissions.done(record)

    def _average(self, offer: Offer, ranks: list[int], generation: int) -> None:
        host, state = self.host, self.advance.get(generation)
        if offer.advance and state is None:  # (not offered without it: the members wait for it to be here)
            raise RuntimeError(f"rank {self.membership.rank} was offered an averaging without the advance state")
        share = partial(host.sync.take_share, self.model, asked=offer.wire(), state=state)
        if take_average(self.membership, offer, ranks, generation, share):
            self.averaged_at = generation

    def _receive_advance(self, source: int, generation: int) -> bool:
        m = self.membership
        try:
            self.advance[generation] = receive_advance(m, source, generation)
        except Exception as error:  # (its sender lost: the members do without it, and find the sender lost)
            print(f"relaxsync: rank {m.rank}: the advance state did not come: {error}", flush=True)
            return False
        return True


def _rest(receiving: Receiving, optimizer: Any, sync: Any) -> None:
    """On a joiner, at its first optimizer step (or before anything reads its state): the rest of it."""
    rest = receiving.rest()
    optimizer.load_state_dict(rest["optimizer"])
    if "sync" in rest:
        sync.load_state_dict(rest["sync"])
    print(f"relaxsync: rank {receiving.membership.rank} has its whole state: {receiving}", flush=True)
