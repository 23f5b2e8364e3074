"""What every dataset builder returns, and the samplers and loaders built on it."""

from __future__ import annotations

import collections
import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from data.prefetch import DeviceTransfer, PrefetchLoader

# Keys of conf/data/*.yaml that configure loaders rather than the dataset (validated by the engine).
LOADER_KEYS = ("_target_", "batch_size", "num_workers")
CPU = torch.device("cpu")


@dataclass
class DataBundle:
    """A dataset's two splits and what the loaders need to know of their samples: ``(image, label)`` pairs, the
    image CHW. With ``uint8``, images are uint8 pixels (0-255) that the loaders normalize on the device by ``mean``
    and ``std`` (per channel, of pixels scaled to [0, 1]); without, float images already normalized.

    ``decode`` (image files, ``data.imagefolder``): where they are decoded, ``auto`` (on the device where it is a
    GPU), ``cpu`` (by the loaders' workers) or ``gpu``; such datasets collate with their ``collate_fn``, take
    ``(index, seed, epoch)`` items for training (their augmentation drawn per sample) and give the loaders a
    ``stage(transfer)`` that makes a batch the model's input."""

    train: Dataset
    val: Dataset
    num_classes: int
    image_size: int
    channels: int = 3
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    uint8: bool = False
    decode: str | None = None

    def __post_init__(self) -> None:
        if self.uint8:
            assert self.mean is not None and self.std is not None, "uint8 images need the mean and std to normalize"
            assert len(self.mean) == len(self.std) == self.channels, (self.mean, self.std, self.channels)


def build_data(cfg_data: dict[str, Any]) -> DataBundle:
    module_name, fn_name = cfg_data["_target_"].rsplit(".", 1)
    fn = getattr(importlib.import_module(module_name), fn_name)
    return fn(**{k: v for k, v in cfg_data.items() if k not in LOADER_KEYS})


class ShardSampler(Sampler[int]):
    """Rank ``index`` of ``num_shards`` gets indices ``index, index + num_shards, ...``: no padding, so every
    sample is evaluated exactly once over all ranks (DistributedSampler pads with repeats)."""

    def __init__(self, length: int, num_shards: int, index: int):
        self.indices = list(range(index, length, num_shards))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class TrainSampler(Sampler[int]):
    """Shuffled shards that partition the dataset: every sample is in exactly one rank's shard (no padding
    duplicates, unlike DistributedSampler). The permutation depends only on ``seed`` and the epoch, so the
    shards of any number of ranks interleave the same order: rank ``i`` of ``n`` gets ``perm[i::n]``.

    Shards differ in length by at most one; the trainer runs the same number of full batches on every rank
    (:func:`steps_per_epoch`). ``skip`` starts part-way through an epoch (resume from a mid-epoch checkpoint): the
    samples any number of ranks consumed in ``s`` full steps are a prefix of the permutation, so skipping that prefix
    and sharding the rest continues the epoch exactly, at the same world size or another one.

    With ``keyed``, it yields ``(index, seed, epoch)``: what a dataset that draws each sample's augmentation from its
    own generator (``data.images.sample_rng``) draws it from, so that a sample's crop does not depend on the ranks,
    the workers or a resume.
    """

    def __init__(self, length: int, num_replicas: int, rank: int, seed: int, keyed: bool = False):
        self.length, self.num_replicas, self.rank, self.seed, self.keyed = length, num_replicas, rank, seed, keyed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, num_samples: int) -> None:
        """Skip the first ``num_samples`` of the epoch's permutation (all ranks' together) in the next epoch only."""
        self.start = num_samples

    def shard(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=g)[self.start :][self.rank :: self.num_replicas].tolist()

    def __iter__(self) -> Iterator[int] | Iterator[tuple[int, int, int]]:
        indices = self.shard()
        self.start = 0
        if self.keyed:
            return iter([(i, self.seed, self.epoch) for i in indices])
        return iter(indices)

    def __len__(self) -> int:
        return len(range(self.rank, self.length - self.start, self.num_replicas))


