"""Node scope: a sync algorithm whose members are nodes, each carried by all the processes of its node.

On a cluster the slow link is between nodes; the processes of one node (its GPUs) reach each other over a link one
or two orders of magnitude faster. At node scope (``sync.scope=node``) the processes of a node agree on their
gradients every step over that fast link (``engine/scope.py``), so they hold one replica between them, and the
algorithm runs as if each node were one process with the node's whole batch: its ``ctx.membership`` is a
:class:`NodeView` (its ranks are the active nodes) and its ``ctx.comm`` a :class:`NodeCommunicator`.

Two levels of groups, as HSDP names them (replicate across nodes, shard within): the *node group* (the active
ranks of one node) and, for each local index i, a *cross group* (the i-th rank of every active node). Everything
an algorithm hands its communicator at node scope is the node's own, the same on each of its ranks, so a
collective across nodes needs only one copy of it per node: local rank i takes the i-th of L equal chunks, runs
the collective on its cross group, and the node's ranks then gather their chunks over the fast link. Each process
carries 1/L of the exchange, and the bytes a node sends on its link are those of one process per node, whatever
its L. One group per local index rather than one leader per node: every process of a node drives its share at
once (on a GPU node, each GPU over its own NIC, as NCCL's rail-optimised rings do), and no process waits while one
leader sends and then broadcasts.

The nodes are named by their lowest active rank (``Membership.node_ids``): a node id is a rank, so an algorithm's
records (hosts by rank, evicted "ranks") read the same at both scopes. Nodes stay whole
(``Membership.whole_nodes``): removing any of a node's ranks removes the node.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distributed.comm import Communicator, Pending, tensor_bytes
from distributed.membership import Change, Membership


def layout(membership: Membership) -> tuple[int, int] | None:
    """``(nodes, processes per node)`` of the active ranks where every node has as many (the shape node scope
    needs), else None."""
    counts = {len(membership.node_ranks(node)) for node in membership.node_ids()}
    return (len(membership.node_ids()), counts.pop()) if len(counts) == 1 else None


@dataclass(frozen=True)
class NodeGroup:
    """Some of the active nodes (:meth:`NodeView.subgroup`): each process holds the cross group of its local index
    over those nodes."""

    nodes: list[int]
    cross: Any  # this process's cross group over ``nodes`` (None: one node)


class NodeView:
    """A :class:`~distributed.membership.Membership` as an algorithm at node scope sees it: its members are the
    active nodes, each named by its lowest active rank. Agreement, waits and the store are the membership's."""

    def __init__(self, membership: Membership):
        self.membership = membership
        first = list(range(membership.initial_size))
        self.initial_size = len({membership.nodes[r] for r in first}) if first else 1

    def __getattr__(self, name: str) -> Any:  # generation, wait, relay, alarm, store, agree, key, hosts, ...
        return getattr(self.membership, name)

    @property
    def rank(self) -> int:
        return self.membership.node_ranks()[0]

    @property
    def ranks(self) -> list[int]:
        return self.membership.node_ids()

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def index(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def local_index(self) -> int:
        """This process's index among the ranks of its node."""
        return self.membership.node_ranks().index(self.membership.rank)

    @property
    def local_size(self) -> int:
        return len(self.membership.node_ranks())

    def peer(self, node: int) -> int:
        """The rank of ``node`` that shares this process's local index (its partner in the cross group)."""
        return self.membership.node_ranks(node)[self.local_index]

    def subgroup(self, nodes: list[int]) -> NodeGroup:
        """A group of some active nodes (only their ranks call it), until the next change."""
        cross = [self.peer(n) for n in nodes]
        return NodeGroup(list(nodes), self.membership.subgroup(cross) if len(cross) > 1 else None)

    def remove(self, nodes: list[int], cause: str, reasons: dict[int, str] | None = None) -> Change | None:
        """Remove ``nodes`` (:meth:`Membership.remove` of all their ranks); the change, in ranks (what a record of it
        names: every process that left)."""
        m = self.membership
        ranks = [r for n in nodes for r in m.node_ranks(n)]
        by_rank = {r: why for n, why in (reasons or {}).items() for r in m.node_ranks(n)}
        return m.remove(ranks, cause, by_rank)

    def in_nodes(self, change: Change) -> Change:
        """``change`` (of ranks) in node ids: the nodes removed (each named by its lowest rank before) or added, and
        the active nodes after it."""
        m = self.membership
        removed = {min(r for r in change.removed if m.nodes[r] == m.nodes[s]) for s in change.removed}
        added = {m.node_ranks(r)[0] for r in change.added if r in m.ranks}
        return Change(change.generation, sorted(removed), self.ranks, change.cause, sorted(added))


class NodeCommunicator(Communicator):
    """Counted collectives among the active nodes (:class:`NodeView`) on tensors each node holds alike on its
    ranks, each process carrying 1/L of them across nodes (the module docstring). Counts go to ``base``, the
    process's own communicator, which the trainer reads: ``bytes_sent`` is what crosses between nodes (per process),
    and what stays in a node is counted apart (``node_bytes``)."""

    def __init__(self, base: Communicator, view: NodeView):
        super().__init__(view, base.clock)  # type: ignore[arg-type]
        self.base, self.view = base, view
        self._generation: int | None = None
        self.node_group: Any = None  # the active ranks of this node (a group of one where it has one process)
        self.cross_group: Any = None  # this local index's rank of every active node (None: one node)
        self._buckets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (padded, share, bucket) in flight
        self._solo: tuple[int | None, Any] | None = None  # (generation, a group of this process alone)

    # ---- the two levels ---------------------------------------------------------------------------------------
    def levels(self) -> None:
        """Form the node group and the cross group of this generation, if not yet formed: a collective over the
        node's ranks, then over the cross group's (in that order on every process, so none waits on another)."""
        m = self.view.membership
        if self._generation == m.generation:
            return
        node = m.node_ranks()
        cross = [self.view.peer(n) for n in self.view.ranks]
        self.node_group = m.subgroup(node)
        self.cross_group = m.subgroup(cross) if len(cross) > 1 else None
        self._buckets = []  # (issued on the replaced groups: dropped with them)
        self._generation = m.generation

    def within_node(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``tensor`` in place over the ranks of this node (the fast link)."""
        self.levels()
        if self.view.local_size > 1:
            start = time.perf_counter()
            work = dist.all_reduce(tensor, op=op, group=self.node_group, async_op=True)
            self.membership.wait([work])
            local = self.view.local_size
            seconds = self._issued([work], time.perf_counter() - start)
            self.base.record_in_node(2 * (local - 1) * tensor_bytes(tensor) / local, seconds)
        return tensor

    def gather_in_node(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process of this node's ``tensor``, stacked in local order."""
        self.levels()
        every = torch.empty(self.view.local_size, *tensor.shape, dtype=tensor.dtype, device=tensor.device)
        self._gather_in_node(tensor, every)
        return every

    def _gather_in_node(self, share: torch.Tensor, into: torch.Tensor) -> None:
        """Every rank of the node its share (``into`` holds L shares of ``share``'s size, in local order)."""
        if self.view.local_size == 1:
            into.copy_(share.reshape(into.shape))
            return
        start = time.perf_counter()
        parts = list(into.reshape(self.view.local_size, -1).unbind(0))
        work = dist.all_gather(parts, share.reshape(-1), group=self.node_group, async_op=True)
        self.membership.wait([work])
        seconds = self._issued([work], time.perf_counter() - start)
        self.base.record_in_node((self.view.local_size - 1) * tensor_bytes(share), seconds)

    def _padded(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``tensor`` flat, padded to L equal chunks; this process's chunk (a view) and the chunk's length."""
        flat = tensor.reshape(-1)
        chunk = math.ceil(flat.numel() / self.view.local_size) if flat.numel() else 0
        padded = torch.zeros(chunk * self.view.local_size, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        return padded, padded[self.view.local_index * chunk : (self.view.local_index + 1) * chunk], chunk

    # ---- DDP's buckets ----------------------------------------------------------------------------------------------
    @property
    def replica_group(self) -> dist.ProcessGroup:
        """DDP wraps the model over the node's processes (the fast link): its comm hook then takes the exchange
        across nodes (:meth:`average_bucket_async`)."""
        self.levels()
        return self.node_group

    def average_bucket_async(self, buffer: torch.Tensor) -> tuple[list[Any], torch.futures.Future[torch.Tensor]]:
        """A bucket averaged over every active process: over the node's processes at once (the fast link), then
        across nodes, each process its chunk, in the background while the backward pass goes on; the node's
        processes gather their chunks afterwards (:meth:`gather_buckets`, before the optimizer step)."""
        buffer.div_(self.view.local_size)
        self.within_node(buffer)
        padded, share, _ = self._padded(buffer)
        share.div_(self.view.size)
        self._buckets.append((padded, share, buffer))
        if self.cross_group is None:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(buffer)
            return [], done
        start = time.perf_counter()
        work = dist.all_reduce(share, group=self.cross_group, async_op=True)
        self.time_on_device([work])
        nbytes, nodes = tensor_bytes(share), self.view.size

        def counted(f: torch.futures.Future[Any]) -> torch.Tensor:
            self.record_allreduce(nbytes, 0.0 if self.clock.on_device else time.perf_counter() - start, nodes)
            return buffer

        return [work], work.get_future().then(counted)

    def gather_buckets(self) -> None:
        """Complete the buckets averaged this backward pass: each process's chunk to every process of the node."""
        buckets, self._buckets = self._buckets, []
        for padded, share, buffer in buckets:
            self._gather_in_node(share.clone(), padded)
            buffer.reshape(-1).copy_(padded[: buffer.numel()])

    def bucket_owner(self, index: int) -> int:
        """The local index of the process that exchanges bucket ``index`` across nodes where a bucket goes whole
        (PowerSGD's factors): buckets are dealt out to the node's processes in turn."""
        return index % self.view.local_size

    def mean_within_node(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.view.local_size > 1:
            self.within_node(tensor.div_(self.view.local_size))
        return tensor

    def bucket_group(self, index: int) -> tuple[dist.ProcessGroup, float]:
        """Bucket ``index``'s owner runs the exchange on its cross group; the node's other processes run the same
        computation on a group of their own alone (so that the state it keeps, a random generator and counters,
        moves alike on all of them) and take the owner's result (:meth:`share_bucket`). Each counts 1/L of the
        owner's bytes: the mean over the node's processes."""
        self.levels()
        share = 1.0 / self.view.local_size
        if self.cross_group is not None and self.bucket_owner(index) == self.view.local_index:
            return self.cross_group, share
        # (one node left: every process, the owner too, runs it on a group of its own; they agree already)
        if self._solo is None or self._solo[0] != self._generation:
            self._solo = (self._generation, self.view.membership.subgroup([self.view.membership.rank]))
        return self._solo[1], share

    def share_bucket(self, buffer: torch.Tensor, index: int) -> None:
        """The owner's (:meth:`bucket_owner`) exchanged bucket to every process of the node."""
        if self.view.local_size > 1:
            owner = self.view.membership.node_ranks()[self.bucket_owner(index)]
            start = time.perf_counter()
            work = dist.broadcast(buffer, src=owner, group=self.node_group, async_op=True)
            self.membership.wait([work])
            seconds = self._issued([work], time.perf_counter() - start)
            self.base.record_in_node(tensor_bytes(buffer) / self.view.local_size, seconds)

    # ---- accounting: the process's communicator's ---------------------------------------------------------------
    @property
    def group(self) -> dist.ProcessGroup:
        return self.view.membership.group

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def side_bytes(self) -> float:  # type: ignore[override]
        return self.base.side_bytes

    @side_bytes.setter
    def side_bytes(self, value: float) -> None:
        if hasattr(self, "base"):
            self.base.side_bytes = value

    def record(self, bytes_sent: float, payload_bytes: float, seconds: float) -> None:
        self.base.record(bytes_sent, payload_bytes, seconds)

    def time_on_device(self, works: list[Any]) -> None:
        self.base.time_on_device(works)

    def time_span(self, start: Any, end: Any) -> None:
        self.base.time_span(start, end)

    def uncounted(self):  # type: ignore[no-untyped-def]
        return self.base.uncounted()

    def take(self):  # type: ignore[no-untyped-def]
        return self.base.take()

    # ---- collectives across nodes -------------------------------------------------------------------------------
    def _finishing(self, works: list[Any], finish: Callable[[], Any]) -> Pending:
        return _Finishing(self, works, finish)

    def all_reduce_async(
        self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, group: Any = None
    ) -> Pending:
        """In place over the active nodes (or those of ``group``, a :class:`NodeGroup`)."""
        self.levels()
        cross = group.cross if isinstance(group, NodeGroup) else self.cross_group
        nodes = len(group.nodes) if isinstance(group, NodeGroup) else self.view.size
        padded, share, _ = self._padded(tensor)
        works = []
        start = time.perf_counter()
        if cross is not None:
            works.append(dist.all_reduce(share, op=op, group=cross, async_op=True))
        self.record_allreduce(tensor_bytes(share), self._issued(works, time.perf_counter() - start), nodes)

        def finish() -> torch.Tensor:
            self._gather_in_node(share.clone(), padded)
            tensor.reshape(-1).copy_(padded[: tensor.numel()])
            return tensor

        return self._finishing(works, finish)

    def all_gather_async(self, tensor: torch.Tensor) -> Pending:
        """Each active node's ``tensor``, in node order (the Pending's result)."""
        self.levels()
        nodes, local = self.view.size, self.view.local_size
        padded, share, chunk = self._padded(tensor)
        shares = torch.empty(nodes, chunk, dtype=share.dtype, device=share.device)
        works = []
        start = time.perf_counter()
        if self.cross_group is not None:
            works.append(dist.all_gather(list(shares.unbind(0)), share, group=self.cross_group, async_op=True))
        else:
            shares[0].copy_(share)
        nbytes = tensor_bytes(share)
        self.record((nodes - 1) * nbytes, nbytes, self._issued(works, time.perf_counter() - start))

        def finish() -> list[torch.Tensor]:
            every = torch.empty(local, nodes, chunk, dtype=share.dtype, device=share.device)
            self._gather_in_node(shares, every)
            whole = every.permute(1, 0, 2).reshape(nodes, -1)[:, : tensor.numel()]
            return [whole[n].reshape(tensor.shape).clone() for n in range(nodes)]

        return self._finishing(works, finish)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
        """From node ``src`` to the active nodes (or those of ``group``), in place."""
        self.levels()
        cross = group.cross if isinstance(group, NodeGroup) else self.cross_group
        nodes = len(group.nodes) if isinstance(group, NodeGroup) else self.view.size
        padded, share, _ = self._padded(tensor)
        if cross is not None:
            start = time.perf_counter()
            work = dist.broadcast(share, src=self.view.peer(src), group=cross, async_op=True)
            self.membership.wait([work])
            nbytes = tensor_bytes(share)
            self.record(nbytes / nodes, nbytes / nodes, self._issued([work], time.perf_counter() - start))
        self._gather_in_node(share.clone(), padded)
        tensor.reshape(-1).copy_(padded[: tensor.numel()])
        return tensor

    def exchange_async(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        mean_fraction: float = 1.0,
    ) -> Pending:
        """Point to point between nodes: each ``(tensor, node)`` sent, each ``(tensor, node)`` filled; each process
        sends and receives its chunk, to and from the process of its local index there."""
        self.levels()
        out = [(self._padded(t)[1], self.view.peer(node)) for t, node in sends]
        inbox = [(self._padded(t), t, self.view.peer(node)) for t, node in recvs]
        ops = [dist.P2POp(dist.irecv, share, peer, group=self.group) for (_, share, _), _, peer in inbox]
        ops += [dist.P2POp(dist.isend, share, peer, group=self.group) for share, peer in out]
        start = time.perf_counter()
        works = dist.batch_isend_irecv(ops) if ops else []
        nbytes = sum(tensor_bytes(share) for share, _ in out) * mean_fraction
        self.record(nbytes, nbytes, self._issued(works, time.perf_counter() - start))

        def finish() -> list[torch.Tensor]:
            for (padded, share, _), tensor, _ in inbox:
                self._gather_in_node(share.clone(), padded)
                tensor.reshape(-1).copy_(padded[: tensor.numel()])
            return [tensor for _, tensor, _ in inbox]

        return self._finishing(works, finish)

    def probe_links(self, nbytes: int) -> float:
        raise NotImplementedError("link probes run between processes, not nodes: sync.measure=link is process scope")

    def average_buffers(self, model: nn.Module) -> None:
        """Average floating-point buffers over every active process: those of a node differ (BN statistics of each
        process's own batches), so they are averaged in the node first."""
        buffers = [b for b in model.buffers() if b.is_floating_point()]
        if not buffers:
            return
        flat = torch.cat([b.detach().reshape(-1) for b in buffers])
        self.within_node(flat).div_(self.view.local_size)
        if self.size > 1:
            self.all_reduce(flat).div_(self.size)
        offset = 0
        for b in buffers:
            b.data.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()

    def average_gradients(self, model: nn.Module, grads_finite: bool) -> bool:
        """Replace every gradient with its mean over this node's processes (an overflow anywhere in the node is an
        overflow of all of them, as for one process with the node's batch); the node's verdict."""
        params = [p for p in model.parameters() if p.requires_grad]
        if self.view.local_size == 1 or not params:
            return grads_finite
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flag = torch.tensor([0.0 if grads_finite else 1.0], dtype=grads[0].dtype, device=grads[0].device)
        flat = torch.cat([g.reshape(-1) for g in grads] + [flag])
        self.within_node(flat)
        if flat[-1].item() > 0:
            return False
        flat.div_(self.view.local_size)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(p).clone()
            offset += g.numel()
        return True


class _Finishing(Pending):
    """A collective across nodes in flight: once its works are done, ``finish`` gathers the node's shares (the
    result)."""

    def __init__(self, comm: NodeCommunicator, works: list[Any], finish: Callable[[], Any]):
        super().__init__(comm, works, True)
        self.finish = finish

    def wait(self) -> Any:
        return None if super().wait() is None else self.finish()
