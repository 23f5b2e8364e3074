"""ImageNet-layout folders (``<root>/<split>/<class>/<image>``): every file ImageNet holds, decoded by the loader's
workers or, batched, on the GPU (``data.decode``), with timm's standard augmentation: a random-resized crop and a
flip (and a colour jitter when ``color_jitter`` is set) for training; a resize by ``crop_pct`` and a centre crop for
evaluation. Batches reach the model normalized by ImageNet's mean and std, as timm's prefetcher does.

**Decoding on the workers** (``data.decode=cpu``): each worker reads a file, decodes it (``data.images.decode``:
torchvision's libjpeg-turbo, Pillow for what it cannot read), crops, resizes and flips it as uint8 tensors; the
device normalizes the batch (``data.prefetch``).

**Decoding on the GPU** (``data.decode=gpu``, and ``auto`` on CUDA): a worker reads each file's bytes and draws its
crop box and flip from the JPEG's header (the same draws as above, from the same per-sample generator); the files the
GPU does not take (``data.images.jpeg_info``: CMYK, grayscale, progressive, a PNG under a JPEG's name...) it decodes
and augments itself, as above. In the training process, a thread (:class:`FileStage`, run by
``data.prefetch.PrefetchLoader``) decodes each batch's JPEGs with torchvision's batched nvJPEG call on the loaders'
side stream, crops, resizes and flips each on the GPU, places the worker-decoded ones beside them and normalizes the
batch into the model's memory format, one batch ahead of the step.

*The nvJPEG ordering hazard.* torchvision allocates the decoded images on the caller's stream and decodes on a
stream of its own, which does not wait for the caller's: on Hopper GPUs the hardware JPEG engine then writes into
memory that work still queued on the caller's stream (the previous batch's crops) reads, as the caching allocator
hands freed blocks back at once. :meth:`FileStage.decode` drains the side stream before each decode; the training
stream waits for the side stream before it takes a batch (and ``record_stream`` keeps the batch's memory from
being reused before the step is done with it): ordered both ways.

**Unreadable files** (``data.on_bad_file``): a file no decoder reads (truncated, corrupt) stops the run with an
error that names it (``error``), or (``skip``) its place in a training batch is taken by a copy of another image of
the batch (steps keep their batch size) and it leaves an evaluation's; each skipped file is a ``file_skipped``
event, and evaluations and the summary count them (``skipped_files``).
"""

from __future__ import annotations

import os
import threading
from typing import Any, NamedTuple

import torch
from torchvision.datasets import ImageFolder

from data import images
from data.common import DataBundle
from errors import is_number, require

DECODES = ("auto", "cpu", "gpu")
ON_BAD_FILE = ("error", "skip")


def validate(section: dict, cfg: dict, world_size: int) -> None:
    root = section["root"]
    require(
        isinstance(root, str) and os.path.isdir(root),
        "data.root",
        root,
        "an existing directory in ImageNet layout (<root>/train/<class>/...)",
    )
    for key in ("train_split", "val_split"):
        path = os.path.join(root, section[key])
        require(os.path.isdir(path), f"data.{key}", section[key], f"a sub-directory of data.root (no {path})")
    crop = section["crop_pct"]
    require(is_number(crop) and 0 < crop <= 1, "data.crop_pct", crop, "a number in (0, 1]")
    jitter = section["color_jitter"]
    require(
        jitter is None or (is_number(jitter) and jitter >= 0),
        "data.color_jitter",
        jitter,
        "null or a number >= 0 (brightness, contrast and saturation factor; 0 or null: off)",
    )
    decode = section["decode"]
    require(decode in DECODES, "data.decode", decode, "one of auto (gpu on CUDA, else cpu), cpu, gpu")
    if decode == "gpu":
        device = cfg["trainer"]["device"]
        require(
            device == "cuda" or (device == "auto" and torch.cuda.is_available()),
            "data.decode",
            decode,
            f"auto or cpu: trainer.device={device} trains on the CPU, and gpu decodes on the training GPU",
        )
        require(
            not jitter,
            "data.decode",
            decode,
            f"auto or cpu with data.color_jitter={jitter}: the colour jitter runs on the CPU decode only",
        )
    policy = section["on_bad_file"]
    require(policy in ON_BAD_FILE, "data.on_bad_file", policy, "error (stop, naming the file) or skip (count it)")


