"""A consistent stop on SIGTERM: every rank finishes the same step, the run checkpoints there, and exits 0.

SIGTERM is what torchrun's agent, Slurm's preemption and ``kill`` send. Ranks receive it at different moments,
so possibly in different steps, and some may receive none (only one node's agent was told). A step is never
abandoned half-way: the first rank to see the signal proposes a stop step a little ahead of its own through
the c10d store (:meth:`Membership.propose`: first writer wins), and a background thread on every rank looks
for that proposal every :data:`POLL_S` seconds (in a world of more than 17 ranks every ``N / 100`` s:
``look_period``), so a rank without a signal learns of it too. Every rank trains
up to the agreed step and stops there; the trainer then checkpoints (a collective, as at any checkpoint) and
the workers exit 0, within the agent's grace period (torchrun's is 30 s before it sends SIGKILL).

The margin covers the time a rank needs to learn of the proposal (two polls) in steps of the current length,
plus two steps for ranks that run ahead of others (gossip and local SGD do not move in lockstep).
"""

from __future__ import annotations

import math
import signal
from typing import Any

from distributed.membership import Membership, StoreLoop, look_period
from engine.launchers import EARLY_SIGNALS

POLL_S = 0.2


class StopRequest:
    """SIGTERM, turned into a step at which every rank stops. Armed while the training loop runs."""

    def __init__(self, membership: Membership, signum: int = signal.SIGTERM):
        self.membership, self.signum = membership, signum
        self.signalled = False  # this rank received the signal
        self.step: int | None = None  # the agreed stop step (optimizer steps completed), once known
        self._seen: int | None = None  # the step another rank proposed, found by the watcher thread
        self._previous: Any = None
        self._watcher: StoreLoop | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def arm(self) -> None:
        """Catch the signal and start watching the store (call from the main thread). One received while the
        worker started (``engine.launchers.catch_early_signals``) counts as received now."""
        self._previous = signal.signal(self.signum, self._on_signal)
        self.signalled = self.signalled or self.signum in EARLY_SIGNALS
        self._watcher = self.membership.every(POLL_S, self._look, "relaxsync-stop", spread=True).start()

    def disarm(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
            signal.signal(self.signum, self._previous)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = True  # acted on at the next step boundary; a second signal changes nothing

    def _look(self, store: Any) -> bool:
        """In the watcher thread: has another rank proposed a stop step?"""
        key = self.membership.key("stop")
        if store.check([key]):
            self._seen = int(store.get(key))
            return True
        return False

    def due(self, step: int, step_s: float) -> bool:
        """At a step boundary, ``step`` steps completed, the last taking ``step_s`` seconds: whether to stop now."""
        if self.step is None:
            if self.signalled:
                poll_s = look_period(POLL_S, len(self.membership.ranks))
                margin = 2 + math.ceil(2 * poll_s / max(step_s, 1e-3))
                self.step = int(self.membership.propose("stop", step + margin))
            elif self._seen is not None:
                self.step = self._seen
            else:
                return False
            if step > self.step:
                raise RuntimeError(
                    f"rank {self.membership.rank} is at step {step}, past the agreed stop step {self.step} "
                    f"({self.name}); the ranks cannot checkpoint the same step"
                )
            if self.membership.is_logging_rank:
                print(f"relaxsync: {self.name}: every rank stops after step {self.step}", flush=True)
        return self.reached(step)

    def reached(self, step: int) -> bool:
        """Whether a stop step is agreed and ``step`` (steps completed) has reached it."""
        return self.step is not None and step >= self.step

    def stopped_by(self, step: int) -> str | None:
        """The signal's name once the run, at ``step``, stopped on it; None otherwise."""
        return self.name if self.reached(step) else None
