"""One world per run dir: the world that trains in a run dir holds a lease on it (``run.lease``), renewed while it
runs, so that a second world started into the same dir (two launches of one command, a Slurm job whose tasks each
started local workers) stops at once with a clear error instead of writing every step and checkpoint twice.

The lease names its world (``engine.launchers.world_id``: the Slurm job, the torchrun job, the local launch), so
the same world coming back (an elastic restart, a requeued Slurm job) takes it over; a lease not renewed for
:data:`STALE_S`, or whose holder on this host has exited (``trainer.resume=auto`` right after a crash), is a dead
world's and is taken over too."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import Any

from engine.launchers import launcher_name

LEASE = "run.lease"
RENEW_S = 5.0
STALE_S = 30.0  # six renewals missed


def _host() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def _alive(held: dict[str, Any]) -> bool:
    """Whether the holder may still run: on another host, until its lease goes stale; on this one, while its
    process exists (a run resumed at once after a crash is not kept waiting)."""
    if held.get("host") != _host():
        return True
    try:
        os.kill(int(held["pid"]), 0)
        return True
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, KeyError):
        return True


class RunDirInUse(RuntimeError):
    """Another world trains in this run dir."""


class Lease:
    """The logging rank's hold on the run dir: :meth:`take` it before writing anything, :meth:`release` at the end."""

    def __init__(self, run_dir: str, world: str):
        self.path, self.world = os.path.join(run_dir, LEASE), world
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> dict[str, Any] | None:
        """The lease as written, with its age in seconds; None if there is none (or it cannot be read)."""
        try:
            with open(self.path) as f:
                lease = json.load(f)
            lease["age_s"] = time.time() - os.stat(self.path).st_mtime
            return lease
        except (OSError, ValueError):
            return None

    def take(self) -> None:
        """Hold the run dir for this world, or raise :class:`RunDirInUse` naming the world that holds it. Of two
        worlds that start together, the one that creates the lease first holds it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.close(fd)  # (ours: written in full below; the other world reads it once it is)
            held = None
        except FileExistsError:
            held = self._read_settled()
        if held is not None and held["world"] != self.world and held["age_s"] < STALE_S and _alive(held):
            run_dir = os.path.dirname(self.path)
            raise RunDirInUse(
                f"run dir {run_dir} is in use by another world ({held['world']}, {held['world_size']} ranks, "
                f"launched by {held['launcher']} on {held['host']}, pid {held['pid']}; its lease was renewed "
                f"{held['age_s']:.0f} s ago): two worlds would write every step and checkpoint twice. Give this "
                f"run another trainer.run_dir, or stop the other one"
            )
        self._write()
        self._thread = threading.Thread(target=self._renew, name="relaxsync-lease", daemon=True)
        self._thread.start()

    def _read_settled(self) -> dict[str, Any] | None:
        """The lease another world holds, once it has written it in full (an empty one is being written)."""
        for _ in range(20):
            held = self.holder()
            if held is not None:
                return held
            time.sleep(0.05)
        return None

    def _write(self) -> None:
        lease = {
            "world": self.world,
            "world_size": int(os.environ.get("WORLD_SIZE", 1)),
            "launcher": launcher_name(),
            "host": _host(),
            "pid": os.getpid(),
            "since": time.time(),
        }
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(lease, f)
        os.replace(tmp, self.path)

    def _renew(self) -> None:
        while not self._done.wait(RENEW_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """At the end of this world's run (a rank that leaves hands nothing on: the next logging rank renews)."""
        self._done.set()
        held = self.holder()
        if held is not None and held["world"] == self.world and held["pid"] == os.getpid():
            try:
                os.remove(self.path)
            except OSError:
                pass
