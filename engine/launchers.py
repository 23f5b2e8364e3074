"""Which launcher started this process, and what it says: torchrun's and the local launcher's workers (``RANK`` and
``WORLD_SIZE`` set for them), a task ``srun`` started (one worker of the job's world), the batch script of
``sbatch`` (a launcher of local workers like any shell). Read from the environment alone (the standard library
only), by the launcher before it imports torch and by the workers."""

from __future__ import annotations

import os
import signal
import subprocess

SLURM_PORTS = (15000, 35000)  # a Slurm job's rendezvous port is in this range, from its id


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
        "LOCAL_WORLD_SIZE": str(tasks_on_node(env)),
        "MASTER_ADDR": env.get("MASTER_ADDR") or first,
        "MASTER_PORT": port,
        "RELAXSYNC_LAUNCHER": "srun",
    }


def tasks_on_node(env: os._Environ | dict = os.environ) -> int:
    """How many tasks of this job step run on this task's node: its entry (``SLURM_NODEID``) in Slurm's compressed
    per-node list (``SLURM_STEP_TASKS_PER_NODE``, e.g. ``4(x2),3``: four on each of the first two nodes, three on the
    third); 1 when Slurm does not say."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        count, _, times = part.partition("(x")
        counts += [int(count)] * (int(times.rstrip(")")) if times else 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return counts[node] if node < len(counts) else 1


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


def slurm_job(env: os._Environ | dict = os.environ) -> str | None:
    """The Slurm job whose world this process is in (a requeued job keeps its id); None outside Slurm, and for a
    worker of torchrun started inside a Slurm job (its world is torchrun's)."""
    return env["SLURM_JOB_ID"] if "SLURM_JOB_ID" in env and "TORCHELASTIC_RUN_ID" not in env else None


WORLD_ENV = "RELAXSYNC_WORLD"


def world_id(env: os._Environ | dict = os.environ) -> str:
    """The identity of this process's world, the same on each of its ranks and after a restart or requeue; on a
    process that joined a run (``trainer.join``), that run's (``RELAXSYNC_WORLD``, from its join.json)."""
    if env.get(WORLD_ENV):
        return env[WORLD_ENV]
    job = slurm_job(env)
    return f"slurm-{job}" if job is not None else f"torchelastic-{env.get('TORCHELASTIC_RUN_ID', 'none')}"


def external_run_dir(env: os._Environ | dict = os.environ) -> str:
    """A run dir every rank of an externally launched job agrees on without talking; under Slurm the job's, which a
    requeued job keeps."""
    job = slurm_job(env)
    if job is not None:
        return os.path.join("outputs", "slurm", job)
    return os.path.join("outputs", "torchrun", env.get("TORCHELASTIC_RUN_ID") or "default")
