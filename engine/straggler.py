"""Simulated stragglers: make chosen ranks slow, for any sync algorithm.

The delay is a sleep before the forward pass, so it is part of the slow rank's own compute time, as a slower
GPU or a busier host would be. ``straggler=sleep`` sleeps on the CPU (a busy host: the process itself is slow);
``straggler=device`` keeps the training device busy instead (a throttled GPU: the CPU queues the step at full
speed, and only the device's own clock, ``distributed/clock.py``, sees the slowdown). On a CPU the device sleep is
simulated on that clock (nothing waits for it).
"""

from __future__ import annotations

import time
from typing import Any

from distributed.clock import Clock
from errors import is_int, is_number, require


class NoStraggler:
    """``straggler=none``."""

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        pass

    def delay(self, epoch: int, rank: int, world_size: int, clock: Clock | None = None) -> float:
        """Sleep if this rank is slowed now (``clock``: the device's, for a device sleep); return the seconds slept."""
        return 0.0

    def observe(self, compute_s: float) -> None:
        """This rank's compute time of the last step, without any simulated delay."""


class SleepStraggler(NoStraggler):
    """``straggler=sleep``: ranks in ``ranks`` (default: the last; ``all``: every rank, one that joins later too, as
    device time each step spends with the cores free) sleep from epoch ``start_epoch`` on (from 1), either
    ``(slowdown - 1)`` times their normal compute time or a fixed ``sleep_s``, so a slowed step takes
    ``slowdown`` times as long as a normal one.

    "Normal" is the mean compute time of the steps before the slowdown started (of the first slowed steps,
    without the sleep, when it starts at epoch 1), frozen then. When processes share CPU cores, a slowed rank
    computes faster than normal while the others wait for it; the sleep makes up for that (it is
    ``slowdown x normal`` minus the compute time of the previous slowed step), so the slowed rank's own step
    time is ``slowdown x normal`` either way.
    """

    def __init__(
        self,
        ranks: list[int] | str | None = None,
        start_epoch: int = 2,
        slowdown: float = 5.0,
        sleep_s: float | None = None,
    ):
        self.ranks, self.start_epoch, self.slowdown, self.sleep_s = ranks, start_epoch, slowdown, sleep_s
        self._normal: list[float] = []  # compute times of normal steps
        self._slowed_now = False
        self._last_slowed: float | None = None  # compute time (without the sleep) of the last slowed step

    @classmethod
    def validate(cls, section: dict[str, Any], cfg: dict[str, Any], world_size: int) -> None:
        ranks = section["ranks"]
        require(
            ranks is None
            or ranks == "all"
            or (isinstance(ranks, list) and bool(ranks) and all(is_int(r) and 0 <= r < world_size for r in ranks)),
            "straggler.ranks",
            ranks,
            f"null, all, or a non-empty list of ranks in [0, {world_size - 1}]",
        )
        e, f, s = section["start_epoch"], section["slowdown"], section["sleep_s"]
        require(is_int(e) and e >= 1, "straggler.start_epoch", e, "an epoch >= 1 (epochs count from 1)")
        require(is_number(f) and f >= 1, "straggler.slowdown", f, "a factor >= 1")
        require(s is None or (is_number(s) and s >= 0), "straggler.sleep_s", s, "null or seconds >= 0")

    def slowed(self, epoch: int, rank: int, world_size: int) -> bool:
        ranks = self.ranks if self.ranks is not None else [world_size - 1]
        return (ranks == "all" or rank in ranks) and epoch >= self.start_epoch

    def delay(self, epoch: int, rank: int, world_size: int, clock: Clock | None = None) -> float:
        self._slowed_now = self.slowed(epoch, rank, world_size)
        if not self._slowed_now:
            return 0.0
        if self.sleep_s is not None:
            seconds = self.sleep_s
        else:
            recent = self._normal[-50:]
            normal = sum(recent) / len(recent) if recent else 0.0
            actual = self._last_slowed if self._last_slowed is not None else normal
            seconds = max(0.0, self.slowdown * normal - actual)
        self.sleep(seconds, clock)
        return seconds

    def sleep(self, seconds: float, clock: Clock | None) -> None:
        time.sleep(seconds)

    def observe(self, compute_s: float) -> None:
        if self._slowed_now:
            self._last_slowed = compute_s
        if not self._slowed_now or len(self._normal) < 5:
            self._normal.append(compute_s)


class DeviceStraggler(SleepStraggler):
    """``straggler=device``: as ``straggler=sleep``, but the slowed ranks' *device* sleeps (``torch.cuda._sleep`` on
    the compute stream before the forward), so the CPU is not slowed at all: a throttled GPU. Only a measure taken on
    the device sees it."""

    def sleep(self, seconds: float, clock: Clock | None) -> None:
        if clock is None:
            raise ValueError("straggler=device needs the training device's clock")
        clock.sleep_on_device(seconds)