def auto_num_workers(environ: Mapping[str, str] = os.environ, affinity: int | None = None) -> int:
    """``data.num_workers: auto``: the CPUs this process may use, less one for the process itself, at least 1.

    Under Slurm the CPUs are the task's (``SLURM_CPUS_PER_TASK``), all this process's when srun started it as the
    task, else shared by the processes a launcher started in the task (torchrun's or ``train.py``'s local launch:
    ``LOCAL_WORLD_SIZE``). Elsewhere they are the CPUs this process may run on (``affinity``, by default
    ``len(os.sched_getaffinity(0))``), shared by the processes of this node (``LOCAL_WORLD_SIZE``).
    """
    local = int(environ.get("LOCAL_WORLD_SIZE", 1))
    if environ.get("SLURM_CPUS_PER_TASK"):
        shared_by = 1 if environ.get("RELAXSYNC_LAUNCHER") == "srun" else local
        cpus = int(environ["SLURM_CPUS_PER_TASK"]) // shared_by
    else:
        cpus = (len(os.sched_getaffinity(0)) if affinity is None else affinity) // local
    return max(1, cpus - 1)


def resolve_num_workers(num_workers: int | str) -> int:
    """``data.num_workers`` as a count: an integer as it is, ``auto`` by :func:`auto_num_workers`."""
    return auto_num_workers() if num_workers == "auto" else int(num_workers)


