"""Start the workers: local ones through torch's elastic launcher (torchrun's machinery), or run as one worker
when an external launcher (torchrun, Slurm) already started this process.

Light to import (the standard library only): the launcher starts the workers' fork server before it imports torch
itself, so the two imports overlap."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import uuid
from collections.abc import Callable
from typing import Any

# Local workers fork from a server process that has imported what a worker needs (torch, timm, the engine) once,
# instead of each new process importing it again (~10 s each here, in parallel on a few cores; ~1 s a launch once
# the server runs). The server lives as long as this process: a multirun's jobs and a test session share it.
START_METHOD = "forkserver"
WORKER_PRELOAD = ["engine.worker", "sklearn.datasets"]  # the engine (torch, timm); the digits loader
MONITOR_S = 0.1  # how often the agent looks at its workers
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (the repository: engine/'s parent)


def start_worker_server() -> None:
    """Start the fork server (once per process) and let it import the workers' modules in the background; it is
    stopped when this process exits.

    The server is a new interpreter whose ``sys.path`` is its own, the current directory first (Python 3.11 does not
    give it the launcher's), so the repository goes on ``PYTHONPATH``: ``python /path/to/train.py`` run from another
    directory would otherwise have the server's imports fail, silently, and each worker import the engine itself,
    after the launcher gave it its rank (``engine.worker.adopt_environment`` then took the rank for the server's)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *paths])
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(WORKER_PRELOAD)
    multiprocessing.forkserver.ensure_running()
    atexit.unregister(stop_worker_server)  # (once, however many launches)
    atexit.register(stop_worker_server)


def stop_worker_server() -> None:
    """End the fork server now, even in the middle of its imports. Left alone, it ends only once its imports are
    done, and ``python train.py`` with a config error returned that much later: 13 to 21 s after printing the
    error on a loaded 2-core machine, against about 1 s with the server stopped."""
    server = multiprocessing.forkserver._forkserver  # (the standard library's one server of this process)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    server._stop()  # (closes its pipe, reaps it and removes its socket)


def _local_worker(*args: Any) -> Any:
    """What each local worker runs (``engine.worker.local_worker``, already imported by the fork server)."""
    from engine.worker import local_worker

    return local_worker(*args)


def launch(cfg: dict[str, Any], run_dir: str, entrypoint: Callable[..., Any] | None = None) -> dict[str, Any] | None:
    """Run ``entrypoint(cfg, run_dir)`` (default: ``engine.worker.run_worker``, a training run) in
    ``trainer.nproc`` local worker processes; return the summary of the logging rank. If any worker fails, the
    agent stops the others (a failure never hangs) and starts them all again, up to ``trainer.max_restarts`` times
    (each restart resumes from the newest checkpoint); after that it raises ``ChildFailedError`` with the worker's
    traceback. On SIGTERM the agent passes the signal to the workers, which checkpoint at an agreed step and exit
    (``engine.stop``), then raises ``SignalException``."""
    start_worker_server()
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ["RELAXSYNC_LAUNCHER"] = "local"  # (its workers take this environment: engine.worker)

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg["trainer"]["nproc"],
        run_id=f"relaxsync-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port: concurrent runs do not collide
        max_restarts=cfg["trainer"]["max_restarts"],
        monitor_interval=MONITOR_S,
        start_method=START_METHOD,
    )
    results = elastic_launch(config, _local_worker)(entrypoint, cfg, run_dir, dict(os.environ))
    summaries = [results[r] for r in sorted(results) if results[r] is not None]
    return summaries[0] if summaries else None
