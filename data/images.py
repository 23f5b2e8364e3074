"""Image files as the loaders take them: bytes, what a JPEG's header says, a decode on the CPU that takes every file
ImageNet holds, the training augmentation drawn per sample, and the crops and resizes as tensor operations that run
the same on a worker's CPU (uint8) and on the GPU (float).

**Decoders.** torchvision's ``decode_image`` (libjpeg-turbo for JPEGs, as Pillow; the two decode to identical
pixels, CMYK and grayscale JPEGs and PNGs included) and, for a file it cannot read, Pillow. A file neither reads is
unreadable (:class:`UnreadableImage`, naming it). A JPEG whose data ends early is unreadable for both (libjpeg-turbo
stops with "truncated").

**Which JPEGs the GPU takes** (:func:`jpeg_info`): baseline or extended sequential Huffman JPEGs of 8-bit YCbCr with
the chroma subsamplings nvJPEG decodes, ending in their EOI marker. Progressive JPEGs (which nvJPEG decodes one at a
time, through the host, behind a stream sync each), CMYK and grayscale ones, 12-bit or arithmetic-coded ones, Adobe
RGB-transform ones, any other format under a JPEG's name and a JPEG cut short go to the CPU decode in the worker.

**Augmentation** (:func:`draw_train_view`): the crop box of torchvision's (and timm's) ``RandomResizedCrop``, scale
(0.08, 1) and aspect ratio (3/4, 4/3), ten tries then a centre crop, and a horizontal flip with probability 1/2,
drawn from a generator seeded by the run's seed, the epoch and the sample's index alone (:func:`sample_rng`): the
same crops whatever the number of ranks or workers, and after a resume.

**Resize**: bilinear with antialiasing (``torch.nn.functional.interpolate(..., antialias=True)``), the filter and
support of Pillow's bilinear resize: on the same decoded pixels the two differ by less than 1 in 255 (Pillow rounds
to uint8 and computes in fixed point).
"""

from __future__ import annotations

import io
import math
import random
import warnings
from dataclasses import dataclass

import numpy as np
import torch

SCALE = (0.08, 1.0)  # RandomResizedCrop's defaults (torchvision, timm)
RATIO = (3 / 4, 4 / 3)

# torchvision 0.29 marks its image decoders deprecated in favour of TorchCodec; they are the pinned ones here.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision")


class UnreadableImage(OSError):
    """An image file that no decoder reads (truncated, corrupt, not an image); the message names the file."""


@dataclass(frozen=True)
class JpegInfo:
    """What a JPEG's header says: its size and whether the GPU decoder takes it (``why`` not, when it does not)."""

    height: int
    width: int
    gpu: bool
    why: str = ""


def read_bytes(path: str) -> torch.Tensor:
    """A file's bytes as a 1-D uint8 tensor (one read, no copy)."""
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8))


# Sampling factors (horizontal, vertical) of Y with Cb and Cr at (1, 1): 4:4:4, 4:2:2, 4:4:0, 4:2:0, 4:1:1.
_SUBSAMPLINGS = {(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)}
_SOF_GPU = {0xC0, 0xC1}  # baseline, extended sequential (Huffman)
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def jpeg_info(data: torch.Tensor | bytes) -> JpegInfo | None:
    """The header of a JPEG (its markers up to the first scan), or None if ``data`` is no JPEG or its header is cut
    short or malformed (the CPU decode then says what it is)."""
    b = data.numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)
    if b[:2] != b"\xff\xd8":
        return None
    pos, sof, components, adobe_rgb = 2, None, [], False
    while pos + 4 <= len(b):
        if b[pos] != 0xFF:
            return None
        marker = b[pos + 1]
        if marker == 0xFF:  # (fill byte)
            pos += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # (no length)
            pos += 2
            continue
        length = int.from_bytes(b[pos + 2 : pos + 4], "big")
        segment = b[pos + 4 : pos + 2 + length]
        if length < 2 or len(segment) < length - 2:
            return None
        if marker in _SOF:
            if len(segment) < 6:
                return None
            sof, precision = marker, segment[0]
            height, width = int.from_bytes(segment[1:3], "big"), int.from_bytes(segment[3:5], "big")
            count = segment[5]
            if len(segment) < 6 + 3 * count:
                return None
            components = [(segment[6 + 3 * i + 1] >> 4, segment[6 + 3 * i + 1] & 15) for i in range(count)]
        elif marker == 0xEE and segment[:5] == b"Adobe" and len(segment) >= 12:
            adobe_rgb = segment[11] == 0  # (transform 0 on 3 components: RGB, not YCbCr)
        elif marker == 0xDA:  # start of scan: the header is complete
            break
        pos += 2 + length
    else:
        return None
    if sof is None or height == 0 or width == 0:
        return None
    why = ""
    if sof not in _SOF_GPU:
        why = "progressive" if sof in (0xC2, 0xC6, 0xCA, 0xCE) else f"coding SOF{sof - 0xC0}"
    elif precision != 8:
        why = f"{precision}-bit"
    elif len(components) != 3:
        why = {1: "grayscale", 4: "CMYK"}.get(len(components), f"{len(components)} components")
    elif adobe_rgb:
        why = "RGB, not YCbCr"
    elif components[1] != (1, 1) or components[2] != (1, 1) or components[0] not in _SUBSAMPLINGS:
        why = f"subsampling {components}"
    elif b.rstrip(b"\x00")[-2:] != b"\xff\xd9":
        why = "no end marker (truncated?)"
    return JpegInfo(height, width, not why, why)


