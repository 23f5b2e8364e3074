"""Install NVIDIA apex 25.04, Python-only, for ``amp=apex``: ``make apex APEX_SRC=<source dir or .tar.gz>``.

NVIDIA apex is not on PyPI (the PyPI package ``apex`` is unrelated), and 25.04 is its last release with the legacy
``apex.amp`` that ``amp=apex`` drives (25.07 removed it). This takes its source, a directory or a ``.tar.gz`` such
as GitHub's release tarball, checks that it is apex with ``apex/amp``, and installs it into this interpreter's
environment with ``pip install --no-build-isolation --no-deps``: no ``--cpp_ext``/``--cuda_ext``, so nothing is
compiled and apex runs its Python fallbacks (the loss scaler unscales tensor by tensor instead of in one fused
kernel: correct, a little slower). ``--no-build-isolation`` builds against the torch already installed;
``--no-deps`` leaves the pinned environment as it is.

    .venv/bin/python scripts/install_apex.py apex-25.04.tar.gz
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# What the source of NVIDIA apex with the legacy apex.amp holds (apex/amp/frontend.py has amp.initialize).
MARKERS = ("setup.py", "apex/__init__.py", "apex/amp/frontend.py", "apex/amp/scaler.py")


def source_root(path: Path, unpack_to: Path) -> Path:
    """The directory holding apex's ``setup.py``: ``path`` itself, or its one top-level directory once unpacked."""
    if path.is_dir():
        return path
    if not tarfile.is_tarfile(path):
        raise SystemExit(f"install_apex: {path} is neither a directory nor a tarball of NVIDIA apex's source")
    with tarfile.open(path) as archive:
        archive.extractall(unpack_to, filter="data")
    entries = list(unpack_to.iterdir())
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else unpack_to


def check(root: Path) -> None:
    """Exit with one line saying what is wrong unless ``root`` is NVIDIA apex's source with ``apex.amp``."""
    if not (root / "setup.py").is_file() or not (root / "apex" / "__init__.py").is_file():
        raise SystemExit(f"install_apex: {root} is not NVIDIA apex's source (no setup.py beside apex/__init__.py)")
    missing = [m for m in MARKERS if not (root / m).is_file()]
    if missing:
        raise SystemExit(
            f"install_apex: {root} has no {', '.join(missing)}: this apex has no apex.amp (NVIDIA removed it in "
            f"25.07). Use apex 25.04's source"
        )


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: install_apex.py <NVIDIA apex 25.04 source: a directory or a .tar.gz>", file=sys.stderr)
        return 2
    path = Path(argv[0]).expanduser()
    if not path.exists():
        raise SystemExit(f"install_apex: {path} does not exist")
    with tempfile.TemporaryDirectory(prefix="apex-src-") as tmp:
        root = source_root(path, Path(tmp))
        if root != path:
            print(f"install_apex: unpacked {path} to {root}")
        check(root)
        command = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", str(root)]
        print("install_apex: " + " ".join(command), flush=True)
        subprocess.run(command, check=True)
    check_import = [sys.executable, "-c", "import apex; from apex import amp; print(apex.__file__)"]
    where = subprocess.run(check_import, check=True, capture_output=True, text=True).stdout.strip()
    print(f"install_apex: NVIDIA apex (Python-only) installed into {sys.prefix}; apex.amp imports from {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
