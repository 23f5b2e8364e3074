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

from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch
from torch.utils.data import DataLoader


class DeviceTransfer:
    """One batch to ``device``: float32, normalized when its pixels are uint8 (``(x - 255 mean) / (255 std)`` per
    channel, timm's arithmetic), channels_last when asked. Holds the side stream of every loader of one
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
    """A ``DataLoader`` whose batches arrive through :class:`DeviceTransfer`, one batch ahead. ``sampler``,
    ``dataset``, ``batch_size`` and ``len()`` are the loader's; ``loader`` is the loader itself."""

    def __init__(self, loader: DataLoader, transfer: DeviceTransfer):
        self.loader, self.transfer = loader, transfer

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

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        transfer, stream = self.transfer, self.transfer.side_stream()
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(transfer.device))  # (what was queued before: the scale)
        on_side = (lambda: torch.cuda.stream(stream)) if stream is not None else nullcontext

        def issue(batch: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
            if batch is None:
                return None
            with on_side():
                return transfer(*batch)

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
