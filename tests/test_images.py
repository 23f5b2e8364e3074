"""Image files on both decode paths (``data.decode``): which JPEGs the GPU takes and that every other file ImageNet
holds is taken by the workers; the device path's batching, crops, resizes, flips and ordering, run here on CPU
tensors (torchvision decodes JPEGs on the CPU with the same batched call); the same crops after a resume; unreadable
files stopping the run with their name, or skipped and counted. ``make test-gpu`` runs the device path on a GPU
(tests/test_gpu.py), against the CPU decode, with other work on the stream (the nvJPEG ordering hazard)."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch
from conftest import FAST, records, train
from PIL import Image

from bench.jpegs import image, save, write_tree
from data import images
from data.common import Loaders
from data.imagefolder import EncodedSample, FileBatch, FileStage, SkippedSample
from data.imagefolder import build as build_imagefolder

# The device path resizes floats and keeps them; the workers' path rounds two uint8 passes (each within 1.1 of the
# exact value: <= 0.5 per pass, fixed-point weights << 0.1): on the same decoded pixels (libjpeg-turbo both, here)
# the two differ by at most 1.1 levels of 255, and a level normalizes to at most 1 / (255 x 0.224) (ImageNet's
# smallest std).
DEVICE_VS_WORKERS = 1.1
PIXEL = 1 / (255 * 0.224)


@pytest.fixture(scope="module")
def odd_tree(tmp_path_factory):
    """32 train and 12 val files of mixed sizes around 120x90, with CMYK, grayscale, progressive and PNG among them."""
    root = tmp_path_factory.mktemp("odd") / "tree"
    kinds = write_tree(root, 32, 12, classes=3, size=(120, 90), jitter=24, odd_every=4)
    return root, kinds


def loaders(root, decode, batch=4, workers=0, seed=0, **kw):
    bundle = build_imagefolder(str(root), image_size=32, **kw)
    out = Loaders(bundle, batch, workers, seed=seed, decode=decode)
    out.build(1, 0)
    return out


def epoch(loaders_, number=1, skip=0):
    loaders_.start_epoch(number, skip)
    xs, ys = zip(*loaders_.train)
    return torch.cat(xs), torch.cat(ys)


def test_the_gpu_takes_baseline_ycbcr_jpegs_and_the_workers_the_rest(tmp_path):
    rng = np.random.default_rng(0)
    pixels = image(rng, 240, 320)
    kinds = {}
    for kind in ("rgb", "cmyk", "gray", "progressive", "png"):
        save(pixels, tmp_path / f"{kind}.JPEG", kind)
        kinds[kind] = images.jpeg_info(images.read_bytes(str(tmp_path / f"{kind}.JPEG")))
    assert kinds["rgb"] == images.JpegInfo(240, 320, True)
    assert (kinds["cmyk"].gpu, kinds["cmyk"].why) == (False, "CMYK")
    assert (kinds["gray"].gpu, kinds["gray"].why) == (False, "grayscale")
    assert (kinds["progressive"].gpu, kinds["progressive"].why) == (False, "progressive")
    assert kinds["png"] is None  # (not a JPEG, whatever its name)
    data = (tmp_path / "rgb.JPEG").read_bytes()
    cut = images.jpeg_info(data[: len(data) // 2])
    assert cut.height == 240 and not cut.gpu and "truncated" in cut.why
    assert images.jpeg_info(data + b"\x00\x00").gpu  # (zero padding after the end marker is harmless)


def test_every_odd_file_is_taken_and_the_device_path_matches_the_workers(odd_tree):
    """Both paths give every sample of an epoch; the device path's JPEGs went undecoded through the workers and the
    odd files decoded (each kind at least once); the two agree within the bound."""
    root, kinds = odd_tree
    assert set(kinds) == {"cmyk", "gray", "progressive", "png"}
    cpu, dev = loaders(root, "cpu"), loaders(root, "gpu")
    assert not cpu.data.train.encoded and dev.data.train.encoded
    x_cpu, y_cpu = epoch(cpu)
    x_dev, y_dev = epoch(dev)
    assert len(x_cpu) == len(x_dev) == 32 and torch.equal(y_cpu, y_dev)
    assert (x_cpu - x_dev).abs().max() <= DEVICE_VS_WORKERS * PIXEL
    ds = dev.data.train
    odd = {str(p) for paths in kinds.values() for p in paths if "train" in str(p)}
    taken = {ds.samples[i][0]: ds[i] for i in range(len(ds))}
    assert odd and all(not isinstance(taken[p], EncodedSample) for p in odd)
    assert all(isinstance(s, EncodedSample) for p, s in taken.items() if p not in odd)
    xv_cpu, _ = zip(*cpu.val)
    xv_dev, _ = zip(*dev.val)
    assert (torch.cat(xv_cpu) - torch.cat(xv_dev)).abs().max() <= DEVICE_VS_WORKERS * PIXEL


def test_the_device_path_crops_as_pillow_on_the_same_boxes(odd_tree):
    """The device path's training images (decode, the drawn box, float resize, flip) against Pillow's crop, bilinear
    resize and flip of the same file and box: within the resize bound (Pillow is the uint8 side)."""
    root, _ = odd_tree
    dev = loaders(root, "gpu", batch=8)
    ds, stage = dev.data.train, dev.stages["train"]
    items = [(i, 5, 2) for i in range(8)]
    x, y = stage(ds.collate_fn([ds[item] for item in items]))
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (dev.data.mean, dev.data.std))
    got = (x * std + mean) * 255
    for row, (i, seed, number) in enumerate(items):
        path, label = ds.samples[i]
        with Image.open(path) as im:
            im = im.convert("RGB")
            (top, left, h, w), flip = images.draw_train_view(images.sample_rng(seed, number, i), im.height, im.width)
            im = im.crop((left, top, left + w, top + h)).resize((32, 32), Image.BILINEAR)
            if flip:
                im = im.transpose(Image.FLIP_LEFT_RIGHT)
        ref = torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1).double()
        assert y[row] == label
        assert (got[row].double() - ref).abs().max() <= DEVICE_VS_WORKERS + 1e-3, path


def test_crops_depend_on_the_sample_alone_not_the_ranks_workers_or_a_resume(odd_tree):
    """An epoch resumed after 3 steps gives the uninterrupted epoch's last batches to the bit; two workers give one
    worker's batches; each of two ranks gets, sample for sample, the one-rank crops (device path too)."""
    root, _ = odd_tree
    for decode in ("cpu", "gpu"):
        whole_x, whole_y = epoch(loaders(root, decode), number=2)
        x, y = epoch(loaders(root, decode), number=2, skip=3 * 4)
        assert torch.equal(x, whole_x[12:]) and torch.equal(y, whole_y[12:])
        x, y = epoch(loaders(root, decode, workers=2), number=2)
        assert torch.equal(x, whole_x) and torch.equal(y, whole_y)
        order = loaders(root, decode).train.sampler
        order.set_epoch(2)
        where = {index: row for row, index in enumerate(order.shard())}
        for rank in (0, 1):
            two = loaders(root, decode)
            two.build(2, rank)
            x, _ = epoch(two, number=2)
            shard = two.train.sampler.shard()[: len(x)]
            assert torch.equal(x, whole_x[[where[i] for i in shard]])


