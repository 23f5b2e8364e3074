"""Checkpoints: written atomically by the logging rank, read back with ``weights_only=True``.

A checkpoint holds the model (unwrapped), optimizer, AMP scaler, LR schedule, sync-algorithm state, the
position (epoch, step, step within the epoch) and the resolved config as a plain dict.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

LAST = "last.pt"


def checkpoint_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def save_atomic(state: dict[str, Any], path: str) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over ``path``: a crash at any
    point leaves either the old file or the new one, never a torn one."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    return torch.load(path, map_location=map_location, weights_only=True)


def resolve_resume(resume: str | None, run_dir: str) -> str | None:
    """``null`` -> None; ``auto`` -> the run dir's last checkpoint if there is one; otherwise the path."""
    if resume is None:
        return None
    if resume == "auto":
        path = os.path.join(checkpoint_dir(run_dir), LAST)
        return path if os.path.isfile(path) else None
    return resume
