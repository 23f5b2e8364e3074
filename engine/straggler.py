"""Simulated stragglers: make chosen ranks slow, for any sync algorithm.

The delay is a sleep before the forward pass, so it is part of the slow rank's own compute time, as a slower
GPU or a busier host would be.
"""

from __future__ import annotations

import time
from typing import Any


class NoStraggler:
    """``straggler=none``."""

    @classmethod
    def validate(cls, cfg: dict[str, Any], world_size: int) -> None:
        pass

    def delay(self, epoch: int, rank: int, world_size: int) -> float:
        """Sleep if this rank is slowed now; return the seconds slept."""
        return 0.0

    def observe(self, compute_s: float) -> None:
        """This rank's compute time of the last step, without any simulated delay."""


class SleepStraggler(NoStraggler):
    """``straggler=sleep``: ranks in ``ranks`` (default: the last) sleep from ``start_epoch`` on, either
    ``(slowdown - 1)`` times their normal compute time (the mean of its recent steps without the sleep, so slow
    steps take ``slowdown`` times as long) or a fixed ``sleep_s``."""

    def __init__(
        self, ranks: list[int] | None = None, start_epoch: int = 10, slowdown: float = 3.0, sleep_s: float | None = None
    ):
        self.ranks, self.start_epoch, self.slowdown, self.sleep_s = ranks, start_epoch, slowdown, sleep_s
        self._normal: list[float] = []  # compute times without the simulated delay

    @classmethod
    def validate(cls, cfg: dict[str, Any], world_size: int) -> None:
        from engine.config import ConfigError

        ranks = cfg["ranks"]
        if ranks is not None and (
            not isinstance(ranks, list)
            or not ranks
            or any(not isinstance(r, int) or not 0 <= r < world_size for r in ranks)
        ):
            raise ConfigError("straggler.ranks", ranks, f"null or a non-empty list of ranks in [0, {world_size - 1}]")
        if not (isinstance(cfg["start_epoch"], int) and cfg["start_epoch"] >= 0):
            raise ConfigError("straggler.start_epoch", cfg["start_epoch"], "an epoch >= 0")
        if not (isinstance(cfg["slowdown"], (int, float)) and cfg["slowdown"] >= 1):
            raise ConfigError("straggler.slowdown", cfg["slowdown"], "a factor >= 1")
        if cfg["sleep_s"] is not None and not (isinstance(cfg["sleep_s"], (int, float)) and cfg["sleep_s"] >= 0):
            raise ConfigError("straggler.sleep_s", cfg["sleep_s"], "null or seconds >= 0")

    def slowed(self, epoch: int, rank: int, world_size: int) -> bool:
        ranks = self.ranks if self.ranks is not None else [world_size - 1]
        return rank in ranks and epoch >= self.start_epoch

    def delay(self, epoch: int, rank: int, world_size: int) -> float:
        if not self.slowed(epoch, rank, world_size):
            return 0.0
        if self.sleep_s is not None:
            seconds = self.sleep_s
        else:
            recent = self._normal[-50:]
            seconds = (self.slowdown - 1.0) * (sum(recent) / len(recent)) if recent else 0.0
        time.sleep(seconds)
        return seconds

    def observe(self, compute_s: float) -> None:
        self._normal.append(compute_s)
