"""One worker process: the trainer's run, and the start of a local worker forked from the launcher's server."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from distributed.membership import LeftRun
from engine.elastic.failures import is_collective_failure
from engine.loop import Trainer

# The environment this process began with: in a worker forked from the launcher's server (which imports this
# module), the server's, before the agent set the worker's own variables (RANK, MASTER_PORT, ...) on top.
INHERITED_ENV = dict(os.environ)
CONSEQUENCE_DELAY_S = 1.0  # ten of the agent's looks at its workers (engine.launch.MONITOR_S): it sees a peer
# that exited first


@dataclass(frozen=True)
class WorkerResult:
    """What a worker process returns to the launcher."""

    summary: dict[str, Any] | None  # the logging rank's summary record
    stopped_by: str | None  # the signal the run stopped on, checkpointed at the agreed step
    left: bool = False  # this rank left the run (evicted, or given up by the others)


@record
def run_worker(cfg: dict[str, Any], run_dir: str) -> WorkerResult:
    """Entry point of every worker process (elastic launcher, torchrun or Slurm). A rank that leaves the run
    (``LeftRun``: evicted, or given up by the others) ends with status 0."""
    trainer = Trainer(cfg, run_dir)
    left = ended = False
    try:
        summary = trainer.fit()
        ended = True
        return WorkerResult(summary, trainer.stop.stopped_by(trainer.step))
    except LeftRun:
        left = True  # it said why when it left
        return WorkerResult(None, None, left=True)
    finally:
        trainer.close(left, planned=ended or left)  # (an error's end is a loss to the others: no farewell)


def exit_if_left(result: WorkerResult) -> WorkerResult:
    """A process of its own (torchrun's, Slurm's) whose rank left the run ends here, with status 0, without the
    interpreter's teardown: the groups it was removed from were aborted, and a thread of theirs can still be
    waiting on the peers; the C++ runtime ends a process whose objects are destroyed under such a thread with
    SIGABRT ("terminate called without an active exception"). Its records are closed already."""
    if result.left:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return result


def adopt_environment(launcher_env: dict[str, str], inherited: dict[str, str] = INHERITED_ENV) -> None:
    """Give this worker the launcher's environment as it is at this launch, not as it was when the fork server
    started (a multirun job's ``hydra.job.env_set``, a variable set since), keeping what the agent set for it.
    Where this module was imported in the worker itself (the fork server could not: ``engine.launch``), what it
    found was the agent's already, and nothing is taken away."""
    if "LOCAL_RANK" in inherited:
        inherited = {}
    for key in set(launcher_env) | set(inherited):
        if os.environ.get(key) != inherited.get(key):
            continue  # the agent set it for this worker
        if key in launcher_env:
            os.environ[key] = launcher_env[key]
        else:
            os.environ.pop(key, None)


def local_worker(
    entrypoint: Callable[..., Any] | None, cfg: dict[str, Any], run_dir: str, launcher_env: dict[str, str]
) -> Any:
    """A local worker process (``entrypoint`` defaults to :func:`run_worker`); returns the summary (logging rank).
    After a stop on a signal (checkpoint written, files closed) it exits at once: the agent, shutting down, no
    longer reads results, and a worker that waited for it would be killed after 30 s. A worker whose collective
    failed because a peer went away lets that peer's exit be seen first, so the agent reports the peer's error as
    the run's root cause, not the lost connection."""
    adopt_environment(launcher_env)
    per_node = cfg["trainer"]["nproc"] // cfg["trainer"].get("local_nodes", 1)
    if cfg["trainer"].get("local_nodes", 1) > 1:  # (emulated nodes: a name of its own for each, distributed/world.py)
        os.environ["RELAXSYNC_NODE"] = f"local{int(os.environ['LOCAL_RANK']) // per_node}"
        os.environ["RELAXSYNC_NODE_SIZE"] = str(per_node)
    try:
        result = (entrypoint or run_worker)(cfg, run_dir)
    except Exception as error:
        if is_collective_failure(error):
            time.sleep(CONSEQUENCE_DELAY_S)
        raise
    if not isinstance(result, WorkerResult):  # (another entrypoint: what it returns)
        return result
    if result.stopped_by:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return result.summary
