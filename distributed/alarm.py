"""Waits on collectives that a peer's loss, seen elsewhere, cuts short.

A dead peer fails a collective at once only on the ranks that exchange with it. In gloo's ring a rank exchanges with
its two neighbours: with four ranks or more, a rank not beside the lost one waits on neighbours that are alive, which
gave the collective up when it failed on them and now wait for it in the agreement. Nothing fails on that rank
until the group's deadline (``trainer.hang_timeout_s``), and until then nobody goes on. The same holds for a rank
waiting on a bucket or a round that only some peers reached.

So a rank that sees a collective fail tells the others through the store (it checks in to the failure, which the
heartbeat thread of every rank watches: ``engine/elastic``), and each rank's :class:`Alarm` then wakes every wait
of that generation with :class:`PeerLost`: the rank enters the agreement at once, as if its own collective had
failed. What it was waiting for is abandoned where it is; the group it was issued on is replaced. On NCCL a wait
polls the GPU's work, and the membership aborts the group's communicator, which ends the wait the same way.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any

import torch


class PeerLost(RuntimeError):
    """A wait given up because another rank saw a peer lost (a ``RuntimeError``, as a failed collective is)."""


class Alarm:
    """Rung once per generation of the membership (by the heartbeat thread); wakes that generation's waits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rung: dict[int, str] = {}  # generation -> why
        self._waiting: dict[int, set[Any]] = {}  # generation -> wake-ups: threading.Event or a relayed Future

    def rung(self, generation: int) -> str | None:
        """Why the alarm of ``generation`` rang, or None while it has not."""
        return self._rung.get(generation)

    def ring(self, generation: int, why: str) -> bool:
        """Wake every wait of ``generation``, and fail any started from now on; False if it rang already."""
        with self._lock:
            if generation in self._rung:
                return False
            self._rung[generation] = why
            waiting = self._waiting.pop(generation, set())
        for wake in waiting:
            if isinstance(wake, threading.Event):
                wake.set()
            else:
                _settle(wake, error=PeerLost(why))
        return True

    def check(self, generation: int) -> None:
        """Raise :class:`PeerLost` if the alarm of ``generation`` rang."""
        why = self._rung.get(generation)
        if why is not None:
            raise PeerLost(why)

    def _watch(self, generation: int, wake: Any) -> bool:
        with self._lock:
            if generation in self._rung:
                return False
            self._waiting.setdefault(generation, set()).add(wake)
            return True

    def _unwatch(self, generation: int, wake: Any) -> None:
        with self._lock:
            self._waiting.get(generation, set()).discard(wake)

    def wait(self, works: list[Any], generation: int, deadline: datetime.timedelta | None) -> None:
        """Wait for ``works`` (gloo's ``dist.Work``, issued in ``generation``) until each is done or one fails (its
        error is raised), passes ``deadline`` (the backend's timeout is), or the alarm of ``generation`` rings
        (:class:`PeerLost` is). A collective's work has a future, which wakes the wait when it completes; a
        point-to-point one has none and completes only inside its own ``wait()``, so those are waited for on a
        thread of their own, which is left behind (until the deadline) when the alarm rings."""
        futures = []
        for work in works:
            try:
                futures.append(work.get_future())
            except (RuntimeError, AttributeError):  # (gloo's sends and receives: "getFuture not implemented")
                futures.append(None)
        if all(f is not None for f in futures):
            for work, future in zip(works, futures):
                started = time.monotonic()
                self._wait_for(future, generation, deadline)
                if deadline is None:
                    work.wait()  # (done: raises its error, if any)
                else:  # (done, or the deadline has passed: the group's own timeout may be longer)
                    left = deadline.total_seconds() - (time.monotonic() - started)
                    work.wait(datetime.timedelta(seconds=max(left, 0.001)))
            return
        errors: list[BaseException] = []
        done = threading.Event()

        def wait_all() -> None:
            try:
                for work in works:
                    work.wait() if deadline is None else work.wait(deadline)
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                errors.append(error)
            done.set()

        if self._watch(generation, done):
            threading.Thread(target=wait_all, name="relaxsync-wait", daemon=True).start()
            done.wait()
            self._unwatch(generation, done)
        self.check(generation)
        if errors:
            raise errors[0]

    def _wait_for(self, future: torch.futures.Future, generation: int, deadline: datetime.timedelta | None) -> None:
        done = threading.Event()
        if self._watch(generation, done):
            future.add_done_callback(lambda _: done.set())
            done.wait(None if deadline is None else deadline.total_seconds())
            self._unwatch(generation, done)
        self.check(generation)

    def relay(self, future: torch.futures.Future, generation: int) -> torch.futures.Future:
        """A future with ``future``'s result or error, or :class:`PeerLost` when the alarm of ``generation`` rings
        first: for a wait that happens where no Python runs (DDP waits for its buckets' futures in C++)."""
        out: torch.futures.Future = torch.futures.Future()
        if not self._watch(generation, out):
            _settle(out, error=PeerLost(self._rung[generation]))
            return out

        def settle(done: torch.futures.Future) -> None:
            self._unwatch(generation, out)
            try:
                _settle(out, value=done.value())
            except Exception as error:  # (the collective's own failure)
                _settle(out, error=error)

        future.add_done_callback(settle)
        return out


_settling = threading.RLock()  # (completing a future runs its callbacks, which may settle another)


def _settle(future: torch.futures.Future, value: Any = None, error: BaseException | None = None) -> None:
    """Complete ``future`` unless it is complete already (the alarm and the collective may race to it)."""
    with _settling:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
