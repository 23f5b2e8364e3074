"""Relaxed synchronization: evict straggler processes from the group and train on with the rest.

After Fujitsu's CAC library (``cac.relaxed_sync.RelaxedSyncDistributedDataParallel``; no paper). In synchronous
data parallelism every rank waits at each allreduce for the slowest one, so one slow process (a throttled GPU,
a busy host) sets the pace of all. Relaxed sync measures each rank's *own* compute time (data, forward and
backward up to its last gradient bucket, not the step's wall time, which is the same everywhere because all
wait for the slowest), shares the times at each check, and evicts the ranks slower than ``threshold`` times a
reference (median; the minimum when two ranks remain). The survivors agree on the verdict through the c10d
store, form a new process group without the evicted ranks (which exit 0 and are never waited for again) and
continue with identical parameters. Once the group has shrunk below ``relaxed_sync_mode_threshold`` of its
initial size, the train loader is rebuilt over the survivors and the learning rate rescaled; above it, as in
CAC, the evicted ranks' shards are simply not trained on.

What is measured is ``measure``. ``compute`` (CAC's) sees slow processes but not slow links: a rank whose
network link is slow computes as fast as the others, and every rank waits alike in the allreduce. ``link``
times a pairwise exchange of ``link_probe_bytes`` with every other active rank at each check (one pair per
rank per round, rounds separated by barriers) and takes the *fastest* of a rank's exchanges: a transfer
crosses both ends' links, so only a rank whose own link is slow is slow with every peer. Attributing a
slow link needs three ranks or more (with two, both see the same one exchange).

``RelaxedSync`` is ``sync=relaxed``; ``RelaxedSyncDistributedDataParallel`` is the CAC-compatible API on the
same machinery (``Relaxer``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from algorithms.base import SyncAlgorithm, SyncContext, SyncReport
from algorithms.comm import Communicator
from algorithms.membership import Membership

REFERENCES = ("median", "mean", "min")
LR_POLICIES = ("linear", "sqrt", "none")
MEASURES = ("compute", "link")


@dataclass
class Verdict:
    """The outcome of one check, identical on every rank."""

    check: int
    ranks: list[int]  # the active ranks that were measured
    times: list[float]  # their measured times (own compute per step, or link probe), seconds, in ``ranks`` order
    reference: float  # the reference time the threshold multiplies, seconds
    evicted: list[int]

    @property
    def survivors(self) -> list[int]:
        return [r for r in self.ranks if r not in self.evicted]


def reference_time(times: list[float], reference: str) -> float:
    """CAC's reference: the median, but the minimum when only two ranks remain (a median of two is their mean,
    and a rank 3x slower than its peer is only 1.5x that mean)."""
    if reference == "min" or len(times) <= 2:
        return min(times)
    if reference == "mean":
        return statistics.fmean(times)
    return statistics.median(times)


def decide(
    ranks: list[int],
    times: list[float],
    threshold: float,
    reference: str,
    min_num_processes: int,
    protected: tuple[int, ...] = (),
    check: int = 0,
) -> Verdict:
    """Evict ranks slower than ``threshold`` x the reference, slowest first, never below ``min_num_processes``."""
    ref = reference_time(times, reference)
    evicted: list[int] = []
    if threshold >= 0:
        slow = sorted(
            ((t, r) for r, t in zip(ranks, times) if t > threshold * ref and r not in protected), reverse=True
        )
        budget = max(0, len(ranks) - min_num_processes)
        evicted = sorted(r for _, r in slow[:budget])
    return Verdict(check=check, ranks=list(ranks), times=list(times), reference=ref, evicted=evicted)


class Relaxer:
    """Eviction mechanics: share times, agree on a verdict through the store, switch to the survivors' group.

    Under torch's elastic launcher (and torchrun) the store lives in the agent, so any rank, rank 0 included,
    can leave. Evicted ranks never call a collective again; survivors build their group with
    ``new_group(..., use_local_synchronization=True)``, which the evicted ranks need not join.
    """

    def __init__(
        self,
        comm: Communicator,
        threshold: float,
        min_num_processes: int = 1,
        reference: str = "median",
        protect_rank0: bool = False,
    ):
        self.comm, self.membership = comm, comm.membership
        self.threshold, self.min_num_processes = threshold, min_num_processes
        self.reference, self.protected = reference, (0,) if protect_rank0 else ()
        self.num_checks = 0
        # After a restart the agent's store still holds the previous attempt's keys.
        self.prefix = f"relaxsync/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/relaxed"

    def check(self, own_time: float, min_num_processes: int | None = None) -> Verdict:
        """Collective over the active group: every active rank calls it with its own mean compute time."""
        times = self.comm.all_gather(torch.tensor([own_time], dtype=torch.float64, device=_device(self.comm)))
        proposal = decide(
            self.membership.ranks,
            [float(t.item()) for t in times],
            self.threshold,
            self.reference,
            self.min_num_processes if min_num_processes is None else min_num_processes,
            self.protected,
            check=self.num_checks,
        )
        verdict = self._agree(proposal)
        self.num_checks += 1
        if verdict.evicted:
            self._apply(verdict)
        return verdict

    def _agree(self, proposal: Verdict) -> Verdict:
        """First writer wins: every rank proposes, every rank adopts what the store holds."""
        store = dist.distributed_c10d._get_default_store()
        key = f"{self.prefix}/check{proposal.check}"
        stored = store.compare_set(key, "", json.dumps(asdict(proposal)))
        return Verdict(**json.loads(stored))

    def _apply(self, verdict: Verdict) -> None:
        survivors = verdict.survivors
        if self.membership.rank in verdict.evicted:
            self.membership.replace(survivors, None)
            return
        group = dist.new_group(survivors, use_local_synchronization=True)
        self.membership.replace(survivors, group)


def round_robin(ranks: list[int]) -> list[list[tuple[int, int]]]:
    """Rounds in which every pair of ``ranks`` meets exactly once and no rank is in two pairs of a round (the
    circle method: one rank fixed, the others rotating; with an odd count, one rank sits each round out)."""
    order: list[int | None] = list(ranks) + ([None] if len(ranks) % 2 else [])
    n = len(order)
    rounds = []
    for _ in range(n - 1):
        pairs = [(order[i], order[n - 1 - i]) for i in range(n // 2)]
        rounds.append([(a, b) for a, b in pairs if a is not None and b is not None])
        order = [order[0], order[-1], *order[1:-1]]
    return rounds


def link_time(comm: Communicator, nbytes: int) -> float:
    """Collective over the active group: time an exchange of ``nbytes`` each way with every other active rank,
    one pair at a time per rank, and return this rank's fastest (inf when it is alone)."""
    me = comm.membership.rank
    device = _device(comm)
    send = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    times = []
    for pairs in round_robin(comm.membership.ranks):
        comm.barrier()  # a pair starts together, not when the slower of its previous pairs finished
        peer = next((b if a == me else a for a, b in pairs if me in (a, b)), None)
        if peer is None:
            continue
        start = time.perf_counter()
        comm.exchange([(send, peer)], [(recv, peer)])
        times.append(time.perf_counter() - start)
    return min(times, default=math.inf)


