"""Image files into batches: our CPU decode path against a plain torchvision ``ImageFolder`` DataLoader (images/s
per core), and on a GPU the device decode path alone and its agreement with the CPU decode.

    python -m bench.decode                 # make bench-decode: writes bench/results/decode-<date>.json and
                                           # docs/benchmarks/decode.md
    python -m bench.decode --smoke         # a few seconds: every part, tiny

1. **The CPU path** (``data.decode=cpu``): the imagefolder training loader (workers read, decode with torchvision's
   libjpeg-turbo, crop, resize and flip uint8 tensors; the batch normalized where it arrives) against a plain
   torchvision pipeline (``ImageFolder`` with Pillow, ``RandomResizedCrop``, ``RandomHorizontalFlip``, ``ToTensor``,
   ``Normalize``, a shuffled ``DataLoader``), both at batch 64 with the same workers on the same files, whole
   epochs once the workers have started, side by side: ``--repeats`` rounds, each timing both in turn (the order
   alternating), medians. Images/s per core: per worker (the workers are the cores that decode).
2. **On a GPU**: the device path alone (``decode_img_s``): collated batches of file bytes (what the workers hand
   over) decoded by nvJPEG, cropped, resized, flipped and normalized on the GPU, timed over whole passes; and its
   agreement with the CPU decode of the same batches (``data.imagefolder.FileStage`` on the CPU), over
   ``--agree-batches`` batches with other work (allocations, matmuls) queued on the stream before each: the mean
   absolute difference of each image, in levels of 255, within torchvision's own bound for nvJPEG against
   libjpeg-turbo (< 2), and the largest difference anywhere, recorded.

The files (``bench.jpegs``): an ImageNet-like tree of JPEGs around 500x375 with CMYK, grayscale, progressive and PNG
files among them (one in 16).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import ROOT, machine
from bench.jpegs import write_tree

# torchvision's own test of its nvJPEG decode against its CPU one: mean absolute difference per image < 2 levels.
AGREEMENT_LEVELS = 2.0


def plain_loader(root: Path, batch: int, workers: int, size: int) -> Any:
    """The plain torchvision pipeline a user writes first."""
    from torch.utils.data import DataLoader
    from torchvision import transforms as T
    from torchvision.datasets import ImageFolder

    from data.common import loader_options

    tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])  # fmt: skip
    dataset = ImageFolder(str(root / "train"), transform=tf)
    return DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True,
                      **loader_options(torch.device("cpu"), workers))  # fmt: skip


def our_loader(root: Path, batch: int, workers: int, size: int) -> Any:
    from data.common import Loaders
    from data.imagefolder import build

    loaders = Loaders(build(str(root), image_size=size, decode="cpu"), batch, workers, 0)
    loaders.build(1, 0)
    return loaders


def epoch_rate(iterate: Any, epochs: int) -> float:
    """Images/s over ``epochs`` whole epochs of ``iterate(epoch)``, after one that starts the workers."""
    seconds, n = 0.0, 0
    for epoch in range(1 + epochs):
        start, count = time.perf_counter(), 0
        for x, _ in iterate(epoch):
            count += len(x)
        if epoch:
            seconds, n = seconds + time.perf_counter() - start, n + count
    return n / seconds


def cpu_rates(root: Path, workers: int, batch: int, size: int, repeats: int, epochs: int) -> dict[str, Any]:
    """Our CPU path and the plain pipeline, side by side, ``repeats`` rounds (order alternating): medians."""
    ours, plain = our_loader(root, batch, workers, size), plain_loader(root, batch, workers, size)

    def our_epoch(epoch: int) -> Any:
        ours.start_epoch(epoch)
        return ours.train

    rates: dict[str, list[float]] = {"ours": [], "plain": []}
    for r in range(repeats):
        order = ("ours", "plain") if r % 2 == 0 else ("plain", "ours")
        for name in order:
            rates[name].append(epoch_rate(our_epoch if name == "ours" else lambda _: plain, epochs))
    med = {name: statistics.median(v) for name, v in rates.items()}
    return {
        "workers": workers, "batch": batch, "image_size": size, "repeats": repeats, "epochs": epochs,
        "ours_img_s": med["ours"], "plain_img_s": med["plain"],
        "ours_img_s_per_core": med["ours"] / max(workers, 1), "plain_img_s_per_core": med["plain"] / max(workers, 1),
        "ratio": med["ours"] / med["plain"], "ours_runs": rates["ours"], "plain_runs": rates["plain"],
    }  # fmt: skip


def file_batches(root: Path, batch: int, count: int, size: int, train: bool = True) -> tuple[Any, list[Any]]:
    """``count`` collated batches of the training files as the workers hand them to the device path (bytes, crop
    boxes, flips; the odd files decoded), cycling through the files; and the dataset."""
    from data.imagefolder import build

    data = build(str(root), image_size=size, decode="gpu")
    ds = data.train if train else data.val
    ds.encoded = True
    n = len(ds)
    batches = []
    for b in range(count):
        items = [((b * batch + i) % n, 0, 1 + (b * batch + i) // n) for i in range(batch)]
        batches.append(ds.collate_fn([ds[item if train else item[0]] for item in items]))
    return data, batches


def stage_for(data: Any, device: str, channels_last: bool) -> Any:
    from data.prefetch import DeviceTransfer

    transfer = DeviceTransfer(torch.device(device), data.mean, data.std, True, channels_last)
    return data.train.stage(transfer)


def device_decode_rate(root: Path, device: str, batch: int, batches: int, size: int, passes: int) -> dict[str, Any]:
    """Images/s of the device path alone over ``passes`` passes through ``batches`` collated batches (one pass
    first, untimed: nvJPEG's and the allocator's start)."""
    data, collated = file_batches(root, batch, batches, size)
    stage = stage_for(data, device, channels_last=device == "cuda")
    gpu_files = sum(len(b.encoded_slots) for b in collated)
    seconds = []
    for p in range(1 + passes):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for b in collated:
            stage(b)
        if device == "cuda":
            torch.cuda.synchronize()
        if p:
            seconds.append(time.perf_counter() - start)
    return {"decode_img_s": batch * batches / statistics.median(seconds), "decode_batch": batch,
            "decode_batches": batches, "decode_gpu_share": gpu_files / (batch * batches)}  # fmt: skip


def queue_writes(device: str, size_bytes: int, count: int = 48) -> None:
    """Work queued on the current stream and not waited for, as a previous step leaves it: a matmul long enough to
    hold the queue, then ``count`` writes into blocks of ``size_bytes`` (a decoded image's), freed at once, so that
    the caching allocator hands those blocks to the next allocations while the writes are still to run."""
    a = torch.randn(4096, 4096, device=device)
    (a @ a).sum()
    for k in range(count):
        torch.empty(size_bytes, dtype=torch.uint8, device=device).fill_(k)


def agreement(root: Path, device: str, batch: int, batches: int, size: int) -> dict[str, Any]:
    """The device path against the CPU path on the same collated batches, with writes queued on the stream before
    each decode (:func:`queue_writes`): where the decode is not ordered after them, they land on its images."""
    data, collated = file_batches(root, batch, batches, size)
    on_device, on_cpu = stage_for(data, device, False), stage_for(data, "cpu", False)
    std = torch.tensor(data.std).view(1, 3, 1, 1) * 255
    worst_mean, worst, failed = 0.0, 0.0, 0
    for b in collated:
        if device == "cuda":
            queue_writes(device, 3 * 375 * 500)
        got = on_device(b)[0].cpu()
        want = on_cpu(b)[0]
        diff = ((got - want) * std).abs()
        per_image = diff.mean(dim=(1, 2, 3))
        failed += int((per_image >= AGREEMENT_LEVELS).any())
        worst_mean, worst = max(worst_mean, float(per_image.max())), max(worst, float(diff.max()))
    return {"agree_batches": batches, "agree_batch": batch, "agree_failed_batches": failed,
            "agree_worst_mean_levels": worst_mean, "agree_max_levels": worst,
            "agree_bound_levels": AGREEMENT_LEVELS}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny: that every part still runs")
    p.add_argument("--images", type=int, default=1024, help="training JPEGs written")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts of the CPU comparison")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=1, help="timed epochs of each measurement")
    p.add_argument("--agree-batches", type=int, default=200)
    p.add_argument("--out", type=Path, help="where the JSON and the markdown go (default: the repository's)")
    a = p.parse_args(argv)
    size = 224
    if a.smoke:
        a.images, a.workers, a.batch, a.repeats, a.agree_batches, size = 48, [1], 8, 1, 2, 32
    device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
    work = Path(tempfile.mkdtemp(prefix="bench-decode-"))
    write_tree(work / "tree", a.images, classes=4)
    result: dict[str, Any] = {"date": datetime.date.today().isoformat(), "machine": machine(),
                              "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__, "device": device,
                              "images": a.images, "cpu": []}  # fmt: skip
    import torchvision

    result["torchvision"] = torchvision.__version__
    for workers in a.workers:
        row = cpu_rates(work / "tree", workers, a.batch, size, a.repeats, a.epochs)
        result["cpu"].append(row)
        print(f"  {workers} workers: ours {row['ours_img_s']:.0f} img/s, plain torchvision {row['plain_img_s']:.0f} "
              f"(ratio {row['ratio']:.2f}); per core {row['ours_img_s_per_core']:.0f} vs "
              f"{row['plain_img_s_per_core']:.0f}", flush=True)  # fmt: skip
    if device == "cuda" or a.smoke:
        result.update(device_decode_rate(work / "tree", device, 256 if not a.smoke else 8, 8, size, 3))
        result.update(agreement(work / "tree", device, 32 if not a.smoke else 4, a.agree_batches, size))
        print(f"  device path alone: {result['decode_img_s']:.0f} img/s; agreement with the CPU decode over "
              f"{result['agree_batches']} batches: {result['agree_failed_batches']} outside the bound, worst image "
              f"mean {result['agree_worst_mean_levels']:.2f} levels, max {result['agree_max_levels']:.0f}",
              flush=True)  # fmt: skip
    out = a.out or ROOT
    json_path = (out / "bench" / "results" if a.out is None else out) / f"decode-{result['date']}.json"
    md_path = (out / "docs" / "benchmarks" if a.out is None else out) / "decode.md"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    md_path.write_text(
        markdown(result, " ".join(["python -m bench.decode", *(argv if argv is not None else sys.argv[1:])]))
    )
    print(f"bench.decode: wrote {json_path} and {md_path}", flush=True)
    return result


def markdown(r: dict[str, Any], command: str) -> str:
    rows = [
        f"| {c['workers']} | {c['ours_img_s']:.0f} | {c['plain_img_s']:.0f} | {c['ours_img_s_per_core']:.0f} | "
        f"{c['plain_img_s_per_core']:.0f} | **{c['ratio']:.2f}** |"
        for c in r["cpu"]
    ]
    lines = [
        "# Image files into batches: the CPU decode path, and the GPU's",
        "",
        f"`{command}` (`make bench-decode`), {r['date']}: {r['machine']}, torchvision {r['torchvision']}; "
        f"{r['images']} training files of an ImageNet-like tree (JPEGs around "
        "500x375, one in 16 CMYK, grayscale, progressive or a PNG), batch "
        f"{r['cpu'][0]['batch'] if r['cpu'] else '-'}, 224-px crops, whole epochs once the workers have started; "
        f"medians of {r['cpu'][0]['repeats'] if r['cpu'] else '-'} rounds, each timing both loaders in turn. Raw "
        f"figures: `bench/results/decode-{r['date']}.json`.",
        "",
        "Ours is `data.decode=cpu` (torchvision's libjpeg-turbo decode, crop, antialiased resize and flip on uint8 "
        "tensors in the workers, the batch normalized where it arrives); plain is torchvision's `ImageFolder` with "
        "Pillow, `RandomResizedCrop`, `RandomHorizontalFlip`, `ToTensor` and `Normalize` in the workers. Per core "
        "divides by the workers: the training process (taking the batches, normalizing ours) runs beside them, on a "
        "core of its own only where the machine has one more than the workers.",
        "",
        "| workers | ours (images/s) | plain torchvision (images/s) | ours per core | plain per core | ours / plain |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]
    if "decode_img_s" in r:
        lines += [
            f"On {r['device']}: the device path alone (nvJPEG, crops, resizes, flips, normalization; batch "
            f"{r['decode_batch']}, {100 * r['decode_gpu_share']:.0f} % of the files decoded on the device, the rest "
            f"by the workers beforehand) **{r['decode_img_s']:.0f} images/s**. Against the CPU decode of the same "
            f"batches, with other work queued on the stream before each decode, over {r['agree_batches']} batches "
            f"of {r['agree_batch']}: {r['agree_failed_batches']} batches with an image whose mean difference reached "
            f"{r['agree_bound_levels']:.0f} levels of 255 (torchvision's bound for nvJPEG against libjpeg-turbo); the "
            f"worst image's mean {r['agree_worst_mean_levels']:.2f}, the largest difference "
            f"{r['agree_max_levels']:.0f}.",
            "",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
