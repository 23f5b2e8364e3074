"""ImageNet-layout folders (``<root>/<split>/<class>/<image>``) read with torchvision's ImageFolder and
timm's standard transforms (random-resized crop + flip for training; resize by ``crop_pct`` + center crop
for evaluation)."""

from __future__ import annotations

import os

from torchvision.datasets import ImageFolder

from data.common import DataBundle
from errors import is_number, require


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


def build(
    root: str, train_split: str = "train", val_split: str = "val", image_size: int = 224, crop_pct: float = 0.875
) -> DataBundle:
    from timm.data import create_transform

    train = ImageFolder(os.path.join(root, train_split), transform=create_transform(image_size, is_training=True))
    val = ImageFolder(
        os.path.join(root, val_split), transform=create_transform(image_size, is_training=False, crop_pct=crop_pct)
    )
    if train.classes != val.classes:
        raise ValueError(f"data.root={root!r}: train and val have different class folders")
    return DataBundle(train, val, num_classes=len(train.classes), image_size=image_size)
