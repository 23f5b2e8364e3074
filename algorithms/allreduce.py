"""Synchronous data parallelism with PyTorch DDP.

PyTorch Distributed: Experiences on Accelerating Data Parallel Training (Li et al., VLDB 2020,
arXiv 2006.15704). Every rank computes gradients on its own batch; DDP averages them with ring allreduce in
buckets while backward is still running, so every replica takes the identical optimizer step. This is the
baseline every other algorithm is measured against. Bytes are counted by a DDP comm hook that delegates to
DDP's default allreduce, so the numbers are those of stock DDP.
"""

import inspect
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from algorithms.base import SyncAlgorithm, SyncContext, SyncReport
from distributed.comm import Communicator
from distributed.membership import Change
from errors import require

# No broadcast of buffers at each forward. torch 2.13 renamed the keyword (broadcast_buffers, deprecated since, to
# forward_sync_buffers); the older name keeps an older torch working, as cluster images often have.
_NEW_NAME = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
NO_FORWARD_BUFFER_SYNC = {"forward_sync_buffers" if _NEW_NAME else "broadcast_buffers": False}


class HookState:
    """What the comm hook needs: the communicator and when this rank's last bucket became ready."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.last_ready: Any = None  # comm.clock's mark when the last bucket of this backward was handed over
        self.works: list[dist.Work] = []  # this backward's allreduces, until after_backward has seen them finish

    def __getstate__(self):  # DDP may pickle hook state; the communicator is process-local
        return {}


def counted_allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # No `from __future__ import annotations` in this file: DDP checks this signature at registration.
    """DDP's default allreduce (average: divided, then summed), counted by the Communicator; its work is kept for
    :meth:`AllReduce.after_backward`. DDP waits for the future in C++: it is relayed through the membership, so
    that a peer lost elsewhere ends that wait too (distributed/alarm.py)."""
    state.last_ready = state.comm.clock.mark()  # (on a GPU, where the stream is: the bucket's gradients are queued)
    works, future = state.comm.average_bucket_async(bucket.buffer())
    state.works.extend(works)
    return state.comm.membership.relay(future)


def counted(
    future: torch.futures.Future[torch.Tensor], comm: Communicator, nbytes: int, start: float
) -> torch.futures.Future[torch.Tensor]:
    """``future``, recording on completion one allreduce of ``nbytes`` that began at ``start`` (``perf_counter()``; on a
    device its time there is counted apart, ``Communicator.time_on_device``)."""

    def done(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        comm.record_allreduce(nbytes, 0.0 if comm.clock.on_device else time.perf_counter() - start)
        return f.value()

    return future.then(done)


class AllReduce(SyncAlgorithm):
    """Gradient averaging by DDP every step."""

    name = "allreduce"
    comm_hook = staticmethod(counted_allreduce_hook)  # what DDP calls for each bucket

    def __init__(self, bucket_cap_mb: float | None = None):
        self.bucket_cap_mb = bucket_cap_mb

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        b = section["bucket_cap_mb"]
        allowed = "a number of MiB > 0, or null for DDP's own layout (a 1 MiB first bucket, then 25 MiB ones)"
        number = isinstance(b, (int, float)) and not isinstance(b, bool)
        require(b is None or (number and b > 0), "sync.bucket_cap_mb", b, allowed)
        compiled = cfg.get("model", {}).get("compile", False) not in (False, None)
        # torch.compile splits the graph at DDP's buckets and needs the first (1 MiB) no larger than the others
        require(not compiled or b is None or b >= 1, "sync.bucket_cap_mb", b, ">= 1 under model.compile (or null)")

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: SyncContext) -> None:
        super().setup(model, optimizer, ctx)
        self.hook_state = self._hook_state()  # kept across rewraps: the comm hook's state reads the group anew
        self.module = self._wrap(model)

    def _hook_state(self) -> HookState:
        return HookState(self.ctx.comm)

    def on_membership_change(self, change: Change) -> SyncReport:
        # DDP is bound to one process group: wrap the same module again over the new group (the survivors'
        # parameters are identical, so the constructor's broadcast is left out: it would change nothing).
        for p in self.model.parameters():
            p.grad = None  # the old reducer's bucket views
        self.hook_state.works = []  # (issued on the replaced group: dropped with it)
        # (None, not del: a rewrap cut short by another loss leaves no DDP, and the next change wraps again)
        self.ddp = None
        self.module = self._wrap(self.model, replicas_agree=True)
        return super().on_membership_change(change)

    def _wrap(self, model: nn.Module, replicas_agree: bool = False) -> nn.Module:
        ctx = self.ctx
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # Buffers (BN statistics) are averaged before eval and checkpoints instead of being broadcast from
        # rank 0 at every forward: that traffic would not be gradient exchange and DDP's hook cannot count it.
        self.ddp = DistributedDataParallel(
            model,
            device_ids=device_ids,
            process_group=ctx.comm.replica_group,  # (at node scope, the node's: distributed/nodes.py)
            bucket_cap_mb=self.bucket_cap_mb,
            **NO_FORWARD_BUFFER_SYNC,
            gradient_as_bucket_view=True,
            init_sync=not (replicas_agree or ctx.replicas_agree),  # (a broadcast of the whole model otherwise)
        )
        self.ddp.register_comm_hook(self.hook_state, self.comm_hook)
        return self.ddp

    def after_backward(self, step: int, grads_finite: bool) -> SyncReport:
        # DDP waits for its allreduces on the stream only: on NCCL a lost peer would not raise here but leave the
        # optimizer step waiting. Under a deadline each one finishes, fails or passes it here, before the step.
        works, self.hook_state.works = self.hook_state.works, []
        self.ctx.membership.wait(works)
        # The gradients were averaged before unscaling, so every rank's verdict is the same.
        return SyncReport(grads_finite=grads_finite, compute_end=self.hook_state.last_ready)
