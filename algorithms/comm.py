"""Every collective of every algorithm goes through the Communicator, which counts what it costs.

Two byte counts per step, both the *mean over the active ranks* so that any rank can report them without
an extra collective (every collective's per-rank traffic is known from its shape):

* ``payload_bytes``: bytes of the tensors handed to collectives.
* ``bytes_sent``: wire bytes under the bandwidth-optimal model. Ring allreduce of S bytes over N ranks sends
  2(N-1)/N * S per rank; allgather of s bytes per rank sends (N-1)*s; a point-to-point send of s bytes sends
  s from the sender; a broadcast of S bytes sends S from the root (S/N per rank on average).

``comm_seconds`` is the wall time this rank spent inside blocking collectives, plus, for asynchronous ones
(DDP's bucket allreduces), the time from launch to completion, which may overlap computation.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from algorithms.base import SyncReport
from algorithms.membership import Membership


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Communicator:
    """Counted collectives on the active group of ``membership``."""

    def __init__(self, membership: Membership):
        self.membership = membership
        self._step = SyncReport()
        self.totals = {"bytes_sent": 0.0, "payload_bytes": 0.0, "comm_s": 0.0}

    # ---- accounting -------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.membership.size

    @property
    def group(self) -> dist.ProcessGroup:
        return self.membership.group

    def record(self, bytes_sent: float, payload_bytes: float, seconds: float) -> None:
        self._step.bytes_sent += bytes_sent
        self._step.payload_bytes += payload_bytes
        self._step.comm_seconds += seconds
        self.totals["bytes_sent"] += bytes_sent
        self.totals["payload_bytes"] += payload_bytes
        self.totals["comm_s"] += seconds

    def record_allreduce(self, nbytes: int, seconds: float) -> None:
        """Count an allreduce issued elsewhere (DDP's comm hook)."""
        n = self.size
        self.record(2 * (n - 1) * nbytes / n, nbytes, seconds)

    def take(self) -> SyncReport:
        """Return this step's counts and start a new step."""
        report, self._step = self._step, SyncReport()
        return report

    @contextmanager
    def _timed(self) -> Iterator[list[float]]:
        box = [0.0]
        t0 = time.perf_counter()
        yield box
        box[0] = time.perf_counter() - t0

    # ---- collectives ------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        """In-place allreduce over the active group."""
        with self._timed() as t:
            dist.all_reduce(tensor, op=op, group=self.group)
        self.record_allreduce(tensor_bytes(tensor), t[0])
        return tensor

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

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Gather equal-shaped tensors from every active rank, in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        with self._timed() as t:
            dist.all_gather(out, tensor, group=self.group)
        nbytes = tensor_bytes(tensor)
        self.record((self.size - 1) * nbytes, nbytes, t[0])
        return out

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Broadcast from global rank ``src`` (an active rank) to the active group, in place."""
        with self._timed() as t:
            dist.broadcast(tensor, src=src, group=self.group)
        nbytes = tensor_bytes(tensor)
        self.record(nbytes / self.size, nbytes / self.size, t[0])
        return tensor

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    # ---- helpers used by several algorithms ---------------------------------------------------------------
    def average_buffers(self, model: nn.Module) -> None:
        """Average floating-point buffers (BN running statistics) over the active ranks."""
        buffers = [b for b in model.buffers() if b.is_floating_point()]
        if self.size > 1 and buffers:
            self.all_reduce_coalesced([b.data for b in buffers], average=True)
