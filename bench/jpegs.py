"""An ImageNet-like folder of real image files, written at bench (and test) time: JPEGs of mixed sizes around
ImageNet's typical 500x375 (smooth random content, quality 90) and, among them, the kinds of file ImageNet's train
set holds that a GPU JPEG decoder does not take: CMYK and grayscale JPEGs, progressive ones, and PNGs named
``.JPEG``. Optionally a truncated JPEG (what a copy cut short leaves), which no decoder reads."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Every ODD_EVERY-th file is one of these, in turn (ImageNet: 22 CMYK JPEGs and 1 PNG among 1.28 M files; more
# grayscale and progressive ones). A bench's share of them is far larger, so that every kind is exercised.
ODD_KINDS = ("cmyk", "gray", "progressive", "png")
ODD_EVERY = 16


def image(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Smooth random RGB content (low-resolution noise resized up), as photographs compress."""
    from PIL import Image

    low = rng.integers(0, 256, (max(2, height // 16), max(2, width // 16), 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(low).resize((width, height), Image.BILINEAR))


def save(pixels: np.ndarray, path: Path, kind: str = "rgb", quality: int = 90) -> None:
    """``pixels`` written to ``path`` (whatever its name says) as ``kind``: rgb, cmyk, gray, progressive, png."""
    from PIL import Image

    im = Image.fromarray(pixels)
    if kind == "png":
        im.save(path, format="PNG")
    elif kind == "cmyk":
        im.convert("CMYK").save(path, format="JPEG", quality=quality)
    elif kind == "gray":
        im.convert("L").save(path, format="JPEG", quality=quality)
    else:
        im.save(path, format="JPEG", quality=quality, progressive=kind == "progressive")


def write_tree(
    root: Path,
    num_train: int,
    num_val: int | None = None,
    classes: int = 4,
    size: tuple[int, int] = (500, 375),
    jitter: int = 100,
    odd: bool = True,
    odd_every: int = ODD_EVERY,
    truncated: int = 0,
    seed: int = 0,
) -> dict[str, list[Path]]:
    """``<root>/{train,val}/class<k>/<i>.JPEG``: sizes ``size`` (width, height) +- ``jitter`` pixels each way; with
    ``odd`` every ``odd_every``-th file one of ``ODD_KINDS``, in turn; ``truncated`` training files cut to half
    their bytes. Returns the paths of each odd kind (and ``truncated``)."""
    rng = np.random.default_rng(seed)
    kinds: dict[str, list[Path]] = {}
    num_val = num_val if num_val is not None else max(classes, num_train // 8)
    for split, count in (("train", num_train), ("val", num_val)):
        for i in range(count):
            folder = root / split / f"class{i % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            width = int(size[0] + rng.integers(-jitter, jitter + 1))
            height = int(size[1] + rng.integers(-jitter, jitter + 1))
            kind = ODD_KINDS[(i // odd_every) % len(ODD_KINDS)] if odd and i % odd_every == odd_every - 1 else "rgb"
            path = folder / f"{i}.JPEG"
            save(image(rng, height, width), path, kind)
            if kind != "rgb":
                kinds.setdefault(kind, []).append(path)
    for path in sorted((root / "train").rglob("*.JPEG"), key=lambda p: int(p.stem))[:truncated]:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        kinds.setdefault("truncated", []).append(path)
    return kinds
