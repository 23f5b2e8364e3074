"""Start the workers: local ones through torch's elastic launcher (torchrun's machinery), or run as one worker
when an external launcher (torchrun, Slurm) already started this process."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from distributed.membership import LeftRun
from engine.loop import Trainer


@dataclass(frozen=True)
class WorkerResult:
    """What a worker process returns to the launcher."""

    summary: dict[str, Any] | None  # the logging rank's summary record
    stopped_by: str | None  # the signal the run stopped on, checkpointed at the agreed step


@record
def run_worker(cfg: dict[str, Any], run_dir: str) -> WorkerResult:
    """Entry point of every worker process (elastic launcher, torchrun or Slurm). A rank that leaves the run
    (``LeftRun``: evicted, or given up by the others) ends with status 0."""
    trainer = Trainer(cfg, run_dir)
    left = False
    try:
        summary = trainer.fit()
        return WorkerResult(summary, trainer.stop.stopped_by(trainer.step))
    except LeftRun:
        left = True  # it said why when it left
        return WorkerResult(None, None)
    finally:
        trainer.close(left)


def local_worker(entrypoint: Callable[..., Any], cfg: dict[str, Any], run_dir: str) -> Any:
    """A local worker process; returns the summary (logging rank). After a stop on a signal (checkpoint written,
    files closed) it exits at once: the agent, shutting down, no longer reads results, and a worker that waited for
    it would be killed after 30 s."""
    result = entrypoint(cfg, run_dir)
    if not isinstance(result, WorkerResult):  # (another entrypoint: what it returns)
        return result
    if result.stopped_by:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return result.summary


def under_external_launcher(env: os._Environ | dict = os.environ) -> bool:
    """torchrun and Slurm-with-env set RANK and WORLD_SIZE for every worker they start."""
    return "RANK" in env and "WORLD_SIZE" in env


def external_run_dir(env: os._Environ | dict = os.environ) -> str:
    """A run dir every rank of an externally launched job agrees on without talking."""
    run_id = env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or "default"
    return os.path.join("outputs", "torchrun", run_id)


def launch(cfg: dict[str, Any], run_dir: str, entrypoint: Callable[..., Any] = run_worker) -> dict[str, Any] | None:
    """Run ``entrypoint(cfg, run_dir)`` in ``trainer.nproc`` local worker processes; return the summary of
    the logging rank. If any worker fails, the agent stops the others (a failure never hangs) and starts them all
    again, up to ``trainer.max_restarts`` times (each restart resumes from the newest checkpoint); after that it
    raises ``ChildFailedError`` with the worker's traceback. On SIGTERM the agent passes the signal to the
    workers, which checkpoint at an agreed step and exit (``engine.stop``), then raises ``SignalException``."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg["trainer"]["nproc"],
        run_id=f"relaxsync-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port: concurrent runs do not collide
        max_restarts=cfg["trainer"]["max_restarts"],
        monitor_interval=0.1,
        start_method="spawn",
    )
    results = elastic_launch(config, local_worker)(entrypoint, cfg, run_dir)
    summaries = [results[r] for r in sorted(results) if results[r] is not None]
    return summaries[0] if summaries else None
