"""Membership: the engine's quorum service. Which ranks are in the run, their process group, how they agree.

Every collective of the trainer and of the sync algorithms runs on ``Membership.group``, never on the world
group, so that one object changes when ranks leave and everything else (samplers, metric reductions, the
checkpoint writer, the logging rank) follows.

Ranks leave only through :meth:`Membership.remove`, whoever asks: relaxed sync because a rank is too slow,
and, built on the same call, a failure handler because a collective failed or a rank missed its deadline.
The call is a collective over the active ranks: each proposes the ranks to remove, all adopt the first
proposal written to the c10d store (so a divergent proposal can never split the group), the survivors build
their new group with ``new_group(..., use_local_synchronization=True)`` (the removed ranks need not take
part), and on a removed rank it raises :class:`LeftRun`. That exception is the one "this rank has left"
signal: it unwinds through whatever called it to where the worker runs, which closes its files and ends the
process with status 0 (torchrun stops every worker when one exits non-zero). A removed rank never touches a
collective again.

Under torch's elastic launcher and torchrun the store lives in the agent, so any rank, rank 0 included, can
leave; after an elastic restart the agent's store still holds the previous attempt's keys, so every key
carries the restart count.
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from distributed import runstore
from distributed.alarm import Alarm
from distributed.connections import cut, keep, noted, store_port
from distributed.etcd import configured_store
from distributed.world import node_name

_PROCESS_SECRET = secrets.token_bytes(32)
_instances = itertools.count()  # Memberships made in this process: every rank makes them in the same order
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default for a group or a store without one
_groups = itertools.count()  # groups this process built: each needs a name of its own in torch's registry
AHEAD_POLL_S = 0.02  # how often a group formed ahead looks whether all its members prepare it
SMALL_WORLD = 17  # up to this many ranks, each rank's background threads look in the store at their own period
LOOKS_S = 100  # beyond, the looks a second that one kind of background thread asks of the store, from all ranks


def look_period(period_s: float, ranks: int) -> float:
    """How often each rank of a world of ``ranks`` does what a background thread does every ``period_s`` in a small
    world (a beat, a look for a stop or a joiner): so that beyond :data:`SMALL_WORLD` ranks all of them together ask
    the store :data:`LOOKS_S` times a second (every 10 s at 1024 ranks), where every 0.2 s would ask an etcd cluster
    5,000 times a second, more than it serves."""
    return period_s if ranks <= SMALL_WORLD else max(period_s, ranks / LOOKS_S)


class LeftRun(SystemExit):
    """This rank is no longer part of the run (evicted, or given up by the others); it ends with status 0.

    A ``SystemExit`` so that, uncaught (the CAC drop-in inside a user's script), the process still exits 0,
    and so that no ``except Exception`` on the way swallows it."""

    def __init__(self, rank: int, reason: str):
        super().__init__(0)
        self.rank, self.reason = rank, reason

    def __str__(self) -> str:
        return f"rank {self.rank} {self.reason}"


@dataclass(frozen=True)
class Change:
    """One agreed change of the active ranks: some removed, or some admitted (a join)."""

    generation: int  # 1 for the first change of the run
    removed: list[int]
    ranks: list[int]  # the active ranks after it
    cause: str  # e.g. "slow", "died", "joined"
    added: list[int] = field(default_factory=list)  # ranks admitted (a join)


class Changes:
    """The one reader of a membership's changes: each :meth:`take` returns the changes since the last, oldest first.
    The trainer holds it and hands what it takes to whatever follows them (the sync algorithm's
    ``on_membership_change``, or a resize that rebuilds the algorithm for the new world)."""

    def __init__(self, changes: list[Change]):
        self._changes, self._read = changes, len(changes)

    def take(self) -> list[Change]:
        new = self._changes[self._read :]
        self._read += len(new)
        return new


Wait = Callable[[list[Any]], None]  # waits for some works (Membership.wait: one that a loss elsewhere cuts short)


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def form_group(ranks: list[int], timeout: datetime.timedelta | None = None, wait: Wait = _wait) -> dist.ProcessGroup:
    """A process group of ``ranks``, formed by them alone (``use_local_synchronization``), with one collective run on
    it at once (waited for with ``wait``). NCCL creates a communicator lazily, at its first collective, and every
    member must be in that one: a group whose first operation some members skip (crossover's leaders-only exchange)
    would wait forever. Gloo connects every pair at ``new_group``, so the CPU never shows it."""
    with noted(store_port()) as made:
        group = dist.new_group(ranks, use_local_synchronization=True, timeout=timeout)
    keep(id(group), made)
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    wait([dist.all_reduce(torch.zeros(1, device=device), group=group, async_op=True)])
    return group


def build_group(
    store: dist.Store, ranks: list[int], rank: int, backend: str, timeout: datetime.timedelta, wait: Wait = _wait
) -> Any:
    """A process group of ``ranks`` (any ids: ranks of the default group, or of processes that joined later and are
    in no group with the others), met through ``store`` (a prefix only they use), on ``gloo`` or ``nccl``, with
    one collective run on it at once (:func:`form_group` says why). Built as ``new_group`` builds one, but with
    torch's map from ids to group ranks taken from ``ranks``, so that ``send(dst=id)``, ``broadcast(src=id)``
    and DDP work on it in every member, whether or not the member is in the default group."""
    index, size, name = ranks.index(rank), len(ranks), f"relaxsync-{next(_groups)}"  # (a name per process)
    group = dist.ProcessGroup(store, index, size)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        device, kind = torch.device("cuda", torch.cuda.current_device()), dist.ProcessGroup.BackendType.NCCL
        implementation: Any = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", store), index, size, options)
    else:
        device, kind = torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO
        with noted(store_port()) as made:
            implementation = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), index, size, timeout)
        keep(id(group), made)
    group._set_default_backend(kind)
    group._register_backend(torch.device(device.type), kind, implementation)
    group._set_group_name(name)
    group._set_group_desc(name)
    mapping = {r: i for i, r in enumerate(ranks)}
    _register_in_world(group, backend, store, name, mapping)
    wait([dist.all_reduce(torch.zeros(1, device=device), group=group, async_op=True)])
    return group


def _register_in_world(group: Any, backend: str, store: dist.Store, name: str, mapping: dict[int, int]) -> None:
    """Enter ``group`` in torch's registry of groups (by name, backend, store, tag and ranks), as ``new_group`` does:
    a private helper of torch's, ``_register_pg_in_world`` in torch 2.15 and ``_update_process_group_global_state``,
    with the same arguments, in 2.11 (a cluster's torch may be older than the pinned one)."""
    c10d = dist.distributed_c10d
    if hasattr(c10d, "_register_pg_in_world"):
        c10d._register_pg_in_world(group, backend, store, name, backend, rank_mapping=mapping)
    else:
        c10d._update_process_group_global_state(group, backend, store, name, backend, rank_mapping=mapping)


def retire(groups: list[Any]) -> None:
    """Destroy groups replaced by a change (after any abort): each holds connections to its members, and a run
    that changes all day would otherwise keep one set per change open. A gloo group's connections are shut down
    first: its destructor waits for every collective still on it until the group's timeout, and after a loss two
    survivors can each hold one the other never issued (distributed/connections.py)."""
    cut([id(group) for group in groups])
    for group in groups:
        if group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)


def _members(ranks: list[int]) -> str:
    """A set of ranks in a store key: each of a few, or the first, the last and how many."""
    return "-".join(map(str, ranks)) if len(ranks) <= 16 else f"{ranks[0]}..{ranks[-1]}x{len(ranks)}"


def run_store(timeout: datetime.timedelta | None = None) -> dist.Store:
    """A connection of this process's own to the run's c10d store: the etcd cluster ``trainer.store`` names, or
    else torch's at ``MASTER_ADDR:MASTER_PORT`` (with ``timeout``, default: the default group's store's); the
    default group's store itself where those are not set."""
    default_timeout = dist.distributed_c10d._get_default_store().timeout if dist.is_initialized() else None
    etcd = configured_store(timeout or default_timeout or DEFAULT_TIMEOUT)
    if etcd is not None:
        return etcd
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if dist.is_initialized():
        default = dist.distributed_c10d._get_default_store()
        if not (address and port):
            return default
        timeout = timeout or default.timeout
    return dist.TCPStore(address, int(port), is_master=False, timeout=timeout or DEFAULT_TIMEOUT)


def host_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()  # (Slurm's name)


def host_names() -> tuple[list[str], list[str]]:
    """Collective over the world group: every rank's host name and node name (:func:`distributed.world.node_name`),
    in rank order."""
    where: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(where, (host_name(), node_name()))
    return [host for host, _ in where], [node for _, node in where]


class Membership:
    """The set of active global ranks, their process group, and agreement among them."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None = None,
        hosts: list[str] | None = None,
        timeout: datetime.timedelta | None = None,
        backend: str | None = None,
        prefix: str | None = None,
        nodes: list[str] | None = None,
    ):
        # The run's secret, which every presence connection proves (distributed/secret.py): the run's, set by the
        # worker's build (engine/elastic/build.py); until then this process's own (shared by the memberships of one
        # process: a simulated world's)
        self.secret = _PROCESS_SECRET
        self.rank = rank
        self.timeout = timeout  # of every group formed after a change (None: the default group's)
        self.initial_size = world_size
        self.ranks: list[int] = list(range(world_size))
        self.group = group if group is not None else dist.group.WORLD
        self.hosts = hosts if hosts is not None else [""] * world_size  # rank -> host name, for the record
        # rank -> node name (distributed.world.node_name; default: a node of its own per rank)
        self.nodes = nodes if nodes is not None else [f"rank{r}" for r in range(world_size)]
        # True at node scope: a rank removed takes every active rank of its node with it (node_ranks), so that the
        # nodes stay whole and alike (each one's processes carry an equal share of the exchange across nodes)
        self.whole_nodes = False
        self.generation = 0  # how many changes so far
        self.changes: list[Change] = []  # every change of this run seen by this rank, oldest first
        # "gloo" or "nccl": groups are built on the run's store (build_group), and processes that join later can be
        # in them; None: torch's new_group, over ranks of the default group only.
        self.backend = backend
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = prefix or f"relaxsync/restart{restart}/membership{next(_instances)}"
        self._agreements = 0
        self._store: Any = None
        self._subgroups: list[dist.ProcessGroup] = []  # groups of some active ranks, replaced with the active group
        self._formed: dict[tuple[int, tuple[int, ...]], int] = {}  # groups built per (generation, ranks)
        self.alarm = Alarm()  # rung when another rank saw a peer lost (distributed/alarm.py)
        self._aborted: set[int] = set()  # ids of the groups aborted so far (each is aborted once)
        self._aborting = threading.Lock()
        self._ahead: dict[tuple[int, tuple[int, ...]], Ahead] = {}  # groups formed ahead of a removal (prepare)
        self._ahead_lock = threading.Lock()
        self._dropped: list[Ahead] = []  # groups formed ahead and not taken, still forming at the last change

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def processes(self) -> int:
        """The active processes (:attr:`size` too, here; at node scope, where an algorithm's ``size`` counts nodes,
        still the processes: ``distributed/nodes.py``)."""
        return len(self.ranks)

    @property
    def index(self) -> int:
        """This rank's position among the active ranks (its rank inside ``group``)."""
        return self.ranks.index(self.rank)

    @property
    def logging_rank(self) -> int | None:
        """The lowest active rank writes logs, metrics and checkpoints (None on a process not yet admitted)."""
        return min(self.ranks, default=None)

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == self.logging_rank

    # ---- nodes ---------------------------------------------------------------------------------------------------
    def node_ranks(self, rank: int | None = None) -> list[int]:
        """The active ranks on the node of ``rank`` (default: this one), in order."""
        node = self.nodes[self.rank if rank is None else rank]
        return [r for r in self.ranks if self.nodes[r] == node]

    def node_ids(self) -> list[int]:
        """The active nodes, each named by its lowest active rank (a name that lasts while the node is whole), in
        order."""
        return sorted({self.node_ranks(r)[0] for r in self.ranks})

    def with_their_nodes(self, ranks: list[int]) -> list[int]:
        """``ranks`` and, under :attr:`whole_nodes`, every active rank on the same nodes."""
        if not self.whole_nodes:
            return sorted(set(ranks))
        return sorted({s for r in ranks if r in self.ranks for s in self.node_ranks(r)} | set(ranks))

    # ---- agreement -------------------------------------------------------------------------------------------
    @property
    def store(self) -> dist.Store:
        """The c10d store every rank of the run reaches, and a process that joins it later: a connection of this
        process's own to the etcd cluster of ``trainer.store``, or else to ``MASTER_ADDR:MASTER_PORT`` (torchrun's
        agent, the local launcher's, task 0 under srun); without those, the default group's store."""
        if self._store is None:
            self._store = run_store()
        return self._store

    def key(self, name: str) -> str:
        """A store key of this run (and restart) named ``name``."""
        return f"{self.prefix}/{name}"

    def agree(self, topic: str, proposal: Any) -> Any:
        """Collective over the active ranks, in call order: every rank proposes a JSON-able value and every
        rank gets back the first one written to the store (first writer wins)."""
        self._agreements += 1
        return self.propose(f"{self._agreements}/{topic}", proposal)

    def propose(self, name: str, proposal: Any) -> Any:
        """Not a collective: write ``proposal`` under ``name`` unless a value is there already; return the
        value that is (first writer wins). Ranks that call it at different moments still get the same value."""
        return json.loads(self.store.compare_set(self.key(name), "", json.dumps(proposal)))

    def remove(self, ranks: list[int], cause: str, reasons: dict[int, str] | None = None) -> Change | None:
        """Collective over the active ranks: agree on the ranks to remove (each rank proposes ``ranks``), then
        regroup. Returns the change on the survivors (None when the agreed set is empty); on a removed rank it
        prints ``reasons[rank]`` (or ``cause``) and raises :class:`LeftRun`."""
        return self.adopt(self.agree("remove", {"ranks": sorted(set(ranks)), "cause": cause}), reasons)

    def adopt(
        self, agreed: dict[str, Any], reasons: dict[int, str] | None = None, abort_replaced: bool = False
    ) -> Change | None:
        """Carry out an agreed removal (``{"ranks": [...], "cause": ...}``, the same on every rank): the survivors
        form their new group (:func:`form_group`); a removed rank raises :class:`LeftRun`. With ``abort_replaced``
        (a rank was lost) each survivor first aborts the groups it replaces, the active one and its
        :meth:`subgroup` s, never the default one: on NCCL a collective of an old group may still be waiting on the
        lost rank, and what the survivors queue next, the new group's first collective included, would wait
        behind it."""
        removed = [r for r in self.with_their_nodes(agreed["ranks"]) if r in self.ranks]
        if not removed:
            return None
        survivors = [r for r in self.ranks if r not in removed]
        with self._ahead_lock:  # (a group asked for from the old generation after this is not prepared)
            self.generation += 1
        replaced = [g for g in (self.group, *self._subgroups) if g is not None]
        self.ranks, self.group, self._subgroups = survivors, None, []
        if self.rank in removed:
            reason = (reasons or {}).get(self.rank, f"removed ({agreed['cause']})")
            print(f"relaxsync: rank {self.rank} {reason}; exiting", flush=True)
            raise LeftRun(self.rank, reason)
        # The change holds from here on, whether or not the group forms: if a survivor is lost while it forms, the
        # next agreement starts from these ranks on every survivor, and the change is followed with the next one.
        self.changes.append(Change(self.generation, removed, survivors, agreed["cause"]))
        replaced = [
            g for g in replaced if g is not dist.group.WORLD
        ]  # (never the default group: no way to form one again)
        if abort_replaced:
            for group in replaced:
                self._abort(group)
        ahead = self._take_ahead(self.generation - 1, survivors) if agreed.get("ahead") else None
        self.group = ahead.take() if ahead is not None else self.form(survivors)
        retire(replaced + self._drop_ahead())
        return self.changes[-1]

    def renew(self, agreed: dict[str, Any]) -> Change:
        """Carry out an agreement that nobody is gone after a failure (``agreed["ranks"]`` empty: an alarm that found
        every rank alive): the same ranks, a new generation (what the alarm woke stays in the old one) and a new
        group, the replaced ones aborted first (a collective of theirs may be cut short on some ranks only)."""
        with self._ahead_lock:
            self.generation += 1
        replaced = [g for g in (self.group, *self._subgroups) if g is not None and g is not dist.group.WORLD]
        self.group, self._subgroups = None, []
        self.changes.append(Change(self.generation, [], list(self.ranks), agreed["cause"]))
        for group in replaced:
            self._abort(group)
        self.group = self.form(list(self.ranks))
        retire(replaced + self._drop_ahead())
        return self.changes[-1]

    # ---- groups formed ahead of a removal ---------------------------------------------------------------------
    def prepare(self, ranks: list[int], generation: int) -> None:
        """From any thread: form, in a thread of its own, the group that ``ranks`` would have after the next change
        from ``generation`` (once per set): the survivors of a removal (each survivor whose heartbeat saw the same
        peers silent prepares it), or the members and the processes of an agreed admission. A change agreed with
        ``"ahead": true`` (:meth:`ready`, on the rank that proposed it) then takes it instead of forming one while
        everyone stands still. Gloo only: NCCL forms its communicator at the group's first collective, on the
        streams the training uses."""
        if self.backend != "gloo" or self.rank not in ranks:
            return
        key = (generation, tuple(ranks))
        with self._ahead_lock:
            if key in self._ahead or generation < self.generation:  # (a change came since it was asked for)
                return
            store = dist.PrefixStore(self.key(f"ahead/{key[0]}/{_members(ranks)}/"), self.store.clone())
            self._ahead[key] = Ahead(store, list(ranks), self.rank, self.timeout or DEFAULT_TIMEOUT)

    def ready(self, ranks: list[int], generation: int | None = None, wait_s: float = 0.0) -> bool:
        """Whether the group :meth:`prepare` forms for ``ranks`` from ``generation`` (default: this one) is formed on
        this rank, and so on every one of them: its forming ends with a collective over all of them. Waits up to
        ``wait_s`` for a group being formed."""
        with self._ahead_lock:
            ahead = self._ahead.get((self.generation if generation is None else generation, tuple(ranks)))
        if ahead is not None and wait_s > 0:
            ahead.wait(wait_s)
        return ahead is not None and ahead.formed()

    def formed_ahead(self, ranks: list[int], generation: int) -> Any:
        """The group formed ahead for ``ranks`` from ``generation``, for a collective of theirs before the change
        that takes it (a join's averaging, ``engine/elastic``); it stays to be taken. Waits for the forming thread
        (it is formed on every member once formed on one: moments away)."""
        with self._ahead_lock:
            ahead = self._ahead.get((generation, tuple(ranks)))
        if ahead is None:
            raise RuntimeError(f"rank {self.rank} has no group of {ranks} formed ahead at generation {generation}")
        return ahead.take()

    def _take_ahead(self, generation: int, survivors: list[int]) -> Ahead:
        with self._ahead_lock:
            ahead = self._ahead.pop((generation, tuple(survivors)), None)
        if ahead is None:  # (the rank that proposed it formed it with this one: it must be here)
            raise RuntimeError(f"rank {self.rank} has no group of {survivors} formed ahead at generation {generation}")
        return ahead

    def _drop_ahead(self) -> list[Any]:
        """After a change: the groups formed ahead of another one, to retire, now or, those still forming, at a
        later change."""
        with self._ahead_lock:
            dropped, self._ahead = [*self._dropped, *self._ahead.values()], {}
            for ahead in dropped:
                ahead.cancel()
            self._dropped = [ahead for ahead in dropped if ahead.alive()]
        return [ahead.group for ahead in dropped if ahead.formed()]

    def cancel_ahead(self) -> None:
        """At the end of the process: call off every group being formed ahead."""
        self._drop_ahead()

    def _abort(self, group: Any) -> None:
        with self._aborting:
            if id(group) in self._aborted or group not in dist.distributed_c10d._world.pg_map:
                return
            self._aborted.add(id(group))
        dist.distributed_c10d._abort_process_group(group)

    # ---- waits that a loss seen elsewhere cuts short ----------------------------------------------------------
    def wait(self, works: list[Any]) -> None:
        """Wait for each of ``works`` (issued on this generation's groups) within ``timeout``: each is done, fails
        (its error is raised), passes the deadline, or is given up with :class:`~distributed.alarm.PeerLost` once
        another rank saw a peer lost (:meth:`ring`)."""
        generation = self.generation
        self.alarm.check(generation)
        if self._on_gpu():  # NCCL's wait polls the GPU's work up to the deadline; ring() aborts the communicator
            for work in works:
                work.wait() if self.timeout is None else work.wait(self.timeout)
            return
        self.alarm.wait(works, generation, self.timeout)

    def relay(self, future: Any) -> Any:
        """``future`` (of a collective of this generation), or :class:`~distributed.alarm.PeerLost` once another rank
        saw a peer lost: what a DDP comm hook returns, as DDP waits for it where nothing else can end the wait. On
        NCCL ``future`` itself: its CUDA events order the streams, and :meth:`wait` after the backward pass is where
        a lost peer surfaces there."""
        return future if self._on_gpu() else self.alarm.relay(future, self.generation)

    def ring(self, generation: int, why: str) -> None:
        """Another rank saw a collective of ``generation`` fail: every wait of it ends with ``PeerLost``, and on
        NCCL the generation's groups are aborted (what ends a wait there). From any thread; once per generation."""
        if not self.alarm.ring(generation, why) or generation != self.generation or not self._on_gpu():
            return
        for group in [g for g in (self.group, *self._subgroups) if g is not None and g is not dist.group.WORLD]:
            self._abort(group)

    def _on_gpu(self) -> bool:
        if self.backend is not None:
            return self.backend == "nccl"
        group = self.group  # (None while a group forms: gloo's wait then, which ends as NCCL's does)
        return group is not None and dist.get_backend(group) == "nccl"

    def subgroup(self, ranks: list[int]) -> dist.ProcessGroup:
        """A group of some of the active ranks (only they call it), for an algorithm's own use until the next
        change, which replaces it with the active group (and aborts it after a loss)."""
        group = self.form(ranks)
        self._subgroups.append(group)
        return group

    def form(self, ranks: list[int]) -> dist.ProcessGroup:
        """Collective over ``ranks`` (only they call it): their process group, after :func:`form_group`'s first
        collective. Built on the run's store when the membership has a backend (processes that joined can be in
        it), through torch's ``new_group`` otherwise."""
        if self.backend is None:
            return form_group(ranks, self.timeout, self.wait)
        formed = (self.generation, tuple(ranks))
        self._formed[formed] = n = self._formed.get(formed, 0) + 1
        store = dist.PrefixStore(self.key(f"group/{self.generation}/{_members(ranks)}/{n}/"), self.store)
        return build_group(store, ranks, self.rank, self.backend, self.timeout or DEFAULT_TIMEOUT, self.wait)

    def admit(
        self, added: list[int], hosts: dict[int, str], ahead: bool = False, nodes: dict[int, str] | None = None
    ) -> Change:
        """Carry out an agreed admission of the ranks ``added`` (processes that asked to join, each with its host):
        a collective over the active ranks and the admitted ones (which :meth:`enter` first). Their group (formed
        ahead, :meth:`prepare`, where the admission says so) replaces the active one; nobody leaves, nothing is
        aborted."""
        with self._ahead_lock:
            self.generation += 1
        self.ranks = sorted(set(self.ranks) | set(added))
        for r in added:
            self.hosts.extend([""] * (r + 1 - len(self.hosts)))
            self.nodes.extend(f"rank{len(self.nodes) + i}" for i in range(r + 1 - len(self.nodes)))
            self.hosts[r] = hosts.get(r, "")
            self.nodes[r] = (nodes or {}).get(r, f"rank{r}")
        self.changes.append(Change(self.generation, [], list(self.ranks), "joined", sorted(added)))
        replaced = [g for g in (self.group, *self._subgroups) if g is not None and g is not dist.group.WORLD]
        self.group, self._subgroups = None, []
        self.group = self._take_ahead(self.generation - 1, self.ranks).take() if ahead else self.form(self.ranks)
        retire(replaced + self._drop_ahead())
        return self.changes[-1]

    def enter(self, record: dict[str, Any]) -> None:
        """On a process admitted into a running world: take the members' view (``record``, written by them with
        :meth:`view`) as it is just before the admission, which :meth:`admit` then carries out here too."""
        self.ranks, self.generation = list(record["ranks"]), record["generation"]
        self.initial_size, self.hosts = record["initial_size"], list(record["hosts"])
        self.nodes = list(record.get("nodes") or [f"rank{r}" for r in range(len(self.hosts))])
        self.whole_nodes = record.get("whole_nodes", False)
        self._agreements = record["agreements"]

    def follow(self) -> Changes:
        """A reader of the changes from now on (:class:`Changes`)."""
        return Changes(self.changes)

    def view(self) -> dict[str, Any]:
        """What a process admitted now needs to agree with the members from then on (:meth:`enter`)."""
        return {
            "ranks": self.ranks,
            "generation": self.generation,
            "initial_size": self.initial_size,
            "hosts": self.hosts,
            "nodes": self.nodes,
            "whole_nodes": self.whole_nodes,
            "agreements": self._agreements,
        }

    def every(
        self, period_s: float, tick: Callable[[Any], bool], name: str, hurried: bool = False, spread: bool = False
    ) -> StoreLoop:
        """A background thread (not started) calling ``tick(store)`` every ``period_s`` on a store connection of
        its own, so that it never waits behind the main thread's blocking store calls; ``hurried``: a replicated
        store's call moves to another member after a short wait (``EtcdStore.hurried``: a heartbeat's); ``spread``:
        every :func:`look_period` of ``period_s`` for the active ranks of the moment instead."""
        store = self.store.clone()
        if hurried:
            store = runstore.of(store).hurried()
        return StoreLoop(store, period_s, tick, name, (lambda: len(self.ranks)) if spread else None)

    def __repr__(self) -> str:
        return f"Membership(rank={self.rank}, ranks={self.ranks}, initial_size={self.initial_size})"


class Ahead:
    """A group formed in a thread of its own (:meth:`Membership.prepare`). The thread starts forming it only once
    every member has said it prepares it too (before that it can be called off, :meth:`cancel`, and a prepared group
    some members never prepare, because a change came first, is called off at the next change): gloo's forming
    waits in C++ until every member is there, where nothing can end it but the group's timeout. Whether it forms is
    decided once for all its members, through the store (first writer wins): all of them form it, or none. The
    thread is not a daemon, so that the interpreter never ends while it is in there (that aborts the process)."""

    def __init__(self, store: dist.Store, ranks: list[int], rank: int, timeout: datetime.timedelta):
        self.group: Any = None
        self.error: BaseException | None = None
        self._args = (store, ranks, rank, timeout)
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._form, name="relaxsync-group-ahead")
        self._thread.start()

    def _form(self) -> None:
        store, ranks, rank, timeout = self._args
        try:
            store.set(f"preparing/{rank}", "1")
            everyone, deadline = [f"preparing/{r}" for r in ranks], time.monotonic() + timeout.total_seconds()
            while True:
                if store.check(everyone):
                    fate = store.compare_set("fate", "", "form")
                    break
                if self._cancelled.wait(AHEAD_POLL_S) or time.monotonic() > deadline:
                    fate = store.compare_set("fate", "", "off")
                    break
            # The first member to see all of them prepared, or to be called off, decides for all: one called off
            # after another saw them all prepared forms the group all the same (to let it go), as the others wait
            # for it in gloo's forming.
            if fate == b"form":
                self.group = build_group(store, ranks, rank, "gloo", timeout)
        except Exception as error:  # (its members went elsewhere: never taken)
            self.error = error

    def cancel(self) -> None:
        """Call it off, unless its members decided to form it already (a change came first, or the process ends)."""
        self._cancelled.set()

    def formed(self) -> bool:
        return not self._thread.is_alive() and self.group is not None

    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def take(self) -> Any:
        """The group, once formed (every member formed it with the one that proposed taking it: moments away)."""
        self._thread.join()
        if self.group is None:
            raise RuntimeError(f"the group formed ahead did not form: {self.error}")
        return self.group


class StoreLoop:
    """A daemon thread that calls ``tick(store)`` every ``period_s`` seconds (first at once) until ``tick`` returns
    True, the store becomes unreachable (its node died: nothing more to learn from it or tell it), or ``stop()``."""

    def __init__(
        self,
        store: Any,
        period_s: float,
        tick: Callable[[Any], bool],
        name: str,
        ranks: Callable[[], int] | None = None,
    ):
        self.store, self.period_s, self.tick = store, period_s, tick
        self.ranks: Callable[[], int] | None = ranks  # (given: the period is look_period's for that many ranks)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> StoreLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()

    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                if self.tick(self.store):
                    return
            except Exception:
                return
            self._done.wait(look_period(self.period_s, self.ranks()) if self.ranks is not None else self.period_s)