def loader_options(device: torch.device, num_workers: int) -> dict[str, Any]:
    """The ``DataLoader`` options both loaders take on ``device``: pinned batches for a CUDA device (the copy to it
    runs asynchronously from pinned memory only); workers that live as long as the loader (a new pool would start
    at every epoch, and the validation loader's at every evaluation); and per worker enough batches ahead that the
    pool holds about 8 (at least torch's 2 each): a slow batch (a large JPEG) does not stall the device, and the
    shared memory held stays bounded (8 batches of 256 uint8 224-px images are 300 MB)."""
    options: dict[str, Any] = {"num_workers": num_workers, "pin_memory": torch.device(device).type == "cuda"}
    if num_workers > 0:
        options.update(persistent_workers=True, prefetch_factor=max(2, -(-8 // num_workers)))
    return options


def train_loader(
    dataset: Dataset,
    batch_size: int,
    num_workers: int,
    num_replicas: int,
    rank: int,
    seed: int,
    device: torch.device = CPU,
) -> DataLoader:
    """The training loader: shuffled shards (:class:`TrainSampler`, keyed for a dataset of image files), full
    batches, collated by the dataset's ``collate_fn`` if it has one."""
    keyed = hasattr(dataset, "collate_fn")
    sampler = TrainSampler(len(dataset), num_replicas=num_replicas, rank=rank, seed=seed, keyed=keyed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,  # every step has a full batch on every rank
        collate_fn=getattr(dataset, "collate_fn", default_collate),
        **loader_options(device, num_workers),
    )


def val_loader(
    dataset: Dataset,
    batch_size: int,
    num_workers: int,
    num_replicas: int,
    rank: int,
    device: torch.device = CPU,
) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=ShardSampler(len(dataset), num_replicas, rank),
        drop_last=False,
        collate_fn=getattr(dataset, "collate_fn", default_collate),
        **loader_options(device, num_workers),
    )


def steps_per_epoch(num_train: int, num_replicas: int, batch_size: int) -> int:
    """Optimizer steps per epoch, the same on every rank: full batches of the smallest shard."""
    return (num_train // num_replicas) // batch_size


def resumed_step_in_epoch(num_train: int, consumed: int, num_replicas: int, batch_size: int) -> int:
    """Where a world of ``num_replicas`` ranks stands in an epoch of which ``consumed`` samples (a prefix of the
    permutation) were trained on, possibly by a world of another size: the steps it has left are the full batches of
    the smallest shard of the rest, and it is that many steps short of its :func:`steps_per_epoch`."""
    left = ((num_train - consumed) // num_replicas) // batch_size
    return steps_per_epoch(num_train, num_replicas, batch_size) - left


class Loaders:
    """The training and validation loaders of one rank, sharded over the active ranks. Iterating either yields
    ``(x, y)`` on ``device``: ``x`` float32 NCHW, normalized, channels_last in memory when ``channels_last``; ``y``
    int64 labels (``data.prefetch``). ``num_workers`` is a count or ``auto`` (:func:`auto_num_workers`).

    Batches are collated by torch's ``default_collate``, which keeps uint8 images uint8 (as timm's ``fast_collate``
    does) and, in a worker, stacks them straight into shared memory: measured faster than ``fast_collate``, whose
    batch is copied there again on its way to this process.

    Image files (``DataBundle.decode``) are decoded on the device when ``decode`` (by default the bundle's) is
    ``gpu``, or ``auto`` on a CUDA device: their datasets then hand JPEGs over undecoded, and a thread of this
    process decodes each batch (the datasets' ``stage``) one batch ahead. ``decode=gpu`` on a CPU device runs the
    same code on the CPU (what the tests exercise). :meth:`take_skipped` returns the files skipped so far.
    """

    def __init__(
        self,
        data: DataBundle,
        batch_size: int,
        num_workers: int | str,
        seed: int,
        device: torch.device = CPU,
        channels_last: bool = False,
        decode: str | None = None,
    ):
        self.data, self.batch_size, self.seed, self.device = data, batch_size, seed, torch.device(device)
        self.num_workers = resolve_num_workers(num_workers)
        # Training's and validation's own (each its own side stream: a decoding thread of each may stage at once, an
        # evaluation on the side while the training loader waits, and the nvJPEG drain orders one stream's work)
        made = (DeviceTransfer(self.device, data.mean, data.std, data.uint8, channels_last) for _ in range(2))
        self.transfers = dict(zip(("train", "val"), made))
        self.transfer = self.transfers["train"]
        decode = decode or data.decode
        self.on_device = decode == "gpu" or (decode == "auto" and self.device.type == "cuda")
        self.stages: dict[str, Callable[[Any], tuple[torch.Tensor, torch.Tensor]] | None] = {}
        for name in ("train", "val"):
            dataset = getattr(data, name)
            if hasattr(dataset, "encoded"):
                dataset.encoded = self.on_device  # (before any worker starts: they take the dataset as it is)
            self.stages[name] = dataset.stage(self.transfers[name]) if hasattr(dataset, "stage") else None
        self.skipped: collections.deque[tuple[str, str]] = collections.deque()  # (appended to by the threads)
        self.skipped_taken = 0
        self.train: PrefetchLoader | None = None
        self.val: PrefetchLoader | None = None
        self.steps_per_epoch = 0

    def _prefetch(self, loader: DataLoader, name: str) -> PrefetchLoader:
        transfer, stage = self.transfers[name], self.stages[name]
        return PrefetchLoader(loader, transfer, stage, self.skipped, threaded=self.on_device)

    def build(self, num_replicas: int, rank: int, train: bool = True) -> None:
        """Shard the validation set (and, if ``train``, the training set) over ``num_replicas`` ranks."""
        workers, device = self.num_workers, self.device
        if train:
            loader = train_loader(self.data.train, self.batch_size, workers, num_replicas, rank, self.seed, device)
            self.train = self._prefetch(loader, "train")
            self.steps_per_epoch = steps_per_epoch(len(self.data.train), num_replicas, self.batch_size)
        loader = val_loader(self.data.val, self.batch_size, workers, num_replicas, rank, device)
        self.val = self._prefetch(loader, "val")

    def start_epoch(self, epoch: int, skip: int = 0) -> None:
        """The training permutation of epoch ``epoch``, without its first ``skip`` samples (trained on already)."""
        self.train.sampler.set_epoch(epoch)
        if skip:
            self.train.sampler.skip(skip)

    def take_skipped(self) -> list[tuple[str, str]]:
        """The files skipped (``data.on_bad_file=skip``) since the last call: ``(path, why)`` each."""
        taken = []
        while self.skipped:
            taken.append(self.skipped.popleft())
        self.skipped_taken += len(taken)
        return taken

    def skipped_count(self) -> int:
        """The files this rank's loaders skipped so far, taken or not."""
        return self.skipped_taken + len(self.skipped)

    def example_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``batch_size`` copies of the first training sample and its label, ready as the loaders yield a batch (on
        the device, float32, normalized, in their memory format): for a pass whose result is thrown away (a warm-up).
        Draws from the random generators the training transforms draw from; needs no :meth:`build`."""
        sample, stage = self.data.train[0], self.stages["train"]
        if stage is not None:
            return stage(self.data.train.collate_fn([sample] * batch_size))
        x, y = torch.as_tensor(sample[0]), torch.full((batch_size,), int(sample[1]))
        return self.transfer(x.unsqueeze(0).expand(batch_size, *x.shape).contiguous(), y)
