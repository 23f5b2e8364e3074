"""What every dataset builder returns, and the samplers and loaders built on it."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

# Keys of conf/data/*.yaml that configure loaders rather than the dataset (validated by the engine).
LOADER_KEYS = ("_target_", "batch_size", "num_workers")


@dataclass
class DataBundle:
    train: Dataset
    val: Dataset
    num_classes: int
    image_size: int
    channels: int = 3


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
    """

    def __init__(self, length: int, num_replicas: int, rank: int, seed: int):
        self.length, self.num_replicas, self.rank, self.seed = length, num_replicas, rank, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, num_samples: int) -> None:
        """Skip the first ``num_samples`` of the epoch's permutation (all ranks' together) in the next epoch only."""
        self.start = num_samples

    def shard(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=g)[self.start :][self.rank :: self.num_replicas].tolist()

    def __iter__(self) -> Iterator[int]:
        indices = self.shard()
        self.start = 0
        return iter(indices)

    def __len__(self) -> int:
        return len(range(self.rank, self.length - self.start, self.num_replicas))


def train_loader(
    dataset: Dataset, batch_size: int, num_workers: int, num_replicas: int, rank: int, seed: int
) -> DataLoader:
    sampler = TrainSampler(len(dataset), num_replicas=num_replicas, rank=rank, seed=seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        drop_last=True,  # every step has a full batch on every rank
        persistent_workers=num_workers > 0,
        pin_memory=torch.cuda.is_available(),
    )


def val_loader(dataset: Dataset, batch_size: int, num_workers: int, num_replicas: int, rank: int) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=ShardSampler(len(dataset), num_replicas, rank),
        num_workers=num_workers,
        drop_last=False,
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
    """The training and validation loaders of one rank, sharded over the active ranks."""

    def __init__(self, data: DataBundle, batch_size: int, num_workers: int, seed: int):
        self.data, self.batch_size, self.num_workers, self.seed = data, batch_size, num_workers, seed
        self.train: DataLoader | None = None
        self.val: DataLoader | None = None
        self.steps_per_epoch = 0

    def build(self, num_replicas: int, rank: int, train: bool = True) -> None:
        """Shard the validation set (and, if ``train``, the training set) over ``num_replicas`` ranks."""
        if train:
            self.train = train_loader(self.data.train, self.batch_size, self.num_workers, num_replicas, rank, self.seed)
            self.steps_per_epoch = steps_per_epoch(len(self.data.train), num_replicas, self.batch_size)
        self.val = val_loader(self.data.val, self.batch_size, self.num_workers, num_replicas, rank)

    def start_epoch(self, epoch: int, skip: int = 0) -> None:
        """The training permutation of epoch ``epoch``, without its first ``skip`` samples (trained on already)."""
        self.train.sampler.set_epoch(epoch)
        if skip:
            self.train.sampler.skip(skip)
