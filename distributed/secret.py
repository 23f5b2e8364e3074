"""The run's secret: what every rank of a run holds, and proves it holds before a connection it accepts, or makes,
is read as a peer's (``distributed/presence.py``). A stranger who can reach a rank's port, on a shared network,
cannot write to it what a peer writes.

Where it comes from, in order:

1. ``trainer.secret_file``: a file the user names (every node must be able to read it; kept to its owner: a file
   others may read is refused), for torchrun and srun on nodes that share no run directory;
2. else ``<run_dir>/.secret``: made once for the run, with mode 0600, by the local launcher before its workers
   start, or by whichever rank of torchrun's or srun's comes first (made aside and linked into place, so no rank
   reads half of it), and kept there for every restart, resume and join of the run.

The ranks check, through the run's store, that they hold the same secret (:func:`agree`: a fingerprint, an HMAC of
a fixed text, not the secret): nodes that do not share the run directory, each with a secret of its own, stop at
once with a message that says so.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from typing import Any

FILE = ".secret"
BYTES = 32


class SecretError(RuntimeError):
    """The run's secret cannot be read, or the ranks do not hold the same one."""


def read_secret(path: str) -> bytes:
    """The secret in ``path``: refused when others may read the file, or when it is shorter than 16 bytes."""
    info = os.stat(path)
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(
            f"{path}: the run's secret may be read by others (mode {stat.S_IMODE(info.st_mode):o}); chmod 600 {path}"
        )
    with open(path, "rb") as f:
        data = f.read().strip()
    if len(data) < 16:
        raise SecretError(f"{path}: a run's secret is at least 16 bytes ({len(data)} here)")
    return data


def make(run_dir: str) -> str:
    """The run directory's secret file, made now (mode 0600) unless it exists; its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, FILE)
    if os.path.exists(path):
        return path
    aside = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(BYTES) + "\n")
        try:
            os.link(aside, path)  # (fails if another rank's is there already: that one is the run's)
        except FileExistsError:
            pass
    finally:
        os.unlink(aside)
    return path


def run_secret(run_dir: str, secret_file: str | None = None) -> bytes:
    """This rank's copy of the run's secret (the module's doc says where it comes from)."""
    if secret_file:
        return read_secret(secret_file)
    return read_secret(make(run_dir))  # (there once make returns: this rank's, or the one linked before it)


def fingerprint(secret: bytes) -> str:
    """What the ranks compare (it tells nothing of the secret)."""
    return hmac.new(secret, b"relaxsync run secret", hashlib.sha256).hexdigest()[:32]


def agree(store: Any, key: str, secret: bytes, rank: int) -> None:
    """Check that this rank holds the secret the run's first rank to get here holds: a ``SecretError`` saying
    what to do if not."""
    mine = fingerprint(secret)
    held = store.compare_set(key, "", mine)
    held = held.decode() if isinstance(held, bytes) else held
    if held != mine:
        raise SecretError(
            f"rank {rank} holds another run secret than the ranks before it: its nodes do not share the run "
            "directory (trainer.run_dir), where the run's secret is made; set trainer.secret_file to a file every "
            "node reads (mode 0600; e.g. made with: openssl rand -hex 32 > ~/.relaxsync-secret; chmod 600 "
            "~/.relaxsync-secret)"
        )
