"""Datasets for the training demos: Fashion-MNIST from IDX files, or the embedded procedural glyphs.

>>> train, test = load_data(batch_size=64, train=200, test=50)
>>> xb, yb = next(iter(train))
>>> tuple(xb.shape), xb.dtype
((64, 1, 28, 28), torch.float32)
"""

from __future__ import annotations

from pathlib import Path

from .fashion_mnist import download_fashion_mnist, load_fashion_mnist
from .idx import read_idx, write_idx
from .loader import ArrayLoader
from .synthetic import CLASSES, glyphs

__all__ = ["load_data", "ArrayLoader", "load_fashion_mnist", "download_fashion_mnist", "read_idx",
           "write_idx", "glyphs", "CLASSES"]


def load_data(batch_size: int, data_dir: str | Path | None = None, *, seed: int = 0, train: int = 12000,
              test: int = 2000, download: bool = False) -> tuple[ArrayLoader, ArrayLoader]:
    """Train and test loaders: Fashion-MNIST from ``data_dir``, else the embedded glyph dataset.

    ``download=True`` fetches Fashion-MNIST into ``data_dir`` first when the files are missing.
    ``train``/``test`` size the embedded dataset only.
    """
    if data_dir is not None:
        if download:
            download_fashion_mnist(data_dir)
        (Xtr, ytr), (Xte, yte) = load_fashion_mnist(data_dir)
    else:
        (Xtr, ytr), (Xte, yte) = glyphs(train, test, seed=seed)
    return (ArrayLoader(Xtr, ytr, batch_size, shuffle=True, seed=seed),
            ArrayLoader(Xte, yte, batch_size, shuffle=False))