class EncodedSample(NamedTuple):
    """A JPEG for the GPU: its bytes, and (training) the crop box and flip drawn for it."""

    data: torch.Tensor
    label: int
    index: int
    box: tuple[int, int, int, int] | None
    flip: bool


class SkippedSample(NamedTuple):
    """A file no decoder read (``data.on_bad_file=skip``)."""

    path: str
    why: str
    label: int


class FileBatch:
    """A collated batch of image files, as a worker hands it over: labels; the images decoded by the worker (uint8,
    ``pixels``, at positions ``pixel_slots`` of the batch); the JPEGs left to the device (their bytes concatenated in
    ``encoded`` at ``offsets``, at positions ``encoded_slots``, dataset indices ``encoded_indices``, and for
    training ``boxes`` (top, left, height, width) and ``flips``); the files skipped, ``(path, why)``."""

    def __init__(self, labels, pixels, pixel_slots, encoded, offsets, encoded_slots, encoded_indices, boxes, flips,
                 skipped):  # fmt: skip
        self.labels, self.pixels, self.pixel_slots = labels, pixels, pixel_slots
        self.encoded, self.offsets, self.encoded_slots, self.encoded_indices = (
            encoded,
            offsets,
            encoded_slots,
            encoded_indices,
        )  # noqa: E501
        self.boxes, self.flips, self.skipped = boxes, flips, skipped

    def __len__(self) -> int:
        return len(self.labels)

    def pin_memory(self) -> FileBatch:
        """(The DataLoader's pinning thread: the pixels and labels, copied to the device asynchronously; the JPEGs'
        bytes are read by nvJPEG on the host.)"""
        self.labels, self.pixels = self.labels.pin_memory(), self.pixels.pin_memory()
        return self

    def jpegs(self) -> list[torch.Tensor]:
        """Each JPEG's bytes (views of ``encoded``)."""
        bounds = self.offsets.tolist()
        return [self.encoded[a:b] for a, b in zip(bounds, bounds[1:])]


class FileCollate:
    """Samples of :class:`ImageFiles` to a :class:`FileBatch`. A skipped sample's place in a training batch is
    taken by the batch's first readable sample (every step keeps its batch size); in an evaluation batch it is left
    out."""

    def __init__(self, train: bool, size: int):
        self.train, self.size = train, size

    def __call__(self, samples: list[Any]) -> FileBatch:
        skipped = [(s.path, s.why) for s in samples if isinstance(s, SkippedSample)]
        readable = [s for s in samples if not isinstance(s, SkippedSample)]
        if skipped and not readable and self.train:
            files = ", ".join(path for path, _ in skipped)
            raise images.UnreadableImage(f"no file of a training batch is readable: {files}")
        if self.train:
            samples = [readable[0] if isinstance(s, SkippedSample) else s for s in samples]
        else:
            samples = readable
        decoded = [(slot, s) for slot, s in enumerate(samples) if not isinstance(s, EncodedSample)]
        encoded = [(slot, s) for slot, s in enumerate(samples) if isinstance(s, EncodedSample)]
        pixels = (
            torch.stack([s[0] for _, s in decoded])
            if decoded
            else torch.empty((0, 3, self.size, self.size), dtype=torch.uint8)
        )
        lengths = [len(s.data) for _, s in encoded]
        offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
        return FileBatch(
            labels=torch.tensor([int(s[1]) for s in samples], dtype=torch.int64),
            pixels=pixels,
            pixel_slots=torch.tensor([slot for slot, _ in decoded], dtype=torch.int64),
            encoded=torch.cat([s.data for _, s in encoded]) if encoded else torch.empty(0, dtype=torch.uint8),
            offsets=offsets,
            encoded_slots=torch.tensor([slot for slot, _ in encoded], dtype=torch.int64),
            encoded_indices=torch.tensor([s.index for _, s in encoded], dtype=torch.int64),
            boxes=torch.tensor([s.box for _, s in encoded] if self.train and encoded else [], dtype=torch.int64),
            flips=torch.tensor([s.flip for _, s in encoded], dtype=torch.bool),
            skipped=skipped,
        )


