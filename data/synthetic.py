"""Random images and labels of any shape, generated per index from a fixed seed (no I/O, no memory for the
whole set): for throughput measurements.

``dtype: float32`` draws standard-normal pixels (torch); ``dtype: uint8`` draws uniform bytes (numpy's PCG64, ~3x
faster than torch's generator for a 224-px image: workers keep pace with a GPU) that the loaders normalize on the
device by the uniform distribution's mean and standard deviation, as an image dataset's pixels."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import Dataset

from data.common import DataBundle
from errors import is_int, require

DTYPES = ("float32", "uint8")
UNIFORM_MEAN, UNIFORM_STD = 0.5, math.sqrt((256**2 - 1) / 12) / 255  # of uniform bytes 0..255, scaled to [0, 1]


def validate(section: dict, cfg: dict, world_size: int) -> None:
    for key, low in (
        ("num_samples", 1),
        ("num_val_samples", 1),
        ("image_size", 1),
        ("channels", 1),
        ("num_classes", 2),
    ):
        require(is_int(section[key]) and section[key] >= low, f"data.{key}", section[key], f"an integer >= {low}")
    require(section["dtype"] in DTYPES, "data.dtype", section["dtype"], f"one of {', '.join(DTYPES)}")


class SyntheticImages(Dataset):
    def __init__(
        self, num_samples: int, image_size: int, channels: int, num_classes: int, seed: int, dtype: str = "float32"
    ):
        self.num_samples, self.shape = num_samples, (channels, image_size, image_size)
        self.num_classes, self.seed, self.dtype = num_classes, seed, dtype

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        if self.dtype == "uint8":
            rng = np.random.default_rng(self.seed * 1_000_003 + index)
            pixels = rng.integers(0, 256, self.shape, dtype=np.uint8)
            return torch.from_numpy(pixels), int(rng.integers(self.num_classes))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return torch.randn(self.shape, generator=g), int(torch.randint(self.num_classes, (), generator=g))


def build(
    num_samples: int = 1024,
    num_val_samples: int = 256,
    image_size: int = 32,
    channels: int = 3,
    num_classes: int = 10,
    dtype: str = "float32",
) -> DataBundle:
    uint8 = dtype == "uint8"
    return DataBundle(
        SyntheticImages(num_samples, image_size, channels, num_classes, seed=1, dtype=dtype),
        SyntheticImages(num_val_samples, image_size, channels, num_classes, seed=2, dtype=dtype),
        num_classes=num_classes,
        image_size=image_size,
        channels=channels,
        mean=(UNIFORM_MEAN,) * channels if uint8 else None,
        std=(UNIFORM_STD,) * channels if uint8 else None,
        uint8=uint8,
    )
