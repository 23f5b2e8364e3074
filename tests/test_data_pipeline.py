"""The input pipeline: uint8 batches normalized where they arrive (``data.prefetch``), the loaders' options and
worker count, the imagefolder transforms, and evaluation sums kept on the device. On the CPU: the CUDA side stream
is the same code with streams (``make test-gpu`` runs these tests on a GPU too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import ON_GPU, plain_cfg
from PIL import Image
from torch.utils.data import TensorDataset, default_collate
from torchvision.datasets import ImageFolder

from data.common import (
    DataBundle,
    Loaders,
    TrainSampler,
    auto_num_workers,
    build_data,
    loader_options,
    resolve_num_workers,
)
from data.imagefolder import build as build_imagefolder
from data.images import draw_train_view, sample_rng
from errors import ConfigError

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if ON_GPU and torch.cuda.is_available() else [])
# Two float32 computations of the same normalized pixel, (u / 255 - mean) / std with |value| <= 2.7 (ImageNet's
# mean and std), each rounded a few times: either is within 4 float32 ulps of 2.7 (2.4e-7 each) of the exact value.
BOUND = 1e-6


@pytest.fixture
def jpeg_folder(tmp_path):
    """A real ImageNet-layout folder of JPEGs of several sizes: 2 classes, 4 train and 2 val images each."""
    rng = np.random.default_rng(0)
    for split, count in (("train", 4), ("val", 2)):
        for label in range(2):
            folder = tmp_path / "jpegs" / split / f"class_{label}"
            folder.mkdir(parents=True)
            for i in range(count):
                h, w = 40 + 8 * i, 56 - 4 * i
                smooth = np.linspace(0, 255, h * w * 3).reshape(h, w, 3) + rng.normal(0, 30, (h, w, 3))
                Image.fromarray(smooth.clip(0, 255).astype(np.uint8)).save(folder / f"{i}.jpg", quality=90)
    return tmp_path / "jpegs"


def exact(u8: torch.Tensor, mean, std) -> torch.Tensor:
    """The normalization in float64: the value both float32 paths round."""
    m, s = (torch.tensor(v, dtype=torch.float64).view(1, -1, 1, 1) for v in (mean, std))
    return (u8.double() / 255 - m) / s


def batches(loader) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*loader)
    return torch.cat(xs), torch.cat(ys)


# Two uint8 resizes of the same decoded pixels with the same filter (Pillow's bilinear, torch's antialiased one):
# each rounds the horizontal pass to uint8 and then the vertical one (<= 0.5 each) with fixed-point weights (<< 0.1),
# so each is within 1.1 of the exact value and the two within 2 (integers).
LEVELS = 2


def levels(x: torch.Tensor, mean, std) -> torch.Tensor:
    """Normalized images back on the 0-255 scale of their pixels (float64)."""
    m, s = (torch.tensor(v, dtype=torch.float64).view(1, -1, 1, 1) for v in (mean, std))
    return (x.double() * s + m) * 255


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_jpeg_folder_arrives_normalized_as_the_cpu_transforms_make_it(jpeg_folder, device, num_workers):
    """Real JPEGs through the whole path (decode and crop in a worker, uint8 collate, copy, normalization on the
    device) are their uint8 samples normalized, to float32 rounding; the samples are timm's evaluation transform
    (Pillow's resize and centre crop) within two levels of 255."""
    bundle = build_imagefolder(str(jpeg_folder), image_size=32, decode="cpu")
    assert bundle.uint8 and bundle.val[0][0].dtype == torch.uint8
    loaders = Loaders(bundle, 3, num_workers, seed=0, device=device)
    loaders.build(1, 0)
    assert loaders.val.loader.persistent_workers == (num_workers > 0)
    x, y = batches(loaders.val)
    assert x.device.type == device.type and x.dtype == torch.float32 and y.dtype == torch.int64 and len(x) == 4
    from timm.data import create_transform

    reference_tf = create_transform(32, is_training=False, crop_pct=0.875, use_prefetcher=True)  # uint8 out
    ref_u8, ref_y = default_collate(list(ImageFolder(str(jpeg_folder / "val"), transform=reference_tf)))
    u8 = torch.stack([bundle.val[i][0] for i in range(len(bundle.val))])
    assert torch.equal(y.cpu(), ref_y)
    assert (x.cpu().double() - exact(u8, bundle.mean, bundle.std)).abs().max() <= BOUND
    assert (u8.int() - ref_u8.int()).abs().max() <= LEVELS


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_training_crops_normalized_on_the_device_equal_the_cpu_reference(jpeg_folder, device):
    """Each sample's crop box and flip, drawn from its own generator, applied by Pillow as timm's transform does
    (crop, bilinear resize, flip) equal our samples within two levels; the batch is their normalization."""
    from PIL import Image

    bundle = build_imagefolder(str(jpeg_folder), image_size=24, decode="cpu")
    loaders = Loaders(bundle, 4, 0, seed=0, device=device)
    ours, theirs = [], []
    for i, (path, label) in enumerate(bundle.train.samples):
        ours.append(bundle.train[(i, 7, 3)])
        with Image.open(path) as im:
            im = im.convert("RGB")
            (top, left, h, w), flip = draw_train_view(sample_rng(7, 3, i), im.height, im.width)
            im = im.crop((left, top, left + w, top + h)).resize((24, 24), Image.BILINEAR)
            if flip:
                im = im.transpose(Image.FLIP_LEFT_RIGHT)
            theirs.append((torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1), label))
    x, y = loaders.transfer(*default_collate(ours))
    ref_u8, ref_y = default_collate(theirs)
    u8 = torch.stack([u for u, _ in ours])
    assert torch.equal(y.cpu(), ref_y) and x.dtype == torch.float32
    assert (x.cpu().double() - exact(u8, bundle.mean, bundle.std)).abs().max() <= BOUND
    assert (u8.int() - ref_u8.int()).abs().max() <= LEVELS
    assert not torch.equal(bundle.train[(0, 7, 3)][0], bundle.train[(0, 7, 4)][0])  # (another epoch, another crop)


