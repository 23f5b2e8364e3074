"""The end of an invocation, on every rank: the summary and the exit barrier (:func:`finish`), then the files and
process groups closed (:func:`close`)."""

from __future__ import annotations

from functools import partial
from typing import Any, Protocol

import torch.distributed as dist

from distributed.membership import retire
from engine.evaluate import reached_target
from engine.failures import Phase
from engine.guard import Site


class Host(Protocol):
    """What the end of an invocation uses of the trainer."""

    cfg: dict[str, Any]
    sync: Any  # the sync algorithm
    guard: Any  # engine.guard's NoGuard or SurvivingGuard
    recorder: Any  # engine.metrics.Recorder
    run: Any  # engine.state.RunState
    comm: Any  # distributed.comm.Communicator
    stop: Any  # engine.stop.StopRequest
    evaluation: Any  # engine.evaluate.Evaluation
    membership: Any  # distributed.membership.Membership
    raw_model: Any
    num_params: int
    step: int

    def done(self) -> bool: ...


def finish(host: Host, train_s: float) -> dict[str, Any] | None:
    """The summary record and the console block (logging rank), then a barrier; returns the summary."""
    host.sync.drain()
    host.sync.finalize()
    guard, run = host.guard, host.run
    spread = partial(host.evaluation.evaluator.replica_spread, host.raw_model)
    # (a rank healed in the spread's measure enters again at the exit)
    replica_spread = guard.repeat(lambda: guard.run(Phase.END, spread, run.last_epoch, Site.END))
    t, finished = host.cfg["trainer"], host.done()
    summary = host.recorder.summarize(
        run, host.comm.totals, list(guard.lost_ranks),
        finished=finished, replica_spread=replica_spread, train_s=train_s, num_params=host.num_params,
        stopped_by=None if finished else host.stop.stopped_by(host.step),
        reached_target=reached_target(run, t) if t["target_top1"] is not None else None,
    )  # fmt: skip
    # Every rank waits for the logging rank to finish logging before any of them closes its connections:
    # gloo can abort a process whose peer disappears while it still works.
    guard.run(Phase.EXIT, host.comm.barrier, run.last_epoch, Site.END, {Phase.END: replica_spread})
    return summary


def close(host: Host, left: bool = False) -> None:
    """Close files; a rank that ``left`` the run never touches a process group again. After a loss the groups are
    aborted: destroying one waits for what it queued, on NCCL maybe for the lost rank, forever."""
    host.guard.stop()
    host.membership.cancel_ahead()  # (after the heartbeat, which prepares them, has stopped)
    host.recorder.close(left)
    if not left and dist.is_initialized():
        (dist.distributed_c10d._abort_process_group if host.guard.lost_ranks else dist.destroy_process_group)()
    elif not left and host.membership.group is not None:  # a process that joined: its groups are its own
        retire([host.membership.group])
