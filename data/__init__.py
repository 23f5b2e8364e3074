"""Datasets: digits (bundled real data), synthetic, imagefolder (ImageNet layout), cifar10 (local)."""
