"""The contract between the trainer and a sync algorithm.

The trainer calls the hooks of exactly one :class:`SyncAlgorithm` in a fixed order and never asks which
algorithm it runs. Per optimizer step::

    report  = sync.before_step(step)              # membership checks, straggler bookkeeping
    with amp.autocast(): loss = criterion(model(x), y)
    amp.backward(loss, optimizer)                  # DDP (if setup() wrapped the model) syncs here
    amp.unscale(optimizer)                         # gradients seen below are unscaled
    report += sync.after_backward(step, grads_finite)
    amp.step(optimizer, report.grads_finite)       # skipped on every rank when False
    report += sync.after_optimizer_step(step)
    schedule.step(); logger.log(report ...)

plus ``on_epoch_start(epoch)`` before each epoch (before its loaders are iterated), ``before_eval()`` before
each evaluation and checkpoint, and ``finalize()`` once at the end. The trainer runs the forward pass through
``sync.module`` (read at every step), so an algorithm may rewrap the model, e.g. after the group changed.

Membership: ``ctx.membership`` holds the active ranks and their group. An algorithm that changes it (relaxed
sync) calls ``on_membership_change()`` on the algorithm it wraps, so that one rebinds to the new group. A rank
that is no longer active stops training at the next hook boundary, writes nothing more and exits 0.

Overflow steps (AMP with dynamic loss scaling): ``grads_finite`` is this rank's own verdict on its unscaled
gradients. Every rank must take the same branch, so an algorithm that communicates gradients returns in
``SyncReport.grads_finite`` a verdict derived from communicated data, identical on every rank (for DDP the
gradients are averaged before unscaling, so the local verdict on the averaged gradients already is). An
algorithm whose ranks step independently (local SGD between syncs) may return the local verdict. On a skipped
step the algorithm must leave its own state (residuals, momenta) as it was before the step.

Collectives go through :class:`algorithms.comm.Communicator` (``ctx.comm``), which counts bytes and seconds;
the trainer reads and resets those counters after every step, so hooks only return what the Communicator
cannot know: ``events`` and algorithm-specific ``extra`` metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class SyncReport:
    """What one step of synchronization cost this rank, and what happened."""

    bytes_sent: float = 0.0  # modeled wire bytes, mean per active rank (see Communicator)
    payload_bytes: float = 0.0  # bytes of tensors handed to collectives
    comm_seconds: float = 0.0
    grads_finite: bool = True  # the agreed overflow verdict (identical on every rank)
    compute_end: float | None = None  # perf_counter() when this rank's own compute ended, if known
    events: list[dict[str, Any]] = field(default_factory=list)  # e.g. {"event": "evict", ...}
    extra: dict[str, float] = field(default_factory=dict)  # algorithm metrics, e.g. {"sparsity": 0.999}

    def __iadd__(self, other: SyncReport) -> SyncReport:
        self.bytes_sent += other.bytes_sent
        self.payload_bytes += other.payload_bytes
        self.comm_seconds += other.comm_seconds
        self.grads_finite = self.grads_finite and other.grads_finite
        if other.compute_end is not None:
            self.compute_end = other.compute_end
        self.events.extend(other.events)
        self.extra.update(other.extra)
        return self

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class SyncContext:
    """Runtime objects a sync algorithm may use; built by the trainer."""

    comm: Any  # algorithms.comm.Communicator over the active group
    membership: Any  # algorithms.membership.Membership
    device: torch.device
    # Rebuild the data loaders over the active ranks: (train=True) both, (train=False) the val loader only.
    rebuild_loaders: Callable[[bool], None] = lambda train: None
    # Multiply the scheduled learning rate by this factor from now on.
    set_lr_scale: Callable[[float], None] = lambda scale: None
    # This rank's loss and the learning rate of the current step (valid in after_optimizer_step).
    get_loss: Callable[[], float] = lambda: float("nan")
    get_lr: Callable[[], float] = lambda: float("nan")


class SyncAlgorithm:
    """Base class: every hook is a no-op that reports nothing.

    Subclasses are built by Hydra from ``conf/sync/<name>.yaml`` (``_target_``) with only their own keys, then
    receive runtime objects in :meth:`setup`.
    """

    #: the W&B tag and the config option name
    name: str = "base"
    #: True when ranks hold different state (residuals, local momenta): every rank then checkpoints its own
    #: ``state_dict()`` beside the main checkpoint, and loads its own on resume.
    per_rank_state: bool = False
    #: True when replicas differ (gossip): evaluation then also reports the replicas' own accuracy, measured
    #: before ``before_eval()`` brings them into agreement.
    evaluates_replicas: bool = False

    @classmethod
    def validate(cls, sync_cfg: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        """Raise ``ConfigError`` for bad options before any worker starts.

        ``sync_cfg`` is this algorithm's own section (``sync`` or ``sync.inner``), ``cfg`` the whole config.
        """

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx: SyncContext) -> nn.Module:
        """Return the module to train (possibly wrapped, e.g. in DDP); also kept as ``self.module``."""
        self.ctx = ctx
        self.model = model
        self.optimizer = optimizer
        self.module = model
        return model

    def on_membership_change(self) -> None:
        """The active group changed (``ctx.membership``); rebind whatever holds the old group."""

    def on_epoch_start(self, epoch: int) -> SyncReport:
        return SyncReport()

    def before_step(self, step: int) -> SyncReport:
        return SyncReport()

    def after_backward(self, step: int, grads_finite: bool) -> SyncReport:
        return SyncReport(grads_finite=grads_finite)

    def after_optimizer_step(self, step: int) -> SyncReport:
        return SyncReport()

    def before_eval(self) -> None:
        """Bring what evaluation and checkpoints read into agreement; default: average BN buffers."""
        self.ctx.comm.average_buffers(self.model)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def finalize(self) -> None:
        pass
