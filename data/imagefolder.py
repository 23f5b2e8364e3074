"""ImageNet-layout folders (``<root>/<split>/<class>/<image>``) read with torchvision's ImageFolder and
timm's standard transforms (random-resized crop + flip, and color jitter when ``color_jitter`` is set, for training;
resize by ``crop_pct`` + center crop for evaluation). Samples are uint8 CHW images: the loaders normalize them on the
device (``data.prefetch``), by ImageNet's mean and std, as timm does with its prefetcher."""

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
    jitter = section["color_jitter"]
    require(
        jitter is None or (is_number(jitter) and jitter >= 0),
        "data.color_jitter",
        jitter,
        "null or a number >= 0 (brightness, contrast and saturation factor; 0 or null: off)",
    )


def transforms(image_size: int, crop_pct: float, color_jitter: float | None):
    """timm's training and evaluation transforms, ending in uint8 CHW tensors (``use_prefetcher``)."""
    from timm.data import create_transform

    jitter = color_jitter or None  # (timm takes None as off; 0 would add a ColorJitter that does nothing)
    train = create_transform(image_size, is_training=True, color_jitter=jitter, use_prefetcher=True)
    val = create_transform(image_size, is_training=False, crop_pct=crop_pct, use_prefetcher=True)
    return train, val


def build(
    root: str,
    train_split: str = "train",
    val_split: str = "val",
    image_size: int = 224,
    crop_pct: float = 0.875,
    color_jitter: float | None = None,
) -> DataBundle:
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    train_tf, val_tf = transforms(image_size, crop_pct, color_jitter)
    train = ImageFolder(os.path.join(root, train_split), transform=train_tf)
    val = ImageFolder(os.path.join(root, val_split), transform=val_tf)
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
    )
