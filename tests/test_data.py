"""Datasets: digits (real, bundled), synthetic, and ImageNet-layout folders read by real workers."""

from __future__ import annotations

import math

import torch
from conftest import FAST, records, train

from data.common import build_data
from data.digits import AffineViews
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


def test_digits_augmentation_is_a_view_per_sample_seed_and_epoch():
    plain = build_digits(image_size=32)
    views = build_digits(image_size=32, rotate=30, translate=0.2, scale=0.2)
    assert isinstance(plain.train, torch.utils.data.TensorDataset)  # (all 0: no augmentation, no keyed items)
    x, y = views.train[(7, 0, 1)]
    assert x.shape == (3, 32, 32) and int(y) == int(plain.train[7][1])
    assert torch.equal(x, views.train[(7, 0, 1)][0])  # the same key, the same view: any rank, worker or resume
    assert not torch.equal(x, views.train[(7, 0, 2)][0]) and not torch.equal(x, views.train[(7, 1, 1)][0])
    assert not torch.equal(x, plain.train[7][0])
    assert torch.equal(views.train[7][0], plain.train[7][0])  # a bare index: the image as it is
    assert torch.equal(views.val.tensors[0], plain.val.tensors[0])  # validation is never augmented
    assert float(x.amin()) >= float(plain.train.tensors[0].amin()) - 1e-5  # the border: the background, no darker


def _spot(views: AffineViews, key: tuple[int, int, int]) -> torch.Tensor:
    """Where the brightest pixel of ``views``'s sample lands, in coordinates of [-1, 1] (pixel centres)."""
    image = views[key][0][0]
    row, col = divmod(int(image.argmax()), image.shape[1])
    return torch.tensor([(2 * col + 1) / image.shape[1] - 1, (2 * row + 1) / image.shape[0] - 1])


def test_digits_affine_view_moves_rotates_and_zooms_as_drawn():
    size = 64
    x = torch.zeros(1, 3, size, size)
    x[0, :, 40, 24] = 1.0  # one bright pixel off the centre: at (x, y) = (-0.234, 0.266)
    where = torch.tensor([(2 * 24 + 1) / size - 1, (2 * 40 + 1) / size - 1])
    y = torch.zeros(1, dtype=torch.int64)
    pixel = 2 / size
    for rotate, translate, scale in ((0, 0.2, 0), (90, 0, 0), (0, 0, 0.4), (45, 0.1, 0.3)):
        views = AffineViews(x, y, rotate, translate, scale, fill=0.0)
        for epoch in range(4):
            theta = views.theta(seed=3, epoch=epoch, index=0)
            # affine_grid samples the input at theta @ (output, 1): the spot lands where that reaches `where`
            expected = torch.linalg.solve(theta[:, :2], where - theta[:, 2])
            assert (_spot(views, (0, 3, epoch)) - expected).abs().max() <= 1.5 * pixel, (rotate, translate, scale)
            zoom = float(theta[:, :2].det()) ** -0.5  # (theta's linear part: a rotation over the zoom)
            assert 1 - scale - 1e-6 <= zoom <= 1 + scale + 1e-6
            assert (theta[:, 2].abs() <= 2 * translate + 1e-6).all()


def test_augmented_digits_train_through_the_keyed_loaders(tmp_path):
    run = ["trainer.nproc=2", "trainer.max_steps=3", "trainer.eval_every_steps=null", "trainer.target_top1=null"]
    summary, metrics = train(tmp_path, "experiment=tta_hard", "logger=none", "trainer.progress=false", *run)
    steps = records(metrics, "train")
    assert [r["step"] for r in steps] == [0, 1, 2] and all(math.isfinite(r["loss"]) for r in steps)


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