def test_the_stage_drains_the_stream_before_each_decode_and_the_thread_keeps_the_order(odd_tree, monkeypatch):
    """Each batched decode is preceded by a drain of the stream it is issued on (on the CPU a no-op, recorded here);
    the staging thread hands the batches over in the sampler's order, and stops when the trainer stops taking them."""
    root, _ = odd_tree
    calls: list[str] = []
    real_drain, real_decode = FileStage.drain, FileStage.decode
    monkeypatch.setattr(FileStage, "drain", lambda self: (calls.append("drain"), real_drain(self))[1])

    def decode(self, jpegs):
        calls.append("decode")
        return real_decode(self, jpegs)

    monkeypatch.setattr(FileStage, "decode", decode)
    from torchvision import io as tvio

    real_tv = tvio.decode_jpeg
    monkeypatch.setattr(tvio, "decode_jpeg", lambda *a, **k: (calls.append("nvjpeg"), real_tv(*a, **k))[1])
    dev = loaders(root, "gpu")
    assert dev.train.threaded
    x, y = epoch(dev)
    assert calls and calls[:3] == ["decode", "drain", "nvjpeg"]
    assert all(calls[i - 1] == "drain" for i, c in enumerate(calls) if c == "nvjpeg")
    order = dev.train.sampler
    assert y.tolist() == [dev.data.train.samples[i][1] for i in order.shard()[: len(y)]]
    dev.start_epoch(3)
    threads = threading.active_count()
    batches = itertools.islice(dev.train, 2)
    assert len(list(batches)) == 2
    del batches
    assert threading.active_count() == threads  # (the thread ended with the iteration)


def test_an_error_in_the_staging_thread_reaches_the_trainer(odd_tree, monkeypatch):
    root, _ = odd_tree
    dev = loaders(root, "gpu")

    def broken(self, batch):
        raise ValueError("stage broke")

    monkeypatch.setattr(FileStage, "__call__", broken)
    dev.stages["train"] = FileStage(dev.data.train, dev.transfer)
    dev.build(1, 0)
    with pytest.raises(ValueError, match="stage broke"):
        epoch(dev)


