"""scikit-learn's digits: 1797 real 8x8 grayscale scans of handwritten digits (0-16), 10 classes, bundled
with scikit-learn (no download). Upsampled bilinearly to ``image_size`` and repeated to 3 channels so that
ImageNet models run on it unchanged; normalized to zero mean and unit variance over the training split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from data.common import DataBundle
from errors import is_int, is_number, require


def validate(section: dict, cfg: dict, world_size: int) -> None:
    size, fraction = section["image_size"], section["val_fraction"]
    require(is_int(size) and size >= 8, "data.image_size", size, "an integer >= 8 (pixels)")
    require(is_number(fraction) and 0 < fraction < 1, "data.val_fraction", fraction, "a number in (0, 1)")


def load_tensors(image_size: int = 32, val_fraction: float = 0.2, split_seed: int = 0):
    """Return ``(x_train, y_train, x_val, y_val)`` as float32 NCHW and int64 tensors."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # N,1,8,8 in [0, 1]
    y = torch.tensor(digits.target, dtype=torch.int64)
    if image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    x = x.repeat(1, 3, 1, 1)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(split_seed))
    num_val = round(len(y) * val_fraction)
    val_idx, train_idx = perm[:num_val], perm[num_val:]
    mean, std = x[train_idx].mean(), x[train_idx].std()
    x = (x - mean) / std
    return x[train_idx], y[train_idx], x[val_idx], y[val_idx]


def build(image_size: int = 32, val_fraction: float = 0.2, split_seed: int = 0) -> DataBundle:
    x_tr, y_tr, x_va, y_va = load_tensors(image_size, val_fraction, split_seed)
    return DataBundle(TensorDataset(x_tr, y_tr), TensorDataset(x_va, y_va), num_classes=10, image_size=image_size)