class ImageFiles(ImageFolder):
    """One split of an ImageNet-layout folder (torchvision's ImageFolder: its classes, files and extensions).

    A sample is ``(uint8 CHW image, label)``, decoded and augmented here; with ``encoded`` set (decoding on the
    device) a JPEG the GPU takes is an :class:`EncodedSample` instead; with ``on_bad_file=skip`` an unreadable file is
    a :class:`SkippedSample`. Items are indices, or for training ``(index, seed, epoch)`` (``data.common.TrainSampler``
    with ``keyed``): the augmentation of a sample depends on those three alone (``data.images.sample_rng``); a bare
    index draws as epoch 0 of seed 0.
    """

    def __init__(self, root: str, train: bool, image_size: int, crop_pct: float, color_jitter: float | None,
                 on_bad_file: str = "error"):  # fmt: skip
        super().__init__(root)
        self.train, self.size, self.crop_pct = train, image_size, crop_pct
        self.color_jitter, self.on_bad_file = color_jitter or None, on_bad_file
        self.encoded = False  # set by the loaders where the device decodes (before the workers start)
        self.collate_fn = FileCollate(train, image_size)

    def __getitem__(self, item: int | tuple[int, int, int]) -> Any:
        index, seed, epoch = item if isinstance(item, tuple) else (item, 0, 0)
        path, label = self.samples[index]
        rng = images.sample_rng(seed, epoch, index) if self.train else None
        try:
            data = images.read_bytes(path)
            if self.encoded:
                info = images.jpeg_info(data)
                if info is not None and info.gpu:
                    box, flip = images.draw_train_view(rng, info.height, info.width) if self.train else (None, False)
                    return EncodedSample(data, label, index, box, flip)
            image = images.decode(data, path)
        except OSError as error:  # (UnreadableImage, or the file itself: gone, no permission)
            if self.on_bad_file == "error":
                raise images.UnreadableImage(
                    f"data: cannot read {error if isinstance(error, images.UnreadableImage) else f'{path}: {error}'}"
                    " (data.on_bad_file=skip skips such files and counts them)"
                ) from None
            return SkippedSample(path, str(error).removeprefix(f"{path}: "), label)
        if not self.train:
            return images.eval_view(image, self.size, self.crop_pct), label
        box, flip = images.draw_train_view(rng, image.shape[-2], image.shape[-1])
        view = images.train_view(image, box, flip, self.size)
        if self.color_jitter:
            view = images.jitter(view, rng, self.color_jitter)
        return view, label

    def stage(self, transfer: Any) -> FileStage:
        """What turns this split's batches into the model's input on ``transfer``'s device."""
        return FileStage(self, transfer)


