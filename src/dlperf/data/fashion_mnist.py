"""Fashion-MNIST from the standard IDX files in a directory (optionally downloaded first).

The four files keep their usual names, with or without ``.gz``:
``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte``. Nothing is downloaded unless :func:`download_fashion_mnist` is called.
"""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path

import torch

from ..errors import UsageError
from .idx import read_idx

__all__ = ["FILES", "MIRROR", "load_fashion_mnist", "download_fashion_mnist", "Split"]

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
MIRROR = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"

Split = tuple[torch.Tensor, torch.Tensor]  # uint8 images (N, 28, 28), int64 labels (N,)


def _find(root: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (root / name).is_file():
            return root / name
    raise UsageError(f"{root} has no {stem} (or {stem}.gz); give the directory holding the four "
                     f"Fashion-MNIST IDX files, or download them with download_fashion_mnist({str(root)!r})")


def _pair(root: Path, images: str, labels: str) -> Split:
    X, y = read_idx(_find(root, images)), read_idx(_find(root, labels))
    if X.dim() != 3 or y.dim() != 1 or X.shape[0] != y.shape[0]:
        raise UsageError(f"{root}: images {tuple(X.shape)} and labels {tuple(y.shape)} do not pair up")
    return X, y.long()


def load_fashion_mnist(root: str | Path) -> tuple[Split, Split]:
    """``((train_images, train_labels), (test_images, test_labels))`` from the IDX files in ``root``."""
    root = Path(root)
    if not root.is_dir():
        raise UsageError(f"data directory {str(root)!r} does not exist")
    return (_pair(root, FILES["train_images"], FILES["train_labels"]),
            _pair(root, FILES["test_images"], FILES["test_labels"]))


def download_fashion_mnist(root: str | Path, mirror: str = MIRROR, timeout_s: float = 30.0) -> Path:
    """Fetch the four ``.gz`` files into ``root`` (skipping ones already there); needs a network."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stem in FILES.values():
        dest = root / f"{stem}.gz"
        if dest.exists() or (root / stem).exists():
            continue
        tmp = dest.with_suffix(".gz.part")
        try:
            with urllib.request.urlopen(mirror + dest.name, timeout=timeout_s) as r, open(tmp, "wb") as f:
                shutil.copyfileobj(r, f)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise UsageError(f"could not download {mirror + dest.name}: {exc}; copy the files into "
                             f"{root} by hand, or train on the embedded dataset (no --data)") from None
        tmp.replace(dest)
    return root
