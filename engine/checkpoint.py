"""Checkpoints: written atomically, the last two kept, read back with ``weights_only=True``; :class:`Checkpointer`
is the policy.

``checkpoints/last.pt`` (written by the logging rank) holds the model (unwrapped), optimizer, AMP scaler, LR
schedule, the sync algorithm's shared state, the position (epoch, step, step within the epoch) and the resolved
config as a plain dict. Beside it, ``sync_rank<r>.pt`` holds rank r's own sync state (DGC residuals, local
momenta), written by that rank, tagged with the step so that a stale one is never mistaken for current.
``stop.json`` names the torchrun job (its rendezvous id) whose world a signal stopped at that checkpoint.

Each write replaces its file only once the new version is complete on disk, and keeps the version it replaces
as ``previous.pt`` (``sync_rank<r>.previous.pt``). A process killed while writing leaves the last checkpoint as
it was; a full disk is one error that says so; a checkpoint that cannot be read (truncated, corrupted) is named,
and ``trainer.resume=auto`` (and a restarted world) then resumes from the one before it.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

LAST = "last.pt"
PREVIOUS = "previous.pt"
STOP = "stop.json"


class CheckpointError(OSError):
    """A checkpoint that cannot be written or read; what was there before is intact. (An ``OSError``: never taken
    for a lost peer by ``trainer.on_failure=continue``.)"""


def previous_path(path: str) -> str:
    """Where the version that ``path`` replaced is kept: ``last.pt`` -> ``previous.pt``, ``x.pt`` ->
    ``x.previous.pt``."""
    directory, name = os.path.split(path)
    if name == LAST:
        return os.path.join(directory, PREVIOUS)
    stem, ext = os.path.splitext(name)
    return os.path.join(directory, f"{stem}.previous{ext}")


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def save_atomic(state: dict[str, Any], path: str, keep_previous: bool = False) -> None:
    """``torch.save`` ``state`` to ``path`` through :func:`write_atomic`."""
    write_atomic(path, lambda f: torch.save(state, f), keep_previous)


def write_atomic(path: str, write: Callable[[BinaryIO], None], keep_previous: bool = False) -> None:
    """``write(f)`` to a temporary file in the same directory, fsync, then rename over ``path``: a crash at any
    point leaves either the old file or the new one, never a torn one. With ``keep_previous`` the old one is first
    renamed to :func:`previous_path` (a crash between the two renames leaves it there, and no ``path``). A full
    disk raises :class:`CheckpointError`."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(path)[1], dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and os.path.exists(path):
            os.replace(path, previous_path(path))
        os.replace(tmp, path)
    except BaseException as error:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(directory).free
            raise CheckpointError(
                f"no space left to write {path} ({free / 2**20:.0f} MiB free in {directory}); the checkpoint "
                f"before it is intact: free space, then continue with trainer.resume=auto",
            ) from error
        raise


