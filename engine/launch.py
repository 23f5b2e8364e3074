"""Start the workers: local ones through torch's elastic launcher (torchrun's machinery), or run as one worker
when an external launcher (torchrun, Slurm) already started this process.

Light to import (the standard library only): the launcher starts the workers' fork server before it imports torch
itself, so the two imports overlap."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import uuid
from collections.abc import Callable
from typing import Any

# Local workers fork from a server process that has imported what a worker needs (torch, timm, the engine) once,
# instead of each new process importing it again (~10 s each here, in parallel on a few cores; ~1 s a launch once
# the server runs). The server lives as long as this process: a multirun's jobs and a test session share it.
START_METHOD = "forkserver"
WORKER_PRELOAD = ["engine.worker", "sklearn.datasets"]  # the engine (torch, timm); the digits loader
MONITOR_S = 0.1  # how often the agent looks at its workers
SLURM_PORTS = (15000, 35000)  # a Slurm job's rendezvous port is in this range, from its id


def start_worker_server() -> None:
    """Start the fork server (once per process) and let it import the workers' modules in the background."""
    multiprocessing.get_context(START_METHOD).set_forkserver_preload(WORKER_PRELOAD)
    multiprocessing.forkserver.ensure_running()


EARLY_SIGNALS: list[int] = []  # SIGTERM received before the training loop armed its stop (engine.stop)


def catch_early_signals() -> None:
    """From a worker's first line: a SIGTERM that comes while it imports and builds (a preemption, a time limit's
    ``--signal`` early in a job) is kept for the training loop, which stops at its first agreed step and
    checkpoints, instead of ending the process with nothing saved."""
    signal.signal(signal.SIGTERM, lambda signum, frame: EARLY_SIGNALS.append(signum))


def under_external_launcher(env: os._Environ | dict = os.environ) -> bool:
    """torchrun sets RANK and WORLD_SIZE for every worker it starts; srun starts each task as one worker."""
    return ("RANK" in env and "WORLD_SIZE" in env) or slurm_task(env)


def slurm_task(env: os._Environ | dict = os.environ) -> bool:
    """Whether this process is a task ``srun`` started (one worker of the job's world): a job step's task, not the
    batch script of ``sbatch`` (which has no step, and launches local workers as anywhere else), and not a worker of
    a torchrun that srun started (torchrun set its RANK)."""
    return "RANK" not in env and all(k in env for k in ("SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS"))


def launcher_name(env: os._Environ | dict = os.environ) -> str:
    """Which launcher formed the world, for the console and the world event."""
    if "RELAXSYNC_LAUNCHER" in env:  # (set for its workers by train.py: srun, local)
        return env["RELAXSYNC_LAUNCHER"]
    if slurm_task(env):
        return "srun"
    return "torchrun" if "TORCHELASTIC_RUN_ID" in env else "local"


def slurm_world(env: os._Environ | dict = os.environ) -> dict[str, str]:
    """What torch's ``env://`` rendezvous reads, from a Slurm task's environment: its rank, the world size and its
    local rank from Slurm; the address of the step's first node (``scontrol show hostnames`` expands a compressed
    list such as ``n[1-2,5]``); a port derived from the job id unless ``MASTER_PORT`` is set, the same after a
    requeue (the job keeps its id)."""
    nodes = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
    first = subprocess.run(
        ["scontrol", "show", "hostnames", nodes], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    port = env.get("MASTER_PORT") or str(SLURM_PORTS[0] + int(env["SLURM_JOB_ID"]) % (SLURM_PORTS[1] - SLURM_PORTS[0]))
    return {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": env.get("MASTER_ADDR") or first,
        "MASTER_PORT": port,
        "RELAXSYNC_LAUNCHER": "srun",
    }


def requeue_slurm_job(env: os._Environ | dict = os.environ) -> str:
    """After a stop on a signal (a time limit's ``--signal``, preemption, ``scancel --signal``), put this Slurm batch
    job back in the queue, where it resumes from the stop's checkpoint when it runs again (``SLURM_RESTART_COUNT``).
    Not a job being cancelled, an interactive allocation or one submitted with ``--no-requeue``. Returns what was
    done, for the console."""
    job = env["SLURM_JOB_ID"]
    shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True)
    fields = dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f)
    if fields.get("JobState") != "RUNNING" or fields.get("BatchFlag") != "1" or fields.get("Requeue") != "1":
        why = f"JobState={fields.get('JobState')} BatchFlag={fields.get('BatchFlag')} Requeue={fields.get('Requeue')}"
        return f"Slurm job {job} not requeued ({why}): continue it with trainer.resume=auto"
    done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if done.returncode != 0:
        return f"Slurm job {job} could not be requeued ({done.stderr.strip()}): continue it with trainer.resume=auto"
    return f"Slurm job {job} requeued: it resumes from this checkpoint when it runs again"


def external_run_dir(env: os._Environ | dict = os.environ) -> str:
    """A run dir every rank of an externally launched job agrees on without talking; under Slurm the job's, which a
    requeued job keeps."""
    if "SLURM_JOB_ID" in env and "TORCHELASTIC_RUN_ID" not in env:
        return os.path.join("outputs", "slurm", env["SLURM_JOB_ID"])
    return os.path.join("outputs", "torchrun", env.get("TORCHELASTIC_RUN_ID") or "default")


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
