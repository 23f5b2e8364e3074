"""scikit-learn's digits: 1797 real 8x8 grayscale scans of handwritten digits (0-16), 10 classes, bundled
with scikit-learn (no download). Upsampled bilinearly to ``image_size`` and repeated to 3 channels so that
ImageNet models run on it unchanged; normalized to zero mean and unit variance over the training split.

Training augmentation (``data.rotate``, ``data.translate``, ``data.scale``; all 0 by default: none): each training
sample is seen through a random affine view (a rotation, a shift and a zoom, uniform in their ranges, the uncovered
border filled with the background), drawn from the sample's own generator for the run's seed and the epoch
(``data.images.sample_rng``): the same view on any number of ranks, with any number of loader workers, and after a
resume. Validation images are never augmented."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset, default_collate

from data.common import DataBundle
from data.images import sample_rng
from errors import is_int, is_number, require


def validate(section: dict, cfg: dict, world_size: int) -> None:
    size, fraction = section["image_size"], section["val_fraction"]
    require(is_int(size) and size >= 8, "data.image_size", size, "an integer >= 8 (pixels)")
    require(is_number(fraction) and 0 < fraction < 1, "data.val_fraction", fraction, "a number in (0, 1)")
    for key, high, allowed in (
        ("rotate", 180, "degrees in [0, 180]"),
        ("translate", 0.5, "a fraction of the side in [0, 0.5]"),
        ("scale", 0.9, "a fraction in [0, 0.9] (zoom uniform in 1 +/- scale)"),
    ):
        value = section.get(key, 0)
        require(is_number(value) and 0 <= value <= high, f"data.{key}", value, allowed)


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


class AffineViews(Dataset):
    """Training images seen through a random affine view each: keyed by ``(index, seed, epoch)`` (the loaders'
    ``TrainSampler`` keys the items of a dataset that has a ``collate_fn``), the view drawn from that sample's own
    generator; a bare index gives the image as it is. ``fill`` is the background's value (normalized)."""

    collate_fn = staticmethod(default_collate)

    def __init__(self, x: torch.Tensor, y: torch.Tensor, rotate: float, translate: float, scale: float, fill: float):
        self.x, self.y, self.fill = x, y, fill
        self.rotate, self.translate, self.scale = float(rotate), float(translate), float(scale)

    def __len__(self) -> int:
        return len(self.y)

    def theta(self, seed: int, epoch: int, index: int) -> torch.Tensor:
        """The 2x3 matrix ``F.affine_grid`` takes: output coordinates (in [-1, 1]) to where they sample the input."""
        rng = sample_rng(seed, epoch, index)
        angle = math.radians(rng.uniform(-self.rotate, self.rotate))
        zoom = rng.uniform(1 - self.scale, 1 + self.scale)
        shift = [2 * rng.uniform(-self.translate, self.translate) for _ in range(2)]  # ([-1, 1] spans the side)
        cos, sin = math.cos(angle) / zoom, math.sin(angle) / zoom
        return torch.tensor([[cos, -sin, shift[0]], [sin, cos, shift[1]]])

    def __getitem__(self, key: int | tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(key, tuple):
            return self.x[key], self.y[key]
        index, seed, epoch = key
        image = self.x[index].unsqueeze(0) - self.fill  # (the background 0: what grid_sample fills the border with)
        grid = F.affine_grid(self.theta(seed, epoch, index).unsqueeze(0), list(image.shape), align_corners=False)
        return F.grid_sample(image, grid, align_corners=False)[0] + self.fill, self.y[index]


def build(
    image_size: int = 32,
    val_fraction: float = 0.2,
    split_seed: int = 0,
    rotate: float = 0,
    translate: float = 0,
    scale: float = 0,
) -> DataBundle:
    x_tr, y_tr, x_va, y_va = load_tensors(image_size, val_fraction, split_seed)
    train: Dataset = TensorDataset(x_tr, y_tr)
    if rotate or translate or scale:
        train = AffineViews(x_tr, y_tr, rotate, translate, scale, fill=float(x_tr.amin()))
    return DataBundle(train, TensorDataset(x_va, y_va), num_classes=10, image_size=image_size)
