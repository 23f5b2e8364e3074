"""The end of an invocation, on every rank: the summary and the exit barrier (:func:`finish`), then the files and
process groups closed (:func:`close`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch.distributed as dist

from distributed import runstore
from distributed.membership import retire
from engine.elastic.positions import Phase, Site
from engine.evaluate import reached_target


class Host(Protocol):
    """What the end of an invocation uses of the trainer."""

    cfg: dict[str, Any]
    sync: Any  # the sync algorithm
    elastic: Any  # engine.elastic's face
    recorder: Any  # engine.metrics.Recorder
    run: Any  # engine.state.RunState
    comm: Any  # distributed.comm.Communicator
    stop: Any  # engine.stop.StopRequest
    checkpointer: Any  # engine.checkpoint.Checkpointer
    num_params: int

    def done(self) -> bool: ...


class Closing(Protocol):
    """What closing an invocation uses of the trainer."""

    elastic: Any  # engine.elastic's face
    membership: Any  # distributed.membership.Membership
    recorder: Any  # engine.metrics.Recorder


def finished_already(host: Host) -> dict[str, Any]:
    """A run resumed from a checkpoint at its end trains nothing and writes no summary: the line, a barrier, and the
    top-1 it had."""
    host.recorder.console(host.checkpointer.finished(host.run, host.cfg["trainer"]["epochs"]))
    host.comm.barrier()
    return {"top1": (host.run.last_eval or {}).get("top1"), "already_finished": True}


def finish(host: Host, train_s: float, spread: Callable[[], Any]) -> dict[str, Any] | None:
    """The summary record and the console block (logging rank), then a barrier; returns the summary. ``spread``
    measures how far the replicas are apart."""
    host.sync.drain()
    host.sync.finalize()
    elastic, run = host.elastic, host.run
    # (a rank healed in the spread's measure enters again at the exit)
    replica_spread = elastic.repeat(lambda: elastic.run(Phase.END, spread, run.last_epoch, Site.END))
    t, finished = host.cfg["trainer"], host.done()
    summary = host.recorder.summarize(
        run, host.comm.totals, list(elastic.lost_ranks),
        finished=finished, replica_spread=replica_spread, train_s=train_s, num_params=host.num_params,
        stopped_by=None if finished else host.stop.stopped_by(run.step),
        reached_target=reached_target(run, t) if t["target_top1"] is not None else None,
    )  # fmt: skip
    # Every rank waits for the logging rank to finish logging before any of them closes its connections:
    # gloo can abort a process whose peer disappears while it still works.
    elastic.run(Phase.EXIT, host.comm.barrier, run.last_epoch, Site.END, {Phase.END: replica_spread})
    return summary


def lights_out(membership: Any) -> None:
    """At a planned end, on a run whose store is an etcd cluster: the last active rank to get here (its heartbeat
    stopped, as every one before it) deletes the run's keys. A failure leaves them, for whoever looks into it; the
    members' compaction bounds what they hold meanwhile."""
    store = runstore.of(membership.store)
    if not store.replicated:  # (torch's store ends with its process, and its keys with it)
        return
    with contextlib.suppress(Exception):  # (the cluster gone: nothing to delete, or to delete from)
        if store.add(membership.key("closed"), 1) >= len(membership.ranks):
            store.forget_run()


def close(host: Closing, left: bool = False, planned: bool = True) -> None:
    """Close files; a rank that ``left`` the run never touches a process group again. After a loss the groups are
    aborted: destroying one waits for what it queued, on NCCL maybe for the lost rank, forever. ``planned``: this
    process ends on purpose (the others are told; an end on an error is a loss to them)."""
    host.elastic.stop(planned)
    host.membership.cancel_ahead()  # (after the heartbeat, which prepares them, has stopped)
    if planned and not left:
        lights_out(host.membership)
    host.recorder.close(left)
    if not left and dist.is_initialized():
        (dist.distributed_c10d._abort_process_group if host.elastic.lost_ranks else dist.destroy_process_group)()
    elif not left and host.membership.group is not None:  # a process that joined: its groups are its own
        retire([host.membership.group])