def digits_like(n: int = 20, num_val: int = 7, size: int = 6) -> DataBundle:
    """Float images (already normalized) whose label is their index: the order batches arrive in is visible."""
    x = torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(0))
    return DataBundle(TensorDataset(x, torch.arange(n)), TensorDataset(x[:num_val], torch.arange(num_val)), 10, size)


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_float_images_are_only_moved_and_the_order_is_the_samplers(device):
    """A float dataset (digits, cifar10) is moved, not normalized again; the batches come in the sampler's order,
    one prefetched ahead, none lost or repeated; the trainer's sampler calls and len() reach the loader's."""
    data = digits_like(44, num_val=15)
    loaders = Loaders(data, 4, 0, seed=3, device=device)
    loaders.build(num_replicas=2, rank=1)
    sampler = loaders.train.sampler
    assert isinstance(sampler, TrainSampler) and sampler.num_replicas == 2 and sampler.rank == 1
    assert len(loaders.train) == 22 // 4 == loaders.steps_per_epoch
    loaders.start_epoch(5, skip=4)
    assert sampler.epoch == 5 and sampler.start == 4
    order = TrainSampler(44, 2, 1, seed=3)
    order.set_epoch(5)
    order.skip(4)
    expected = order.shard()[:20]  # (20 left in this rank's shard: five full batches)
    x, y = batches(loaders.train)
    assert y.tolist() == expected and x.device.type == device.type
    assert torch.equal(x.cpu(), data.train.tensors[0][expected])  # exactly the samples: nothing normalized
    x, y = batches(loaders.val)  # (1, 3, ..., 13: a full batch and a last one of 3)
    assert y.tolist() == list(range(1, 15, 2)) and torch.equal(x.cpu(), data.val.tensors[0][1:15:2])


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("uint8", [False, True])
def test_channels_last_is_honoured(device, uint8):
    """Batches, and the example batch, in the memory format asked for, with the same values either way."""
    dtype = "uint8" if uint8 else "float32"
    data = build_data(
        {"_target_": "data.synthetic.build", "num_samples": 8, "num_val_samples": 4, "image_size": 5, "dtype": dtype}
    )
    out = {}
    for channels_last in (False, True):
        loaders = Loaders(data, 4, 0, 0, device, channels_last)
        loaders.build(1, 0)
        (x, _), (ex, ey) = next(iter(loaders.val)), loaders.example_batch(6)
        for t in (x, ex):
            assert t.is_contiguous(memory_format=torch.channels_last) == channels_last
            assert t.is_contiguous() != channels_last and t.dtype == torch.float32 and t.device.type == device.type
        out[channels_last] = x, ex, ey
    assert all(torch.equal(a, b) for a, b in zip(out[False], out[True]))


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_the_example_batch_is_the_first_sample_as_a_loader_yields_it(device):
    data = build_data({"_target_": "data.synthetic.build", "num_samples": 8, "image_size": 6, "dtype": "uint8"})
    loaders = Loaders(data, 2, 0, seed=0, device=device)
    x, y = loaders.example_batch(3)
    sample, label = data.train[0]
    assert x.shape == (3, 3, 6, 6) and x.device.type == device.type and y.tolist() == [label] * 3
    assert (x.cpu().double() - exact(sample.unsqueeze(0), data.mean, data.std)).abs().max() <= BOUND


