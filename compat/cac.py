"""The CAC-compatible relaxed-sync API: a DDP drop-in for scripts written against Fujitsu CAC's
``RelaxedSyncDistributedDataParallel``, on the same machinery as ``sync=relaxed``.

Scripts run unchanged with one import changed::

    from compat.cac import RelaxedSyncDistributedDataParallel as DDP

The eviction rule is ``algorithms.relaxed.Eviction``, the agreement and regroup ``distributed.membership``, the
gradient exchange ``sync=allreduce`` (DDP with counted bytes). ``examples/relaxed_sync_cac.py`` follows CAC's
usage steps 1-8.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from algorithms.allreduce import AllReduce
from algorithms.base import SyncContext
from algorithms.relaxed import Eviction
from data.common import ShardSampler, TrainSampler
from distributed.clock import build_clock
from distributed.comm import Communicator
from distributed.membership import Membership, host_names


class RelaxedSyncDistributedDataParallel(nn.Module):
    """CAC-compatible relaxed sync: a DDP drop-in with the CAC methods.

    Follows the CAC usage (seed steps 1-8)::

        model = RelaxedSyncDistributedDataParallel(model, relaxed_sync_threshold=2.0, relaxed_sync_mode_threshold=0.8)
        train_loader = model.TrainDataLoader(train_dataset, batch_size=..., shuffle=True, ...)
        val_loader = model.ValDataLoader(val_dataset, batch_size=..., ...)
        for epoch in range(epochs):
            model.set_relaxed_pg(epoch, min_num_processes=world_size // 2)
            train_loader, val_loader = model.rearrange_data_loaders(train_loader, val_loader)
            lr = model.adjust_lr_by_procs(init_lr)
            ...  # loss = criterion(model(x), y); reduced = model.calc_reduced_tensor(loss.data)
        model.finalize()

    An evicted rank prints a line and leaves from ``set_relaxed_pg`` by ``LeftRun``, a ``SystemExit`` with
    status 0 (torchrun stops the job if a worker exits non-zero). ``simulate_slow_process=1`` makes the last
    ``num_sleep_processes`` ranks sleep before each forward from ``sleep_process_start_epoch`` on, ``sleep_time``
    seconds or, when 0, 30 x their mean forward time (as CAC).
    """

    def __init__(
        self,
        module: nn.Module,
        relaxed_sync_threshold: float = 3.0,
        relaxed_sync_mode_threshold: float = 0.8,
        simulate_slow_process: int = 0,
        sleep_process_start_epoch: int = 10,
        num_sleep_processes: int = 1,
        sleep_time: float = 0.0,
        master_skip: bool = False,
        reference: str = "median",
        bucket_cap_mb: float | None = None,
    ):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("RelaxedSyncDistributedDataParallel: call torch.distributed.init_process_group first")
        self.membership = Membership(dist.get_rank(), dist.get_world_size(), hosts=host_names()[0])
        device = next(module.parameters()).device
        self.comm = Communicator(self.membership, build_clock(device))
        self.eviction = Eviction(relaxed_sync_threshold, reference, 1, protected=() if master_skip else (0,))
        self.mode_threshold = relaxed_sync_mode_threshold
        self.simulate_slow_process, self.sleep_process_start_epoch = simulate_slow_process, sleep_process_start_epoch
        self.num_sleep_processes, self.sleep_time = num_sleep_processes, sleep_time
        self._train_loader_args: tuple | None = None
        self._val_loader_args: tuple | None = None
        self._changed = False
        self._epoch = 0
        self._forward_times: list[float] = []
        self._step_times: list[float] = []
        self._step_start: Any = None  # a mark of self.comm.clock
        self._ready_seen: Any = None  # the last bucket's mark already counted
        self.loaders_rebuilt = 0
        self.module = module  # as DDP: parameters(), train()/eval() and state_dict() see the wrapped model
        self._exchange = AllReduce(bucket_cap_mb=bucket_cap_mb)
        ctx = SyncContext(comm=self.comm, membership=self.membership, device=device)
        self._exchange.setup(module, None, ctx)

    # ---- forward: timing and the simulated straggler -----------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._record_previous_step()
        self._step_start = self.comm.clock.mark()
        self._simulate_slowness()
        start = time.perf_counter()
        out = self._exchange.module(*args, **kwargs)
        if self.training:
            self._forward_times.append(time.perf_counter() - start)
        return out

    def _record_previous_step(self) -> None:
        """Own compute of the previous step: from its forward to its last gradient bucket being ready."""
        ready = self._exchange.hook_state.last_ready  # (a mark of the same clock: on a GPU, a CUDA event)
        if self._step_start is not None and ready is not None and ready is not self._ready_seen:
            self._step_times.append(self.comm.clock.seconds(self._step_start, ready))
        self._step_start, self._ready_seen = None, ready

    def _simulate_slowness(self) -> None:
        world = self.membership.initial_size
        slow = range(world - self.num_sleep_processes, world)
        if self.simulate_slow_process and self.training and self.membership.rank in slow:
            if self._epoch >= self.sleep_process_start_epoch:
                mean_forward = statistics.fmean(self._forward_times[-50:]) if self._forward_times else 0.0
                time.sleep(self.sleep_time or 30.0 * mean_forward)

    # ---- CAC API -------------------------------------------------------------------------------------------
    def set_relaxed_pg(self, epoch: int, min_num_processes: int | float = 1) -> None:
        """At each epoch start: evict ranks slower than the threshold (an evicted rank leaves here, status 0)."""
        self._epoch = epoch
        self._record_previous_step()
        if not self._step_times:
            return
        own = statistics.fmean(self._step_times)
        self._step_times = []
        verdict = self.eviction.check(
            self.comm, own, "own compute", f"at epoch {epoch}", min_num_processes=max(1, int(min_num_processes))
        )
        if not verdict.evicted:
            return
        self._exchange.on_membership_change(self.membership.changes[-1])  # (CAC's API reshards and rescales)
        self._changed = True
        if self.membership.is_logging_rank:
            print(
                f"relaxsync: epoch {epoch}: evicted rank(s) {verdict.evicted}; world size now {self.membership.size}",
                flush=True,
            )

    def is_group_size_changed(self) -> bool:
        return self._changed

    def TrainDataLoader(
        self,
        dataset,
        batch_size=1,
        shuffle=True,
        num_workers=0,
        pin_memory=False,
        sampler=None,
        collate_fn=None,
        drop_last=True,
        **kwargs,
    ):  # noqa: N802, E501
        """A DataLoader whose sampler shards ``dataset`` over the active ranks (``sampler`` is replaced)."""
        self._train_loader_args = (dataset, batch_size, num_workers, pin_memory, collate_fn, drop_last, kwargs)
        return self._build_train_loader()

    def ValDataLoader(
        self,
        dataset,
        batch_size=1,
        shuffle=False,
        num_workers=0,
        pin_memory=False,
        sampler=None,
        collate_fn=None,
        **kwargs,
    ):  # noqa: N802, E501
        """A DataLoader over this rank's unpadded validation shard: every sample is evaluated exactly once."""
        self._val_loader_args = (dataset, batch_size, num_workers, pin_memory, collate_fn, kwargs)
        return self._build_val_loader()

    def rearrange_data_loaders(self, train_loader, val_loader):
        """After a change: always a new val loader; a new train loader only below the mode threshold."""
        if not self._changed:
            return train_loader, val_loader
        self._changed = False
        val_loader = self._build_val_loader() if self._val_loader_args else val_loader
        if self._below_mode_threshold() and self._train_loader_args:
            train_loader = self._build_train_loader()
        self.loaders_rebuilt += 1
        return train_loader, val_loader

    rearrage_data_loaders = rearrange_data_loaders  # the spelling used in the CAC documentation

    def adjust_lr_by_procs(self, init_lr: float) -> float:
        """``init_lr x active/initial`` below the mode threshold, else ``init_lr``."""
        if self._below_mode_threshold():
            return init_lr * self.membership.size / self.membership.initial_size
        return init_lr

    def calc_reduced_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean of ``tensor`` over the active ranks."""
        out = tensor.detach().clone().float()
        return self.comm.all_reduce_mean(out)

    def calc_prec(self, loss: torch.Tensor, prec1: torch.Tensor, prec5: torch.Tensor):
        """Means of loss, top-1 and top-5 over the active ranks, in one allreduce."""
        values = torch.stack([torch.as_tensor(v, dtype=torch.float32).reshape(()) for v in (loss, prec1, prec5)])
        values = self.comm.all_reduce_mean(values.to(next(self.module.parameters()).device))
        return values[0], values[1], values[2]

    def finalize(self) -> None:
        """Before returning from main: wait for the other survivors."""
        self.comm.barrier()

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _below_mode_threshold(self) -> bool:
        return self.membership.size / self.membership.initial_size < self.mode_threshold

    def _build_train_loader(self):
        dataset, batch_size, num_workers, pin_memory, collate_fn, drop_last, kwargs = self._train_loader_args
        shard = TrainSampler(len(dataset), self.membership.size, self.membership.index, 0)
        kwargs = {**kwargs, "drop_last": drop_last}
        return self._loader(
            dataset, _EpochFollowingSampler(self, shard), batch_size, num_workers, pin_memory, collate_fn, kwargs
        )

    def _build_val_loader(self):
        dataset, batch_size, num_workers, pin_memory, collate_fn, kwargs = self._val_loader_args
        shard = ShardSampler(len(dataset), self.membership.size, self.membership.index)
        return self._loader(dataset, shard, batch_size, num_workers, pin_memory, collate_fn, kwargs)

    @staticmethod
    def _loader(dataset, sampler, batch_size, num_workers, pin_memory, collate_fn, kwargs):
        return torch.utils.data.DataLoader(
            dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers, pin_memory=pin_memory,
            collate_fn=collate_fn, **kwargs,
        )  # fmt: skip


class _EpochFollowingSampler(torch.utils.data.Sampler[int]):
    """Reshuffles each epoch from the epoch given to ``set_relaxed_pg`` (CAC users never call set_epoch).

    Every rank runs the same number of batches per epoch: the smallest shard's length."""

    def __init__(self, owner: RelaxedSyncDistributedDataParallel, sampler):
        self.owner, self.sampler = owner, sampler

    def __iter__(self):
        self.sampler.set_epoch(self.owner._epoch)
        return iter(self.sampler.shard()[: len(self)])

    def __len__(self) -> int:
        return self.sampler.length // self.sampler.num_replicas
