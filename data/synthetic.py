"""Random images and labels of any shape, generated per index from a fixed seed (no I/O, no memory for the
whole set): for throughput measurements."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from data.common import DataBundle
from errors import is_int, require


def validate(section: dict, cfg: dict, world_size: int) -> None:
    for key, low in (
        ("num_samples", 1),
        ("num_val_samples", 1),
        ("image_size", 1),
        ("channels", 1),
        ("num_classes", 2),
    ):
        require(is_int(section[key]) and section[key] >= low, f"data.{key}", section[key], f"an integer >= {low}")


class SyntheticImages(Dataset):
    def __init__(self, num_samples: int, image_size: int, channels: int, num_classes: int, seed: int):
        self.num_samples, self.shape = num_samples, (channels, image_size, image_size)
        self.num_classes, self.seed = num_classes, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randn(self.shape, generator=g), int(torch.randint(self.num_classes, (), generator=g))


def build(
    num_samples: int = 1024, num_val_samples: int = 256, image_size: int = 32, channels: int = 3, num_classes: int = 10
) -> DataBundle:
    return DataBundle(
        SyntheticImages(num_samples, image_size, channels, num_classes, seed=1),
        SyntheticImages(num_val_samples, image_size, channels, num_classes, seed=2),
        num_classes=num_classes,
        image_size=image_size,
        channels=channels,
    )