def test_synthetic_uint8_pixels_are_normalized_to_unit_scale_and_float32_is_unchanged():
    """uint8: deterministic per index, normalized by the uniform distribution to mean ~0 and std ~1. float32: the
    standard-normal pixels of the same seed as ever."""
    spec = {"_target_": "data.synthetic.build", "num_samples": 64, "image_size": 16}
    u8 = build_data({**spec, "dtype": "uint8"})
    (a, la), (b, lb) = u8.train[3], u8.train[3]
    assert a.dtype == torch.uint8 and torch.equal(a, b) and la == lb and not torch.equal(a, u8.train[4][0])
    loaders = Loaders(u8, 64, 0, seed=0)
    loaders.build(1, 0)
    x, _ = next(iter(loaders.train))
    assert abs(float(x.mean())) < 0.01 and abs(float(x.std()) - 1) < 0.01
    f32 = build_data({**spec, "dtype": "float32"})
    g = torch.Generator().manual_seed(1 * 1_000_003 + 3)
    assert torch.equal(f32.train[3][0], torch.randn((3, 16, 16), generator=g)) and not f32.uint8


def test_loader_options_for_a_cuda_device():
    """Pinned on CUDA (the only way its copy runs asynchronously), workers kept, ~8 batches ahead in the pool."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert loader_options(cuda, 4) == {
        "num_workers": 4,
        "pin_memory": True,
        "persistent_workers": True,
        "prefetch_factor": 2,
    }
    assert loader_options(cuda, 1)["prefetch_factor"] == 8 and loader_options(cuda, 3)["prefetch_factor"] == 3
    assert loader_options(cpu, 0) == {"num_workers": 0, "pin_memory": False}  # (torch refuses a prefetch_factor)
    assert loader_options(cpu, 2)["pin_memory"] is False


def test_loaders_for_a_cuda_device_are_pinned_and_persistent_without_touching_cuda():
    """Both loaders built for a CUDA device (nothing iterated: this machine may have none) carry the options."""
    loaders = Loaders(digits_like(), 4, 2, seed=0, device=torch.device("cuda"))
    loaders.build(1, 0)
    for loader in (loaders.train.loader, loaders.val.loader):
        assert loader.pin_memory and loader.persistent_workers and loader.num_workers == 2
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()


@pytest.mark.parametrize(
    "environ,affinity,workers",
    [
        ({}, 16, 15),  # one process with 16 CPUs
        ({"LOCAL_WORLD_SIZE": "4"}, 16, 3),  # torchrun or a local launch: 4 processes share 16 CPUs
        ({"LOCAL_WORLD_SIZE": "8"}, 10, 1),  # 1 CPU each: still one worker
        ({"LOCAL_WORLD_SIZE": "8"}, 4, 1),  # fewer CPUs than processes
        ({"SLURM_CPUS_PER_TASK": "10", "RELAXSYNC_LAUNCHER": "srun", "LOCAL_WORLD_SIZE": "8"}, 128, 9),  # srun task
        ({"SLURM_CPUS_PER_TASK": "32", "LOCAL_WORLD_SIZE": "4"}, 128, 7),  # torchrun's 4 workers in one Slurm task
        ({"SLURM_CPUS_PER_TASK": "", "LOCAL_WORLD_SIZE": "2"}, 12, 5),  # (an empty variable is not set)
    ],
)
def test_auto_num_workers(environ, affinity, workers):
    assert auto_num_workers(environ, affinity) == workers


def test_auto_num_workers_reads_this_process(monkeypatch):
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    import os

    assert resolve_num_workers("auto") == max(1, len(os.sched_getaffinity(0)) - 1)
    assert resolve_num_workers(3) == 3 and resolve_num_workers(0) == 0
    assert Loaders(digits_like(), 4, "auto", seed=0).num_workers == resolve_num_workers("auto")


def test_color_jitter_on_and_off(jpeg_folder):
    """0.4 jitters the training images (same crop: the jitter draws after it); null and 0 leave them as they are;
    evaluation never jitters."""
    on, off, zero = (build_imagefolder(str(jpeg_folder), image_size=24, color_jitter=j) for j in (0.4, None, 0))
    key = (2, 0, 1)
    assert torch.equal(off.train[key][0], zero.train[key][0])
    assert not torch.equal(on.train[key][0], off.train[key][0]) and on.train[key][0].dtype == torch.uint8
    assert torch.equal(on.val[1][0], off.val[1][0])
    assert on.decode == "cpu" and off.decode == "auto"  # (the jitter runs on the CPU decode only)


def test_data_keys_are_validated(digits_imagefolder):
    assert plain_cfg("data.num_workers=auto")["data"]["num_workers"] == "auto"
    root = f"data.root={digits_imagefolder}"
    assert plain_cfg("data=imagefolder", root, "data.color_jitter=0.4")["data"]["color_jitter"] == 0.4
    for overrides, key in (
        (["data.num_workers=many"], "data.num_workers='many'"),
        (["data.num_workers=-1"], "data.num_workers=-1"),
        (["data=imagefolder", root, "data.color_jitter=-0.1"], "data.color_jitter=-0.1"),
        (["data=imagefolder", root, "data.color_jitter=strong"], "data.color_jitter='strong'"),
        (["data=synthetic", "data.dtype=float16"], "data.dtype='float16'"),
        (["data=imagefolder", root, "data.decode=nvjpeg"], "data.decode='nvjpeg'"),
        (["data=imagefolder", root, "data.decode=gpu", "trainer.device=cpu"], "data.decode='gpu'"),
        (["data=imagefolder", root, "data.on_bad_file=ignore"], "data.on_bad_file='ignore'"),
    ):
        with pytest.raises(ConfigError, match=key):
            plain_cfg(*overrides)


class Sums:
    """A one-process communicator: the allreduce of one rank leaves the sums as they are."""

    def all_reduce(self, tensor):
        pass

    def take(self):
        pass


@pytest.mark.parametrize("device", DEVICES, ids=str)
def test_evaluation_reads_the_device_once_and_equals_per_batch_sums(device, monkeypatch):
    """The four sums kept on the device in float64 equal what per-batch ``.item()`` sums gave, to the bit; no
    ``.item()`` is called during the pass."""
    from contextlib import nullcontext

    from engine.evaluate import Evaluator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 6 * 6, 10)).to(device)
    data = digits_like(37)
    loaders = Loaders(data, 5, 0, seed=0, device=device)
    loaders.build(1, 0)
    val = list(loaders.val)  # (the DataLoader draws its seed with an .item() of its own)
    expected = torch.zeros(4, dtype=torch.float64)
    with torch.no_grad():
        for x, y in val:
            logits = model(x).float()
            hits = logits.topk(5, dim=1).indices.eq(y.unsqueeze(1))
            loss = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
            expected += torch.tensor([loss.item(), hits[:, :1].sum().item(), hits.sum().item(), len(y)])
    real_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a host sync per batch: .item()"))
    got = Evaluator(Sums(), nullcontext, device, num_classes=10).measure(model, val)
    monkeypatch.setattr(torch.Tensor, "item", real_item)
    loss_sum, top1, top5, count = expected.tolist()
    assert got == {"loss": loss_sum / count, "top1": 100 * top1 / count, "top5": 100 * top5 / count, "count": count}
    assert count == 7