def decode(data: torch.Tensor, path: str) -> torch.Tensor:
    """An image file's bytes decoded on the CPU to RGB uint8 CHW: torchvision, else Pillow; an
    :class:`UnreadableImage` naming ``path`` when neither reads it."""
    from torchvision.io import ImageReadMode, decode_image

    try:
        if data.numel():
            return decode_image(data, mode=ImageReadMode.RGB)
    except RuntimeError:
        pass
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data.numpy().tobytes())) as image:
            rgb = np.asarray(image.convert("RGB"))
    except Exception as error:  # (Pillow raises OSError, ValueError, SyntaxError... for a bad file)
        raise UnreadableImage(f"{path}: {error}") from None
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1)


def sample_rng(seed: int, epoch: int, index: int) -> random.Random:
    """The generator sample ``index`` draws its augmentation from in ``epoch`` of a run seeded ``seed``."""
    return random.Random((seed * 1_000_003 + epoch) * 10_000_000_019 + index)


def crop_box(rng: random.Random, height: int, width: int) -> tuple[int, int, int, int]:
    """``(top, left, h, w)``: RandomResizedCrop's box (torchvision's algorithm, its default scale and ratio)."""
    area = height * width
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    ratio = width / height  # (ten misses: the centre crop of the whole image within the ratio's bounds)
    if ratio < RATIO[0]:
        w, h = width, int(round(width / RATIO[0]))
    elif ratio > RATIO[1]:
        w, h = int(round(height * RATIO[1])), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def draw_train_view(rng: random.Random, height: int, width: int) -> tuple[tuple[int, int, int, int], bool]:
    """A training sample's crop box and flip, in the order they are drawn."""
    box = crop_box(rng, height, width)
    return box, rng.random() < 0.5


def resize(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """CHW (uint8 on the CPU, float anywhere) to ``height`` x ``width``: bilinear, antialiased (Pillow's filter)."""
    if tuple(image.shape[-2:]) == (height, width):
        return image
    # (F.interpolate(mode="bilinear", antialias=True, align_corners=False)'s own op, without its checks: the GPU
    # path makes one call per image from a thread that shares the interpreter with training)
    return torch._C._nn._upsample_bilinear2d_aa(image[None], (height, width), False)[0]


def train_view(
    image: torch.Tensor, box: tuple[int, int, int, int], flip: bool, size: int, as_float: bool = False
) -> torch.Tensor:
    """The training crop ``box`` of ``image`` resized to ``size`` x ``size``, flipped left to right if ``flip``;
    ``as_float``: the crop is made float before it is resized (on a GPU, which resizes floats only)."""
    top, left, h, w = box
    crop = image[:, top : top + h, left : left + w]
    view = resize(crop.float() if as_float else crop, size, size)
    return view.flip(-1) if flip else view


def eval_resize_shape(height: int, width: int, size: int, crop_pct: float) -> tuple[int, int]:
    """timm's evaluation resize: the shorter side to ``floor(size / crop_pct)``, the longer in proportion
    (torchvision's ``Resize(int)`` rounding)."""
    short = math.floor(size / crop_pct)
    if height <= width:
        return short, int(short * width / height)
    return int(short * height / width), short


def eval_view(image: torch.Tensor, size: int, crop_pct: float) -> torch.Tensor:
    """timm's evaluation transform: resize (:func:`eval_resize_shape`), then the centre ``size`` x ``size`` crop."""
    height, width = eval_resize_shape(image.shape[-2], image.shape[-1], size, crop_pct)
    resized = resize(image, height, width)
    top, left = int(round((height - size) / 2.0)), int(round((width - size) / 2.0))
    return resized[:, top : top + size, left : left + size]


def jitter(image: torch.Tensor, rng: random.Random, strength: float) -> torch.Tensor:
    """ColorJitter(brightness, contrast, saturation = ``strength``) on a uint8 CHW image: each factor drawn from
    [max(0, 1 - strength), 1 + strength], applied in an order drawn too (torchvision's ColorJitter, hue off)."""
    from torchvision.transforms import functional as TF

    low, high = max(0.0, 1.0 - strength), 1.0 + strength
    ops = [TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation]
    rng.shuffle(ops)
    for op in ops:
        image = op(image, rng.uniform(low, high))
    return image