def _device(comm: Communicator) -> torch.device:
    backend = dist.get_backend(comm.group) if comm.group is not None else "gloo"
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class RelaxedSync(SyncAlgorithm):
    """``sync=relaxed``: evict stragglers at each check; the exchange among survivors is ``inner``."""

    name = "relaxed"

    def __init__(
        self,
        inner: SyncAlgorithm,
        relaxed_sync_threshold: float = 3.0,
        relaxed_sync_mode_threshold: float = 0.8,
        min_num_processes: int = 1,
        reference: str = "median",
        check_every: str | int = "epoch",
        lr_policy: str = "linear",
        protect_rank0: bool = False,
        measure: str = "compute",
        link_probe_bytes: int = 1 << 20,
    ):
        self.inner = inner
        self.measure, self.link_probe_bytes = measure, link_probe_bytes
        self.threshold = relaxed_sync_threshold
        self.mode_threshold = relaxed_sync_mode_threshold
        self.min_num_processes = min_num_processes
        self.reference = reference
        self.check_every = check_every
        self.lr_policy = lr_policy
        self.protect_rank0 = protect_rank0
        self.evictions: list[dict[str, Any]] = []
        self._times: list[float] = []  # own compute time of each step in the current window
        self._mark: float | None = None  # when this rank's previous step finished communicating
        self._pending_train_rebuild = False

    @classmethod
    def validate(cls, sync_cfg: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        from hydra.utils import get_class

        from engine.config import ConfigError

        t = sync_cfg["relaxed_sync_threshold"]
        if not isinstance(t, (int, float)) or 0 <= t <= 1:
            raise ConfigError(
                "sync.relaxed_sync_threshold",
                t,
                "a factor > 1 (in [0, 1] healthy ranks would be evicted), or < 0 to disable",
            )
        m = sync_cfg["relaxed_sync_mode_threshold"]
        if not (isinstance(m, (int, float)) and 0 < m <= 1):
            raise ConfigError("sync.relaxed_sync_mode_threshold", m, "a fraction in (0, 1]")
        n = sync_cfg["min_num_processes"]
        if not (isinstance(n, int) and 1 <= n <= world_size):
            raise ConfigError("sync.min_num_processes", n, f"an integer in [1, {world_size}] (the world size)")
        if sync_cfg["reference"] not in REFERENCES:
            raise ConfigError("sync.reference", sync_cfg["reference"], f"one of {', '.join(REFERENCES)}")
        if sync_cfg["lr_policy"] not in LR_POLICIES:
            raise ConfigError("sync.lr_policy", sync_cfg["lr_policy"], f"one of {', '.join(LR_POLICIES)}")
        if sync_cfg["measure"] not in MEASURES:
            raise ConfigError("sync.measure", sync_cfg["measure"], f"one of {', '.join(MEASURES)}")
        if sync_cfg["measure"] == "link" and world_size < 3:
            raise ConfigError(
                "sync.measure", "link", f"compute with {world_size} processes (a slow link needs 3 or more to be told)"
            )
        b = sync_cfg["link_probe_bytes"]
        if not (isinstance(b, int) and not isinstance(b, bool) and b >= 1):
            raise ConfigError("sync.link_probe_bytes", b, "an integer number of bytes >= 1")
        c = sync_cfg["check_every"]
        if not (c == "epoch" or (isinstance(c, int) and not isinstance(c, bool) and c >= 1)):
            raise ConfigError("sync.check_every", c, "epoch, or a number of steps >= 1")
        inner = sync_cfg["inner"]
        inner_cls = get_class(inner["_target_"])
        if issubclass(inner_cls, RelaxedSync):
            raise ConfigError("sync.inner", inner["_target_"], "an exchange algorithm other than relaxed")
        inner_cls.validate(inner, cfg, world_size)

    # ---- hooks -----------------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: SyncContext) -> nn.Module:
        super().setup(model, optimizer, ctx)
        self.module = self.inner.setup(model, optimizer, ctx)
        self.relaxer = Relaxer(ctx.comm, self.threshold, self.min_num_processes, self.reference, self.protect_rank0)
        return self.module

    def on_epoch_start(self, epoch: int) -> SyncReport:
        report = self.inner.on_epoch_start(epoch)
        self._mark = None  # evaluation and checkpoints ran since the last step: not compute
        if self._pending_train_rebuild:
            self._pending_train_rebuild = False
            self.ctx.rebuild_loaders(True)
        if self.check_every == "epoch" and self._times:
            report += self._check(epoch, mid_epoch=False)
        return report

    def before_step(self, step: int) -> SyncReport:
        report = self.inner.before_step(step)
        if self.check_every != "epoch" and step > 0 and step % self.check_every == 0 and self._times:
            report += self._check(None, mid_epoch=True)
        return report

    def after_backward(self, step: int, grads_finite: bool) -> SyncReport:
        report = self.inner.after_backward(step, grads_finite)
        if self._mark is not None:
            end = report.compute_end if report.compute_end is not None else time.perf_counter()
            self._times.append(end - self._mark)
        return report

    def after_optimizer_step(self, step: int) -> SyncReport:
        report = self.inner.after_optimizer_step(step)
        self._mark = time.perf_counter()
        return report

    def before_eval(self) -> None:
        self.inner.before_eval()

    def state_dict(self) -> dict[str, Any]:
        # A resumed job starts with all its processes again; only the history is kept.
        return {"inner": self.inner.state_dict(), "evictions": json.dumps(self.evictions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.evictions = json.loads(state["evictions"])

    def finalize(self) -> None:
        if self.ctx.membership.active:
            self.inner.finalize()

    # ---- the check -------------------------------------------------------------------------------------------
    def _check(self, epoch: int | None, mid_epoch: bool) -> SyncReport:
        m = self.ctx.membership
        own = statistics.fmean(self._times)
        self._times = []
        if self.measure == "link" and m.size < 3:
            return SyncReport()  # two ranks time the same one exchange: which end is slow cannot be told
        if self.measure == "link":
            own = link_time(self.ctx.comm, self.link_probe_bytes)
        verdict = self.relaxer.check(own)
        times = {str(r): t for r, t in zip(verdict.ranks, verdict.times)}
        check = {
            "event": "relaxed_check",
            "measure": self.measure,
            "times": times,
            "reference": verdict.reference,
            "evicted": verdict.evicted,
            "check": verdict.check,
        }
        if not verdict.evicted:
            return SyncReport(events=[check])
        what = "own compute" if self.measure == "compute" else "link probe"
        if not m.active:
            print(
                f"relaxsync: rank {m.rank} evicted ({what} {own * 1e3:.1f} ms > "
                f"{self.threshold:g} x reference {verdict.reference * 1e3:.1f} ms); exiting",
                flush=True,
            )
            return SyncReport()

        self.inner.on_membership_change()
        self.module = self.inner.module
        fraction = m.size / m.initial_size
        evict = {
            "event": "evict",
            "ranks": verdict.evicted,
            "times": times,
            "reference": verdict.reference,
            "threshold": self.threshold,
            "world_size": m.size,
            "check": verdict.check,
            "measure": self.measure,
            "message": (
                f"relaxsync: evicted rank(s) {verdict.evicted} by {what} "
                f"({', '.join(f'{times[str(r)] * 1e3:.1f}' for r in verdict.evicted)} ms vs reference "
                f"{verdict.reference * 1e3:.1f} ms, threshold {self.threshold:g}x); world size now {m.size}"
            ),
        }
        self.evictions.append({k: v for k, v in evict.items() if k != "message"})
        events = [check, evict]
        rebuild_train = fraction < self.mode_threshold
        if rebuild_train and mid_epoch:
            self._pending_train_rebuild = True  # the current epoch finishes on the old shards
            self.ctx.rebuild_loaders(False)
        else:
            self.ctx.rebuild_loaders(rebuild_train)
        events.append(
            {
                "event": "loader_rebuilt",
                "loaders": ["train", "val"] if rebuild_train else ["val"],
                "world_size": m.size,
                "deferred_to_next_epoch": rebuild_train and mid_epoch,
            }
        )
        if rebuild_train and self.lr_policy != "none":
            scale = fraction if self.lr_policy == "linear" else math.sqrt(fraction)
            self.ctx.set_lr_scale(scale)
            events.append({"event": "lr_adjusted", "scale": scale, "policy": self.lr_policy, "world_size": m.size})
        return SyncReport(events=events)


class RelaxedSyncDistributedDataParallel(nn.Module):
    """CAC-compatible relaxed sync: a DDP drop-in with the CAC methods, on the ``Relaxer`` machinery.

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

    An evicted rank prints a line and exits with status 0 from ``set_relaxed_pg`` (torchrun stops the job if a
    worker exits non-zero). ``simulate_slow_process=1`` makes the last ``num_sleep_processes`` ranks sleep before
    each forward from ``sleep_process_start_epoch`` on, ``sleep_time`` seconds or, when 0, 30 x their mean
    forward time (as CAC).
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
        bucket_cap_mb: float = 25.0,
    ):
        super().__init__()
        from algorithms.allreduce import AllReduce

        if not dist.is_initialized():
            raise RuntimeError("RelaxedSyncDistributedDataParallel: call torch.distributed.init_process_group first")
        self.membership = Membership(dist.get_rank(), dist.get_world_size())
        self.comm = Communicator(self.membership)
        device = next(module.parameters()).device
        self.relaxer = Relaxer(self.comm, relaxed_sync_threshold, 1, reference, protect_rank0=not master_skip)
        self.mode_threshold = relaxed_sync_mode_threshold
        self.simulate_slow_process, self.sleep_process_start_epoch = simulate_slow_process, sleep_process_start_epoch
        self.num_sleep_processes, self.sleep_time = num_sleep_processes, sleep_time
        self._train_loader_args: tuple | None = None
        self._val_loader_args: tuple | None = None
        self._changed = False
        self._epoch = 0
        self._forward_times: list[float] = []
        self._step_times: list[float] = []
        self._step_start: float | None = None
        self.loaders_rebuilt = 0
        self.module = module  # as DDP: parameters(), train()/eval() and state_dict() see the wrapped model
        self._exchange = AllReduce(bucket_cap_mb=bucket_cap_mb)
        ctx = SyncContext(comm=self.comm, membership=self.membership, device=device)
        self._exchange.setup(module, None, ctx)

    # ---- forward: timing and the simulated straggler -----------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._record_previous_step()
        self._step_start = time.perf_counter()
        self._simulate_slowness()
        start = time.perf_counter()
        out = self._exchange.module(*args, **kwargs)
        if self.training:
            self._forward_times.append(time.perf_counter() - start)
        return out

    def _record_previous_step(self) -> None:
        """Own compute of the previous step: from its forward to its last gradient bucket being ready."""
        ready = self._exchange._hook_state.last_ready
        if self._step_start is not None and ready is not None and ready > self._step_start:
            self._step_times.append(ready - self._step_start)
        self._step_start = None

    def _simulate_slowness(self) -> None:
        world = self.membership.initial_size
        slow = range(world - self.num_sleep_processes, world)
        if self.simulate_slow_process and self.training and self.membership.rank in slow:
            if self._epoch >= self.sleep_process_start_epoch:
                mean_forward = statistics.fmean(self._forward_times[-50:]) if self._forward_times else 0.0
                time.sleep(self.sleep_time or 30.0 * mean_forward)

    # ---- CAC API -------------------------------------------------------------------------------------------
    def set_relaxed_pg(self, epoch: int, min_num_processes: int | float = 1) -> None:
        """At each epoch start: evict ranks slower than the threshold (an evicted rank exits 0 here)."""
        self._epoch = epoch
        self._record_previous_step()
        if not self._step_times:
            return
        own = statistics.fmean(self._step_times)
        self._step_times = []
        verdict = self.relaxer.check(own, min_num_processes=max(1, int(min_num_processes)))
        if not verdict.evicted:
            return
        if not self.membership.active:
            print(f"relaxsync: rank {self.membership.rank} evicted at epoch {epoch}; exiting", flush=True)
            sys.stdout.flush()
            os._exit(0)  # nothing of this rank may touch a collective again, not even atexit handlers
        self._exchange.on_membership_change()
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
        """Before returning from main: wait for the other survivors, then release the process groups."""
        if self.membership.active:
            self.comm.barrier()

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _below_mode_threshold(self) -> bool:
        return self.membership.size / self.membership.initial_size < self.mode_threshold

    def _build_train_loader(self):
        from data.common import TrainSampler

        dataset, batch_size, num_workers, pin_memory, collate_fn, drop_last, kwargs = self._train_loader_args
        shard = TrainSampler(len(dataset), self.membership.size, self.membership.index, 0)
        kwargs = {**kwargs, "drop_last": drop_last}
        return self._loader(
            dataset, _EpochFollowingSampler(self, shard), batch_size, num_workers, pin_memory, collate_fn, kwargs
        )

    def _build_val_loader(self):
        from data.common import ShardSampler

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
