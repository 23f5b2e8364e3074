"""Carrying out what the sync algorithm's hooks report (``algorithms/base.py``'s :class:`SyncReport`): the trainer
calls :func:`carry_out` after each hook, and the failure guard after a membership change, which the algorithm
answers with a report of its own (``on_membership_change``). Nothing here depends on which algorithm runs; what
the trainer must change of itself comes back (:class:`Carried`)."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from algorithms.base import RebuildTrainLoader, ScaleLR, SyncReport


class Host(Protocol):
    """What carrying out a report uses of the trainer."""

    membership: Any  # distributed.membership.Membership
    changes: Any  # distributed.membership.Changes: the trainer's one reader of them
    loop: Any  # engine.state.LoopState
    sync: Any  # the sync algorithm
    recorder: Any  # engine.metrics.Recorder
    loaders: Any  # data.common.Loaders
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