class FileStage:
    """A :class:`FileBatch` to ``(x, y)`` on the device of ``transfer`` (a ``data.prefetch.DeviceTransfer``):
    float32, normalized, in its memory format. Issued on the current stream (the loaders' side stream, from their
    thread); the JPEGs are decoded with torchvision's batched ``decode_jpeg`` where the batch is (on the GPU: nvJPEG;
    on the CPU, in tests: libjpeg-turbo, the same call), each then cropped, resized and flipped as the workers do
    (``data.images``) but in float. A JPEG nvJPEG refuses is decoded on the CPU here (it names a file no decoder
    reads). Files skipped here are added to the batch's ``skipped``.

    One batch at a time: two threads may stage on the same stream for a moment (a loader rebuilt for a new world
    while the old one's thread finishes its batch), and between a drain and its decode no other work may be queued
    there."""

    def __init__(self, dataset: ImageFiles, transfer: Any):
        self.dataset, self.transfer = dataset, transfer
        self.lock = threading.Lock()

    def drain(self) -> None:
        """Wait for the work queued on the current stream (the nvJPEG ordering hazard: see the module's doc)."""
        if self.transfer.device.type == "cuda":
            torch.cuda.current_stream(self.transfer.device).synchronize()

    def decode(self, jpegs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The JPEGs decoded, RGB uint8 CHW, on the device: one batched call, after :meth:`drain`."""
        from torchvision.io import ImageReadMode, decode_jpeg

        self.drain()
        return decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=self.transfer.device)

    def decode_each(self, batch: FileBatch, jpegs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """After a batched decode failed: each JPEG on the CPU (None for a file skipped), moved to the device."""
        out: list[torch.Tensor | None] = []
        for data, index in zip(jpegs, batch.encoded_indices.tolist()):
            path, label = self.dataset.samples[index]
            try:
                out.append(images.decode(data, path).to(self.transfer.device))
            except images.UnreadableImage as error:
                if self.dataset.on_bad_file == "error":
                    raise images.UnreadableImage(
                        f"data: cannot read {error} (data.on_bad_file=skip skips such files and counts them)"
                    ) from None
                batch.skipped.append((path, str(error).removeprefix(f"{path}: ")))
                out.append(None)
        return out

    def __call__(self, batch: FileBatch) -> tuple[torch.Tensor, torch.Tensor]:
        with self.lock:
            return self._stage(batch)

    def _stage(self, batch: FileBatch) -> tuple[torch.Tensor, torch.Tensor]:
        transfer, device = self.transfer, self.transfer.device
        if not len(batch.encoded_slots):  # (every image decoded by the workers: in slot order)
            return transfer(batch.pixels, batch.labels)
        jpegs = batch.jpegs()
        try:
            decoded: list[torch.Tensor | None] = list(self.decode(jpegs))
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # (nvJPEG refused one: find which, on the CPU)
            decoded = self.decode_each(batch, jpegs)
        size, ds = self.dataset.size, self.dataset
        views: list[torch.Tensor | None] = [None] * len(batch)
        boxes = batch.boxes.tolist()
        for i, (slot, image) in enumerate(zip(batch.encoded_slots.tolist(), decoded)):
            if image is None:
                continue
            if ds.train:  # (the flips after, for the whole batch at once)
                views[slot] = images.train_view(image, boxes[i], False, size, as_float=True)
            else:
                views[slot] = images.eval_view(image.float(), size, ds.crop_pct)
        if len(batch.pixel_slots):  # (the workers' images: cropped, resized and flipped already)
            pixels = batch.pixels.to(device, non_blocking=True).float()
            for j, slot in enumerate(batch.pixel_slots.tolist()):
                views[slot] = pixels[j]
        keep = [slot for slot, view in enumerate(views) if view is not None]
        if not keep:
            raise images.UnreadableImage("no file of a batch is readable")
        if ds.train:  # (a skipped file's place: the first readable image's, as the workers fill them)
            x = torch.stack([view if view is not None else views[keep[0]] for view in views])
            if batch.flips.any():
                flips = torch.zeros(len(batch), dtype=torch.bool)
                flips[batch.encoded_slots] = batch.flips
                x = torch.where(flips.to(device, non_blocking=True).view(-1, 1, 1, 1), x.flip(-1), x)
        else:
            x = torch.stack([views[slot] for slot in keep])
            if len(keep) < len(batch):
                batch.labels = batch.labels[keep]
        return transfer(x, batch.labels)


def build(
    root: str,
    train_split: str = "train",
    val_split: str = "val",
    image_size: int = 224,
    crop_pct: float = 0.875,
    color_jitter: float | None = None,
    decode: str = "auto",
    on_bad_file: str = "error",
) -> DataBundle:
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    splits = (
        ImageFiles(os.path.join(root, split), train, image_size, crop_pct, color_jitter, on_bad_file)
        for split, train in ((train_split, True), (val_split, False))
    )
    train, val = splits
    if train.classes != val.classes:
        raise ValueError(f"data.root={root!r}: train and val have different class folders")
    return DataBundle(
        train,
        val,
        num_classes=len(train.classes),
        image_size=image_size,
        mean=tuple(IMAGENET_DEFAULT_MEAN),
        std=tuple(IMAGENET_DEFAULT_STD),
        uint8=True,
        decode="cpu" if color_jitter and decode == "auto" else decode,  # (the jitter runs on the CPU decode only)
    )
