"""CIFAR-10 through torchvision from a local copy (``<root>/cifar-10-batches-py``); never downloads."""

from __future__ import annotations

import os

from data.common import DataBundle
from errors import require


def validate(section: dict, cfg: dict, world_size: int) -> None:
    root = section["root"]
    require(
        isinstance(root, str) and os.path.isdir(os.path.join(root, "cifar-10-batches-py")),
        "data.root",
        root,
        "a directory containing cifar-10-batches-py (no download is attempted)",
    )


def build(root: str, image_size: int = 32) -> DataBundle:
    from torchvision import transforms
    from torchvision.datasets import CIFAR10

    norm = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    resize = [transforms.Resize(image_size)] if image_size != 32 else []
    train_tf = transforms.Compose(
        resize
        + [transforms.RandomCrop(image_size, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm]
    )
    val_tf = transforms.Compose(resize + [transforms.ToTensor(), norm])
    train = CIFAR10(root, train=True, transform=train_tf, download=False)
    val = CIFAR10(root, train=False, transform=val_tf, download=False)
    return DataBundle(train, val, num_classes=10, image_size=image_size)
