"""Carrying out what the sync algorithm's hooks report (``algorithms/base.py``'s :class:`SyncReport`): the trainer
calls :func:`carry_out` after each hook, and the failure guard after a membership change, which the algorithm
answers with a report of its own (``on_membership_change``). Nothing here depends on which algorithm runs; what
the trainer must change of itself comes back (:class:`Carried`). Also what the trainer does at an admission
(:func:`resize`, where the elastic component hands it the new world) and with the files its loaders skipped
(:func:`report_skipped`)."""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, Protocol

from algorithms.base import RebuildTrainLoader, ScaleLR, SyncReport
from engine.optim import build_schedule
from engine.scope import build_sync
from engine.state import LoopState, load_replica


class Host(Protocol):
    """What carrying out a report uses of the trainer."""

    membership: Any  # distributed.membership.Membership
    changes: Any  # distributed.membership.Changes: the trainer's one reader of them
    loop: Any  # engine.state.LoopState
    sync: Any  # the sync algorithm
    recorder: Any  # engine.metrics.Recorder
    loaders: Any  # data.common.Loaders
    rank: int
    step: int


class Carried(NamedTuple):
    """What the trainer changes of itself after a report."""

    reshard_next_epoch: bool  # a reshard asked mid-epoch, done when the next epoch starts
    lr_scale: float | None  # the LR schedule's new scale, if asked (ScaleLR)


def carry_out(host: Host, report: SyncReport, epoch: int, at_epoch_start: bool = False) -> Carried:
    """Follow the membership changes since the last call (the algorithm answers each with a report of its own),
    record the events and carry out the requests. Training shards change only between epochs: a reshard asked
    mid-epoch waits for the next one."""
    m, loop, recorder = host.membership, host.loop, host.recorder
    changes = host.changes.take()
    if changes:
        report = SyncReport(events=list(report.events), requests=list(report.requests))  # (the caller's stays)
        for change in changes:
            report += host.sync.on_membership_change(change)
        recorder.elect()  # the logging rank may have left
        # Every rank settles the replicas again before the next evaluation or checkpoint: the settle's collective may
        # have completed on some ranks and not on one whose alarm rang (a regroup with no one gone), which would
        # then settle alone while the others, settled at this step already, went on to the evaluation's allreduce.
        loop.agreed_at_step = None
    for event in report.events:
        recorder.event(event, epoch, host.step)
    reshard = any(isinstance(r, RebuildTrainLoader) for r in report.requests)
    train_now = at_epoch_start and (reshard or loop.reshard_next_epoch)
    if changes or train_now:
        host.loaders.build(m.size, m.index, train=train_now)
    reshard_next_epoch, scale = (loop.reshard_next_epoch or reshard) and not train_now, None
    if changes or reshard:
        event = {"event": "loader_rebuilt", "loaders": ["train", "val"] if reshard else ["val"], "world_size": m.size}
        recorder.event({**event, "deferred_to_next_epoch": reshard and not at_epoch_start}, epoch, host.step)
    for request in report.requests:
        if isinstance(request, ScaleLR):
            scale = request.scale
            event = {"event": "lr_adjusted", "scale": request.scale, "policy": request.policy}
            recorder.event({**event, "world_size": m.size}, epoch, host.step)
    return Carried(reshard_next_epoch, scale)


class Resized(Host, Protocol):
    """What an admission changes of the trainer."""

    cfg: dict[str, Any]
    data: Any  # data.common.Data
    batch_size: int
    checkpointer: Any  # engine.checkpoint.Checkpointer
    run: Any  # engine.state.RunState
    schedule: Any  # engine.optim's LR schedule
    raw_model: Any
    optimizer: Any
    awaiting: Any  # a joiner's: the rest of its state, still on its way

    def context(self, replicas_agree: bool = False) -> Any: ...


def resize(host: Resized, change: Any) -> None:
    """Go on as a run resumed from ``change.state`` (a checkpoint's; ``engine.elastic.face.Resize``) at the
    membership's new size, with this rank's own algorithm state (a joiner's starts fresh). The admission is followed
    by this, not by ``on_membership_change``."""
    state, m = change.state, host.membership
    if change.replica:
        load_replica(host, state, change.partial_model)
    host.rank = host.checkpointer.rank = m.rank
    host.run.resume(state, len(host.data.train), m.size, host.batch_size)
    host.schedule = build_schedule(host.cfg, len(host.data.train), m.size)
    if host.sync is not None:
        host.sync.finalize()  # (settled at the admission: what it runs on its own ends, sync=decoupled's syncer)
    host.sync = None  # (the old algorithm's hooks on the model, DDP's, go with it before the new one's)
    host.sync = build_sync(host.cfg["sync"], m)
    host.sync.setup(host.raw_model, host.optimizer, host.context(replicas_agree=True))
    if "sync" in state:  # (a joiner may take a late shared state later: the trainer's complete())
        host.sync.load_state_dict(state["sync"])
    if change.own is not None:
        host.sync.load_local_state_dict(change.own)
    host.loaders.build(m.size, m.index)
    host.loop = LoopState(epochs_this_run=host.loop.epochs_this_run)
    host.changes.take()
    host.awaiting = change.rest
    host.recorder.elect()


def report_skipped(host: Host, epoch: int) -> None:
    """A ``file_skipped`` event for each image file the loaders skipped since the last report (this rank's;
    ``data.on_bad_file=skip``), its line on this rank's console whichever rank logs."""
    for path, why in host.loaders.take_skipped():
        message = f"relaxsync: rank {host.rank} skipped {path}: {why} (data.on_bad_file=skip)"
        event = {"event": "file_skipped", "path": path, "why": why, "rank": host.rank, "message": message}
        host.recorder.event(event, epoch, host.step)
        if not host.membership.is_logging_rank:
            print(message, file=sys.stderr, flush=True)
