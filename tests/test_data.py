"""Datasets: digits (real, bundled), synthetic, and ImageNet-layout folders read by real workers."""

from __future__ import annotations

import torch
from conftest import FAST, records, train

from data.common import build_data
from data.digits import build as build_digits
from data.imagefolder import build as build_imagefolder


def test_digits_split_is_fixed_and_shaped_for_imagenet_models():
    a, b = build_digits(image_size=32), build_digits(image_size=32)
    assert (len(a.train), len(a.val)) == (1438, 359)
    x, y = a.train[0]
    assert x.shape == (3, 32, 32) and 0 <= int(y) < 10
    assert torch.equal(a.val.tensors[0], b.val.tensors[0])  # same split every time
    assert sorted(set(a.train.tensors[1].tolist())) == list(range(10))
    assert abs(float(a.train.tensors[0].mean())) < 1e-4  # normalized over the training split


def test_synthetic_is_deterministic_per_index():
    d = build_data({"_target_": "data.synthetic.build", "num_samples": 8, "image_size": 16, "batch_size": 4})
    x1, y1 = d.train[3]
    x2, y2 = d.train[3]
    assert torch.equal(x1, x2) and y1 == y2 and x1.shape == (3, 16, 16)
    assert not torch.equal(d.train[3][0], d.train[4][0])


def test_imagefolder_reads_real_images(digits_imagefolder):
    bundle = build_imagefolder(str(digits_imagefolder), image_size=32)
    assert bundle.num_classes == 10 and len(bundle.train) == 120 and len(bundle.val) == 40
    x, y = bundle.val[0]
    assert x.shape == (3, 32, 32) and y == 0


def test_imagefolder_trains_with_two_workers(tmp_path, digits_imagefolder):
    summary, metrics = train(
        tmp_path,
        *FAST,
        "data=imagefolder",
        f"data.root={digits_imagefolder}",
        "data.image_size=32",
        "data.num_workers=0",
        "data.batch_size=8",
        "trainer.nproc=2",
        "trainer.epochs=1",
    )
    assert len(records(metrics, "train")) == 120 // 2 // 8
    assert records(metrics, "eval")[-1]["num_samples"] == 40