@pytest.fixture
def broken_tree(tmp_path):
    """12 train (one truncated JPEG among them) and 4 val files (one of them truncated too)."""
    root = tmp_path / "tree"
    kinds = write_tree(root, 12, 4, classes=2, size=(64, 48), jitter=8, odd=False, truncated=1)
    (bad_train,) = kinds["truncated"]
    bad_val = root / "val" / "class1" / "1.JPEG"
    bad_val.write_bytes(bad_val.read_bytes()[:200])
    return root, str(bad_train), str(bad_val)


@pytest.mark.parametrize("decode", ["cpu", "gpu"])
@pytest.mark.parametrize("workers", [0, 1])
def test_a_truncated_file_stops_the_run_naming_it(broken_tree, decode, workers):
    root, bad, _ = broken_tree
    with pytest.raises(images.UnreadableImage, match=rf"{bad}.*truncated.*data.on_bad_file=skip"):
        epoch(loaders(root, decode, workers=workers))


@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_a_skipped_file_keeps_the_batch_full_and_is_counted(broken_tree, decode):
    """Training: every batch full, the bad file's place taken by its batch's first readable image; evaluation: the
    file left out; both named by take_skipped, counted by skipped_count."""
    root, bad_train, bad_val = broken_tree
    run = loaders(root, decode, on_bad_file="skip")
    x, y = epoch(run)
    assert len(x) == 12 and run.skipped_count() == 1
    ((path, why),) = run.take_skipped()
    assert path == bad_train and "truncated" in why
    order = run.train.sampler.shard()
    row = [run.data.train.samples[i][0] for i in order].index(bad_train)
    first = row - row % 4 + (1 if row % 4 == 0 else 0)
    assert torch.equal(x[row], x[first]) and y[row] == y[first]
    xv, yv = zip(*run.val)
    assert len(torch.cat(xv)) == 3 and run.skipped_count() == 2
    assert run.take_skipped()[0][0] == bad_val and run.take_skipped() == []


def test_a_device_decode_failure_is_found_on_the_cpu(odd_tree, monkeypatch):
    """When the batched decode refuses a batch (nvJPEG on a corrupt scan), each file is decoded on the CPU: the
    batch is the same."""
    root, _ = odd_tree
    dev = loaders(root, "gpu", batch=8)
    ds, stage = dev.data.train, dev.stages["train"]
    batch = [ds[(i, 0, 1)] for i in range(8)]
    expected, _ = stage(ds.collate_fn(batch))

    def refuse(self, jpegs):
        raise RuntimeError("Failed to decode batch: 6")

    monkeypatch.setattr(FileStage, "decode", refuse)
    got, _ = stage(ds.collate_fn(batch))
    assert torch.equal(got, expected)


def test_collate_fills_training_batches_and_drops_from_evaluation_ones():
    pixels = torch.full((3, 4, 4), 7, dtype=torch.uint8)
    data = torch.arange(10, dtype=torch.uint8)
    samples = [SkippedSample("a.JPEG", "truncated", 1), (pixels, 2), EncodedSample(data, 3, 5, (0, 0, 4, 4), True)]
    from data.imagefolder import FileCollate

    batch = FileCollate(True, 4)(samples)
    assert isinstance(batch, FileBatch) and batch.labels.tolist() == [2, 2, 3]
    assert batch.pixel_slots.tolist() == [0, 1] and batch.encoded_slots.tolist() == [2]
    assert batch.skipped == [("a.JPEG", "truncated")] and torch.equal(batch.jpegs()[0], data)
    assert batch.boxes.tolist() == [[0, 0, 4, 4]] and batch.flips.tolist() == [True]
    batch = FileCollate(False, 4)(samples)
    assert batch.labels.tolist() == [2, 3] and batch.encoded_slots.tolist() == [1]
    with pytest.raises(images.UnreadableImage, match="a.JPEG"):
        FileCollate(True, 4)(samples[:1])


def test_train_py_skips_a_truncated_file_and_counts_it(tmp_path, broken_tree):
    """A run with data.on_bad_file=skip: a file_skipped event naming the file, the evaluation's and the summary's
    skipped_files (both files, all ranks); without it the run stops with an error naming the file."""
    root, bad_train, bad_val = broken_tree
    common = [*FAST, "data=imagefolder", f"data.root={root}", "data.image_size=32", "data.num_workers=0",
              "data.batch_size=2", "trainer.nproc=2", "trainer.epochs=1"]  # fmt: skip
    summary, metrics = train(tmp_path / "skip", *common, "data.on_bad_file=skip")
    events = [r for r in metrics if r.get("event") == "file_skipped"]
    assert {e["path"] for e in events} <= {bad_train, bad_val} and events  # (the logging rank's own)
    assert records(metrics, "eval")[-1]["skipped_files"] == 2 == summary["skipped_files"]
    assert records(metrics, "eval")[-1]["num_samples"] == 3
    with pytest.raises(Exception) as failed:
        train(tmp_path / "error", *common)
    assert bad_train in str(failed.value) or bad_val in str(failed.value)