def load(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint file; one that cannot be read (truncated, corrupted, not a checkpoint) raises
    :class:`CheckpointError` naming it."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # torch raises RuntimeError, EOFError, UnpicklingError... by what is wrong
        raise CheckpointError(f"cannot read checkpoint {path} ({type(error).__name__}: {error})") from error


def resolve_resume(resume: str | None, run_dir: str) -> str | None:
    """``null`` -> None; ``auto`` -> the run dir's last checkpoint if there is one (its previous one if a crash
    came between the two renames of a write); otherwise the path."""
    if resume is None:
        return None
    if resume == "auto":
        for name in (LAST, PREVIOUS):
            path = os.path.join(checkpoint_dir(run_dir), name)
            if os.path.isfile(path):
                return path
        return None
    return resume


class Checkpointer:
    """When to checkpoint (every ``trainer.checkpoint_every`` epochs and ``checkpoint_every_steps`` steps, at the end,
    at a stop), what each rank writes, and what a resumed rank reads back."""

    def __init__(
        self, run_dir: str, rank: int, checkpoint_every: int, resume: str | None, every_steps: int = 0, config=None
    ):
        self.rank, self.every, self.every_steps, self.config = rank, checkpoint_every, every_steps, config
        self.path = os.path.join(checkpoint_dir(run_dir), LAST)
        # A world restarted by the elastic agent continues from the newest checkpoint of the run dir, whatever
        # trainer.resume said: after a failure (torchrun --max-restarts, trainer.max_restarts), and when the agents
        # stopped the world with SIGTERM to let a node join (--nnodes MIN:MAX; the restart count stays 0 then, but
        # the stop checkpoint names the job).
        # A requeued Slurm job (after a stop on a signal, preemption) is restarted the same way.
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or 0)
        self.job = os.environ.get("TORCHELASTIC_RUN_ID")
        self.stop_path = os.path.join(checkpoint_dir(run_dir), STOP)
        self.rejoined = resume is None and not self.restart and self.job is not None and self._stopped_job() == self.job
        self.auto = resume == "auto" or (resume is None and bool(self.restart or self.rejoined))
        self.resume_path = resolve_resume("auto" if self.auto else resume, run_dir)
        self.unreadable: str | None = None  # why the last checkpoint was passed over for the one before it
        if rank == 0:  # before any rank writes: what a write killed midway left
            for leftover in glob.glob(os.path.join(checkpoint_dir(run_dir), ".tmp-*")):
                os.unlink(leftover)

    def _stopped_job(self) -> str | None:
        if not os.path.isfile(self.stop_path):
            return None
        with open(self.stop_path) as f:
            return json.load(f).get("job")

    def due(self, epoch: int, finished_epoch: bool, last: bool, stop: bool) -> bool:
        """After epoch ``epoch`` (from 1): at the end of the run, when stopping early, and every
        ``checkpoint_every`` epochs."""
        return last or stop or bool(self.every and finished_epoch and epoch % self.every == 0)

    def due_between_steps(self, step: int, step_in_epoch: int, steps_per_epoch: int) -> bool:
        """After step ``step`` (steps completed), every ``checkpoint_every_steps``; at the end of an epoch the epoch's
        own checkpoint follows instead."""
        return bool(self.every_steps) and step % self.every_steps == 0 and step_in_epoch < steps_per_epoch

    def local_path(self, checkpoint_path: str) -> str:
        return os.path.join(os.path.dirname(checkpoint_path), f"sync_rank{self.rank}.pt")

    def save(self, state: dict[str, Any] | None, local: dict[str, Any], step: int, stopped_by: str | None) -> None:
        """Collective in effect: every rank writes its own ``local`` sync state (if any); the logging rank, the one
        passing ``state``, writes the checkpoint itself and, when a signal (``stopped_by``) stopped a torchrun
        world, which job it was."""
        if local:
            save_atomic({"sync": local, "step": step}, self.local_path(self.path), keep_previous=True)
        if state is not None:
            save_atomic(state, self.path, keep_previous=True)
            if stopped_by is not None and self.job is not None:
                marker = json.dumps({"job": self.job, "step": step, "signal": stopped_by}).encode()
                write_atomic(self.stop_path, lambda f: f.write(marker))

    def save_stateful(self, stateful: Any, local: dict[str, Any], step: int, stopped_by: str | None, writes: bool):
        """:meth:`save` of ``stateful.state_dict()`` (the trainer's; its ``loop`` part, the invocation's own, is left
        out) with the resolved config, written by the rank that ``writes`` (the logging rank); returns ``writes``."""
        state = None
        if writes:
            state = {**stateful.state_dict(), "config": self.config}
            state.pop("loop", None)
        self.save(state, local, step, stopped_by)
        return writes

    def load(self) -> dict[str, Any] | None:
        """The checkpoint to resume from, or None for a fresh run. Under ``trainer.resume=auto`` (and in a restarted
        world) a last checkpoint that cannot be read is named and the one before it is used; a path given to
        ``trainer.resume`` that cannot be read is an error that names the one before it, if there is one."""
        if not self.resume_path:
            return None
        try:
            return load(self.resume_path)
        except CheckpointError as error:
            before = previous_path(self.resume_path)
            if not os.path.isfile(before):
                raise
            if not self.auto:
                raise CheckpointError(f"{error}; the one before it: trainer.resume={before}") from error
            self.unreadable = str(error)  # said in the resume line and event
            self.resume_path = before
            return load(before)

    def load_local(self, step: int, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any] | None, str]:
        """This rank's own sync state saved with the checkpoint of ``step``, or None and why there is none (the
        rank was not in the run at that checkpoint, or the run had fewer ranks)."""
        path = self.local_path(self.resume_path)
        for candidate in (path, previous_path(path)):  # (a checkpoint's previous.pt: this rank's file was rotated)
            if os.path.isfile(candidate):
                own = load(candidate, map_location=map_location)
                if own["step"] == step:
                    return own["sync"], candidate
        if not os.path.isfile(path):
            return None, f"no {path}"
        return None, f"{path} is not from step {step}, the checkpoint's"

    def restore_sync(self, sync: Any, state: dict[str, Any], device: torch.device) -> None:
        """The sync algorithm's shared state from the checkpoint ``state``, and this rank's own if it saved one."""
        sync.load_state_dict(state["sync"])
        own, where = self.load_local(state["step"], device)
        if own is not None:
            sync.load_local_state_dict(own)
        elif sync.local_state_dict():
            print(f"relaxsync: rank {self.rank}: {where}; {sync.name}'s own state starts fresh", flush=True)

    def resumed(self, before: int | None, world_size: int, run: Any, epochs: int) -> tuple[dict[str, Any], str]:
        """The ``resume`` event and the console line of a run of ``world_size`` ranks resumed at ``run`` (an
        ``engine.state.RunState``) from a checkpoint written by ``before`` ranks (None: as many)."""
        path, restart, before = self.resume_path, self.restart, before or world_size
        event = {"event": "resume", "path": path, "restart": restart, "world_size_before": before}
        passed_over = f" ({self.unreadable}; it is the one before it)" if self.unreadable else ""
        if self.unreadable:
            event["unreadable"] = self.unreadable
        after = f" in torchrun job {self.job} after its stop" if self.rejoined else ""
        after = after or (f" after restart {restart}" if restart else "")
        grown = f", {before} -> {world_size} ranks" if before != world_size else ""
        where = f"step {run.step} (epoch {run.epoch + 1} of {epochs}{grown})"
        return event, f"relaxsync: resumed{after} from {where} of {path}{passed_over}"

    def finished(self, run: Any, epochs: int) -> str:
        """The line of a run resumed from a checkpoint at its end (``run``, an ``engine.state.RunState``)."""
        top1 = f"; final top-1 {run.last_eval['top1']:.2f}%" if run.last_eval else ""
        where = f"step {run.step}, epoch {run.last_epoch} of {epochs}"
        return f"relaxsync: already finished: {self.resume_path} is at {where}{top1}; nothing to train"
