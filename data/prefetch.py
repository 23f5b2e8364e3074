"""Batches as the model takes them: on the device, float32, normalized, in its memory format, the next one on its way
while the current one trains (timm's ``PrefetchLoader`` and NVIDIA DeepLearningExamples' ``PrefetchedWrapper``).

Datasets whose samples are uint8 images (``DataBundle.uint8``) send a quarter of the bytes through the workers,
shared memory and the host-to-device copy, and are normalized on the device by :class:`DeviceTransfer`; float
datasets (already normalized) are only moved and laid out. On CUDA the copy of batch ``k + 1`` (non-blocking, from
pinned memory) and its normalization run on a side stream while the compute stream works on batch ``k``; the compute
stream waits for the side stream before it takes a batch, and ``record_stream`` keeps the caching allocator from
handing the batch's memory to the side stream again before the compute stream is done with it. On the CPU the same
code runs without streams.

timm's own ``PrefetchLoader`` does not fit as it is: it normalizes every batch as uint8 pixels (a float dataset would
be normalized twice), has no memory-format option, and guards the memory with a wait on the compute stream per batch
instead of ``record_stream``.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils.data import DataLoader


class DeviceTransfer:
    """One batch to ``device``: float32, normalized when its pixels are uint8 (``(x - 255 mean) / (255 std)`` per
    channel, timm's arithmetic), channels_last when asked. Holds the side stream of a split's loaders of one
    ``data.common.Loaders`` (the caching allocator pools memory per stream: one stream, whatever the rebuilds)."""

    def __init__(
        self,
        device: torch.device,
        mean: tuple[float, ...] | None,
        std: tuple[float, ...] | None,
        uint8: bool,
        channels_last: bool,
    ):
        self.device, self.uint8, self.channels_last = torch.device(device), uint8, channels_last
        self.mean, self.std = mean, std
        self.scale: tuple[torch.Tensor, torch.Tensor] | None = None  # (255 mean, 255 std) on the device, made once
        self.stream: Any = None  # the side stream on CUDA, made once

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def side_stream(self) -> Any:
        if self.stream is None and self.on_cuda:
            self.stream = torch.cuda.Stream(device=self.device)
        return self.stream

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` on the device, ready; issued on the current stream."""
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        if self.channels_last:  # (before the conversion to float: a quarter of the bytes to move for uint8)
            x = x.contiguous(memory_format=torch.channels_last)
        if not self.uint8:
            return x.float(), y
        if self.scale is None:
            shape = (1, len(self.mean), 1, 1)
            self.scale = tuple(
                torch.tensor([255.0 * v for v in values], device=self.device).view(shape)
                for values in (self.mean, self.std)
            )
        mean, std = self.scale
        return x.float().sub_(mean).div_(std), y  # (float() keeps the memory format; the in-place ops too)


class PrefetchLoader:
    """A ``DataLoader`` whose batches arrive through ``stage`` (by default :class:`DeviceTransfer` of ``(x, y)``),
    one batch ahead. ``sampler``, ``dataset``, ``batch_size`` and ``len()`` are the loader's; ``loader`` is the
    loader itself. Files a batch skipped (its ``skipped``) are appended to ``skipped``.

    ``threaded`` (a stage that decodes, ``data.imagefolder.FileStage``): the stage runs in a thread of its own, on
    the side stream, while this thread trains (the decode blocks the host it runs on, and on a GPU the trainer's
    thread waits for every step's end): one batch ready ahead of the one training, the thread at work on the next;
    the batches come with an event the compute stream waits for. Without, the stage is issued from the trainer's
    thread before the batch before it is handed over.
    """

    AHEAD = 1  # batches a thread holds ready ahead of the one training (besides the one it stages)

    def __init__(
        self,
        loader: DataLoader,
        transfer: DeviceTransfer,
        stage: Callable[[Any], tuple[torch.Tensor, torch.Tensor]] | None = None,
        skipped: Any = None,
        threaded: bool = False,
    ):
        self.loader, self.transfer = loader, transfer
        self.stage = stage or (lambda batch: transfer(*batch))
        self.skipped = skipped if skipped is not None else collections.deque()
        self.threaded = threaded

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def _staged(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.stage(batch)
        self.skipped.extend(getattr(batch, "skipped", ()))
        return out

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        transfer, stream = self.transfer, self.transfer.side_stream()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(transfer.device))  # (what was queued before: the scale)
        if self.threaded:
            yield from self._from_thread(stream)
            return
        on_side = (lambda: torch.cuda.stream(stream)) if stream is not None else nullcontext

        def issue(batch: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
            if batch is None:
                return None
            with on_side():
                return self._staged(batch)

        batches = iter(self.loader)
        ahead = issue(next(batches, None))
        while ahead is not None:
            x, y = ahead
            if stream is not None:
                current = torch.cuda.current_stream(transfer.device)
                current.wait_stream(stream)  # (before the next batch is queued there: this batch's work only)
                x.record_stream(current)
                y.record_stream(current)
            ahead = issue(next(batches, None))
            yield x, y

    def _from_thread(self, stream: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        device, ready, stop = self.transfer.device, queue.Queue(maxsize=self.AHEAD), threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    pass
            return False

        def work() -> None:
            try:
                if stream is not None and device.index is not None:
                    torch.cuda.set_device(device)  # (a new thread starts on the first GPU)
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    for batch in self.loader:
                        x, y = self._staged(batch)
                        event = None
                        if stream is not None:
                            event = torch.cuda.Event()
                            event.record(stream)
                        if not put((x, y, event)):
                            return
                put(None)
            except BaseException as error:  # (handed to the trainer's thread, which raises it)
                put(_Failed(error))

        thread = threading.Thread(target=work, name="relaxsync-stage", daemon=True)
        thread.start()
        try:
            while True:
                item = ready.get()
                if item is None:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                x, y, event = item
                if event is not None:
                    current = torch.cuda.current_stream(device)
                    current.wait_event(event)  # (the batch's decode and crops, and nothing queued after them)
                    x.record_stream(current)
                    y.record_stream(current)
                yield x, y
        finally:  # (the epoch ended, or the trainer stopped taking batches: the thread stops too)
            stop.set()
            thread.join()


class _Failed:
    """An exception raised in the staging thread, on its way to the trainer's."""

    def __init__(self, error: BaseException):
        self.error = error
