"""Every collective of every algorithm goes through the Communicator, which counts what it costs.

Two byte counts per step, both the *mean over the active ranks* so that any rank can report them without
an extra collective (every collective's per-rank traffic is known from its shape):

* ``payload_bytes``: bytes of the tensors handed to collectives.
* ``bytes_sent``: wire bytes under the bandwidth-optimal model. Ring allreduce of S bytes over N ranks sends
  2(N-1)/N * S per rank; allgather of s bytes per rank sends (N-1)*s; a point-to-point send of s bytes sends
  s from the sender; a broadcast of S bytes sends S from the root (S/N per rank on average).

``comm_s`` is the wall time this rank spent inside blocking collectives, plus, for asynchronous ones
(DDP's bucket allreduces), the time from launch to completion, which may overlap computation. On a GPU
(``clock.on_device``: the CPU only queues collectives there, and NCCL runs them on streams of its own) it is each
collective's time on the GPU instead, from NCCL's own events, read once it completed: in the step that issued it,
or in a later one (``distributed/clock.py``).

The trainer takes the counts after every step (:meth:`Communicator.take`); they are the Communicator's own
type (:class:`CommCounts`), apart from what a hook reports (``algorithms.base.SyncReport``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distributed.clock import Clock, device_seconds
from distributed.membership import Membership
from distributed.topology import round_robin


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class CommCounts:
    """Traffic and time of training communication, mean per active rank."""

    bytes_sent: float = 0.0  # modeled wire bytes (see the module docstring)
    payload_bytes: float = 0.0  # bytes of tensors handed to collectives
    comm_s: float = 0.0
    node_bytes: float = 0.0  # at node scope, modeled bytes between the processes of a node (its fast link)

    def add(self, bytes_sent: float, payload_bytes: float, seconds: float) -> None:
        self.bytes_sent += bytes_sent
        self.payload_bytes += payload_bytes
        self.comm_s += seconds


def _completed(work: Any) -> bool:
    try:
        return work.is_completed()
    except RuntimeError:  # (a work of an aborted group: it will not complete)
        return True


class Pending:
    """A collective in flight. Its bytes were counted when it was issued; :meth:`wait` blocks until it is done,
    counts the time blocked as communication, and returns its result (the tensor(s) it filled).

    One rule for work in flight across a change of the active ranks (a lost peer): a collective issued on a group
    that has since been replaced is **dropped**, alike on every survivor. Its :meth:`wait` returns None at once,
    without touching the old group (where it may never finish, or may have finished on some ranks only), and the
    algorithm goes on as if it had never been issued."""

    def __init__(self, comm: Communicator, works: list[Any], result: Any = None):
        self.comm, self.works, self.result = comm, works, result
        self.generation = comm.membership.generation  # of the group it was issued on

    @property
    def dropped(self) -> bool:
        return self.generation != self.comm.membership.generation

    def is_completed(self) -> bool:
        return self.dropped or all(work.is_completed() for work in self.works)

    def wait(self) -> Any:
        """The result, or None for a dropped collective. Under a deadline (the membership's ``timeout``,
        ``trainer.hang_timeout_s`` under ``trainer.on_failure: continue``) a collective that fails or passes it
        raises here, on every backend: NCCL's plain ``wait()`` only makes the current stream wait, so a lost peer
        would surface later, in whatever next reads a result, where nothing interrupts the wait."""
        if self.dropped:
            return None
        start = time.perf_counter()
        self.comm.membership.wait(self.works)
        if not self.comm.clock.on_device:  # (on a device, the collectives' own time was counted at their issue)
            self.comm.record(0.0, 0.0, time.perf_counter() - start)
        return self.result


class Communicator:
    """Counted collectives on the active group of ``membership``."""

    def __init__(self, membership: Membership, clock: Clock | None = None):
        self.membership = membership
        self.clock = clock or Clock()
        # On a device: collectives (NCCL works) and spans (start, end marks) whose time there is read once complete,
        # each with the generation of the group it ran on (a replaced group's are dropped with it).
        self._on_device: list[tuple[int, Any]] = []
        self._step = CommCounts()
        self.totals = CommCounts()  # over the whole run (evaluation traffic included)
        self._side = False
        self.side_bytes = 0.0  # measurement traffic (consensus distance), kept out of bytes_sent

    # ---- accounting -------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.membership.size

    @property
    def group(self) -> dist.ProcessGroup:
        return self.membership.group

    @property
    def device(self) -> torch.device:
        """Where this backend's tensors live: the current CUDA device under NCCL, else the CPU."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def record(self, bytes_sent: float, payload_bytes: float, seconds: float) -> None:
        if self._side:
            self.side_bytes += bytes_sent
            return
        self._step.add(bytes_sent, payload_bytes, seconds)
        self.totals.add(bytes_sent, payload_bytes, seconds)

    def record_in_node(self, nbytes: float, seconds: float) -> None:
        """Count traffic that stays within a node (node scope: ``distributed/nodes.py``), apart from ``bytes_sent``."""
        if self._side:
            return
        for counts in (self._step, self.totals):
            counts.node_bytes += nbytes
            counts.comm_s += seconds

    def record_allreduce(self, nbytes: int, seconds: float, size: int | None = None) -> None:
        """Count an allreduce issued elsewhere (DDP's comm hook), or over a subgroup of ``size`` ranks."""
        n = self.size if size is None else size
        self.record(2 * (n - 1) * nbytes / n, nbytes, seconds)

    def take(self) -> CommCounts:
        """Return this step's counts and start a new step."""
        if self._on_device:
            self._read_device_times()
        counts, self._step = self._step, CommCounts()
        return counts

    def time_on_device(self, works: list[Any]) -> None:
        """Count ``works``' time on the GPU, once they complete (their bytes are recorded apart); off a device,
        nothing (the caller counts the CPU's time)."""
        if self.clock.on_device and not self._side:
            self._on_device += [(self.membership.generation, w) for w in works]
            if len(self._on_device) > 1024:  # (a caller that never takes, as the CAC drop-in: keep it bounded)
                self._read_device_times()

    def time_span(self, start: Any, end: Any) -> None:
        """Count the time between two marks of :attr:`clock` as communication, once the device reached ``end``."""
        if self.clock.on_device and not self._side:
            self._on_device.append((self.membership.generation, (start, end)))
        elif not self.clock.on_device:
            self.record(0.0, 0.0, self.clock.seconds(start, end))

    def _issued(self, works: list[Any], cpu_seconds: float) -> float:
        """The seconds to record at a collective's issue: its launch time on the CPU; nothing on a device, where its
        own time is read when it completes."""
        if self.clock.on_device:
            self.time_on_device(works)
            return 0.0
        return cpu_seconds

    def _read_device_times(self) -> None:
        """Add to this step the device time of every collective and span that has completed; the others wait for a
        later step. Those of a replaced group are dropped, as their results are (they may never complete)."""
        left = []
        for generation, item in self._on_device:
            if generation != self.membership.generation:
                continue
            if isinstance(item, tuple):
                start, end = item
                seconds = self.clock.seconds(start, end) if end.query() else None
            else:
                seconds = device_seconds(item)
                if seconds is None and _completed(item):  # (done, with no device time: gloo's, or timing off)
                    seconds = 0.0
            if seconds is not None:
                self._step.comm_s += seconds
                self.totals.comm_s += seconds
            else:
                left.append((generation, item))
        self._on_device = left

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Collectives inside are measurements, not training traffic: counted in ``side_bytes`` only."""
        self._side = True
        try:
            yield
        finally:
            self._side = False

    @contextmanager
    def _timed(self) -> Iterator[list[float]]:
        box = [0.0]
        t0 = time.perf_counter()
        yield box
        box[0] = time.perf_counter() - t0

    # ---- collectives ------------------------------------------------------------------------------------
    # Each one exists in two forms: ``x_async`` issues it and returns a :class:`Pending` (its bytes are counted
    # when issued; the time a rank then blocks in ``wait()`` is counted in the step that waits), and ``x``
    # issues it and waits at once.
    def all_reduce_async(
        self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None
    ) -> Pending:
        """In-place allreduce over the active group (or over ``group``, a subgroup of it)."""
        start = time.perf_counter()
        work = dist.all_reduce(tensor, op=op, group=group or self.group, async_op=True)
        size = dist.get_world_size(group) if group is not None else None
        self.record_allreduce(tensor_bytes(tensor), self._issued([work], time.perf_counter() - start), size)
        return Pending(self, [work], tensor)

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        return self.all_reduce_async(tensor, op, group).wait()

    def all_reduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        self.all_reduce(tensor)
        return tensor.div_(self.size)

    def all_reduce_coalesced(self, tensors: list[torch.Tensor], average: bool = True) -> None:
        """Allreduce many tensors as one flat buffer (one collective), in place."""
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.all_reduce(flat)
        if average:
            flat.div_(self.size)
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n

    def all_gather_async(self, tensor: torch.Tensor) -> Pending:
        """Gather equal-shaped tensors from every active rank, in rank order (the Pending's result)."""
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        start = time.perf_counter()
        work = dist.all_gather(out, tensor, group=self.group, async_op=True)
        nbytes = tensor_bytes(tensor)
        self.record((self.size - 1) * nbytes, nbytes, self._issued([work], time.perf_counter() - start))
        return Pending(self, [work], out)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self.all_gather_async(tensor).wait()

    def broadcast(self, tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        """Broadcast from global rank ``src`` to the active group (or ``group``, a subgroup), in place."""
        with self._timed() as t:
            work = dist.broadcast(tensor, src=src, group=group or self.group, async_op=True)
            self.membership.wait([work])
        nbytes = tensor_bytes(tensor)
        size = dist.get_world_size(group) if group is not None else self.size
        self.record(nbytes / size, nbytes / size, self._issued([work], t[0]))
        return tensor

    def exchange_async(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        mean_fraction: float = 1.0,
    ) -> Pending:
        """Point-to-point: send each ``(tensor, global rank)`` and fill each ``(tensor, global rank)``, all at
        once. Receives are posted first: with gloo, an isend posted before the irecv from the same peer
        serialises the two directions. Counted as this rank's own sends times ``mean_fraction``, the share of
        active ranks that send the same (1 when every rank does; 1/g when only group leaders do)."""
        ops = [dist.P2POp(dist.irecv, t, peer, group=self.group) for t, peer in recvs]
        ops += [dist.P2POp(dist.isend, t, peer, group=self.group) for t, peer in sends]
        start = time.perf_counter()
        works = dist.batch_isend_irecv(ops) if ops else []  # (none: a member alone)
        nbytes = sum(tensor_bytes(x) for x, _ in sends) * mean_fraction
        self.record(nbytes, nbytes, self._issued(works, time.perf_counter() - start))
        return Pending(self, works, [t for t, _ in recvs])

    def exchange(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        mean_fraction: float = 1.0,
    ) -> None:
        self.exchange_async(sends, recvs, mean_fraction).wait()

    @property
    def replica_group(self) -> dist.ProcessGroup:
        """The group whose processes hold one replica between them and average their gradients in DDP's backward:
        the active group (at node scope, a node's: ``distributed/nodes.py``)."""
        return self.group

    def average_bucket_async(self, buffer: torch.Tensor) -> tuple[list[Any], torch.futures.Future[torch.Tensor]]:
        """For a DDP comm hook: average ``buffer`` (a bucket's gradients) in place over the active ranks, as DDP's
        default hook does (divided, then summed); the works issued and a future of ``buffer`` that counts the
        allreduce on completion (on a device its time there is counted apart, :meth:`time_on_device`)."""
        start = time.perf_counter()
        buffer.div_(self.group.size())
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        self.time_on_device([work])  # (nothing off a device: there its time is the callback's below)
        nbytes = tensor_bytes(buffer)

        def done(f: torch.futures.Future[Any]) -> torch.Tensor:
            self.record_allreduce(nbytes, 0.0 if self.clock.on_device else time.perf_counter() - start)
            return f.value()[0]

        return [work], work.get_future().then(done)

    def mean_within_node(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` averaged in place over the processes of this rank's node at node scope; as it is here."""
        return tensor

    def bucket_group(self, index: int) -> tuple[dist.ProcessGroup, float]:
        """Where a comm hook that exchanges bucket ``index`` whole (PowerSGD's) runs it, and the share of that
        exchange to count on this process (counts are means over the active processes): the active group, all of it
        (at node scope, one process of the node's per bucket: ``distributed/nodes.py``)."""
        return self.group, 1.0

    def share_bucket(self, buffer: torch.Tensor, index: int) -> None:
        """After :meth:`bucket_group`'s exchange: the bucket to every process that did not run it (none here)."""

    def within_node(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``tensor`` over the processes of this rank's node where an algorithm runs at node scope
        (``distributed/nodes.py``); at process scope each process is its own node: ``tensor`` as it is."""
        return tensor

    def barrier(self) -> None:
        self.membership.wait([dist.barrier(group=self.group, async_op=True)])

    def probe_links(self, nbytes: int) -> float:
        """Collective over the active group: time an exchange of ``nbytes`` each way with every other active
        rank, one pair at a time per rank (rounds separated by barriers), and return this rank's *fastest*
        exchange in seconds (inf when it is alone). A transfer crosses both ends' links, so only a rank behind a
        slow link is slow with every peer. Counted like any exchange."""
        me = self.membership.rank
        send = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        recv = torch.empty_like(send)
        times = []
        for pairs in round_robin(self.membership.ranks):
            self.barrier()  # a pair starts together, not when the slower of its previous pairs finished
            peer = next((b if a == me else a for a, b in pairs if me in (a, b)), None)
            if peer is None:
                continue
            start = time.perf_counter()
            self.exchange([(send, peer)], [(recv, peer)])
            if send.is_cuda:  # (NCCL's wait only orders streams: the exchange's real end is the device's)
                torch.cuda.synchronize(send.device)
            times.append(time.perf_counter() - start)
        return min(times, default=math.inf)

    # ---- helpers used by several algorithms ---------------------------------------------------------------
    def average_buffers(self, model: nn.Module) -> None:
        """Average floating-point buffers (BN running statistics) over the active ranks."""
        buffers = [b for b in model.buffers() if b.is_floating_point()]
        if self.size > 1 and buffers:
            self.all_reduce_coalesced([b.data for b in buffers], average=True)
