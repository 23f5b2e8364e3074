"""Time as the training device sees it: how long this rank's compute and its communication took *there*.

On a CPU the device is the CPU, and a mark is ``time.perf_counter()``. On CUDA the CPU only queues kernels: a
step's forward and backward return long before the GPU has run them, and NCCL's collectives run on streams of their
own, so the CPU's clock sees launch times (a slow GPU shows up as everyone's wait in the step's one drain, not as
its own compute). There a mark is a CUDA event recorded on the current stream, and the seconds between two marks are
read once the later one has completed on the GPU. The trainer reads a step's compute after the step's own drain
(its ``loss.item()``), so reading it costs no extra host synchronization; communication is read from NCCL's own
per-collective events (``TORCH_NCCL_ENABLE_TIMING``) when a collective has completed, a step later at the latest
(``distributed.comm.Communicator.take``).

:meth:`Clock.sleep_on_device` keeps the device busy without holding the CPU (``straggler=device``: a slow GPU). On
the CPU there is no such device, so the sleep is simulated: it is added to every later mark of this clock and
nothing else waits for it, which is what relaxed sync's measure sees of a slow GPU, and no more.
"""

from __future__ import annotations

import time
from typing import Any

import torch

Mark = Any  # a float (seconds, CPU) or a torch.cuda.Event (CUDA)


class Clock:
    """The CPU's clock, with the device's simulated sleeps added."""

    on_device = False  # whether marks are device events (read after the device reached them)

    def __init__(self) -> None:
        self.simulated_s = 0.0  # device sleeps so far (CPU: added to every mark)

    def mark(self) -> Mark:
        """Now, on the device's current stream."""
        return time.perf_counter() + self.simulated_s

    def seconds(self, start: Mark, end: Mark) -> float:
        """The time from ``start`` to ``end``; on a device, waits for ``end`` if the device has not reached it."""
        return end - start

    def sleep_on_device(self, seconds: float) -> None:
        """Keep the device busy ``seconds`` without holding the CPU (simulated here: see the module docstring)."""
        self.simulated_s += seconds


class CudaClock(Clock):
    """CUDA events on the current stream of the current device."""

    on_device = True

    def __init__(self) -> None:
        super().__init__()
        self._cycles_per_s: float | None = None

    def mark(self) -> Mark:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Mark, end: Mark) -> float:
        if not end.query():
            end.synchronize()  # (not in the trainer's order: it reads after the step's drain)
        return start.elapsed_time(end) / 1e3

    def sleep_on_device(self, seconds: float) -> None:
        if seconds > 0:
            torch.cuda._sleep(int(seconds * self.cycles_per_s()))

    def cycles_per_s(self) -> float:
        """The rate of ``torch.cuda._sleep``'s spin loop, measured once (clocks vary with the GPU and its state)."""
        if self._cycles_per_s is None:
            cycles = 50_000_000
            torch.cuda._sleep(cycles // 10)  # (warm the clock up)
            start, end = self.mark(), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(cycles)
            end.record()
            self._cycles_per_s = cycles / self.seconds(start, end)
        return self._cycles_per_s


def build_clock(device: torch.device) -> Clock:
    return CudaClock() if device.type == "cuda" else Clock()


def device_seconds(work: Any) -> float | None:
    """The time a completed NCCL collective took on the GPU (its start and end events on NCCL's stream, recorded
    under ``TORCH_NCCL_ENABLE_TIMING``), or None where there is none (gloo, timing off, not completed)."""
    try:
        if not work.is_completed():
            return None
        return work._get_duration() / 1e3
    except (RuntimeError, AttributeError):
        return None
