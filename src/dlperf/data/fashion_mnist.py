"""Fashion-MNIST from the standard IDX files in a directory (optionally downloaded first).

The four files keep their usual names, with or without ``.gz``:
``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte``. Nothing is downloaded unless :func:`download_fashion_mnist` is called; a
download is checked against the published size and SHA-256 of each file before it is saved.
"""

from __future__ import annotations

import hashlib
import urllib.parse
import urllib.request
from pathlib import Path

import torch

from .._io import atomic_write_bytes
from ..errors import UsageError
from .idx import read_idx

__all__ = ["FILES", "MIRROR", "CHECKSUMS", "load_fashion_mnist", "download_fashion_mnist", "Split"]

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
# The dataset's own repository, over https; the checksums below make any mirror as good as this one.
MIRROR = "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/"
# Size in bytes and SHA-256 of each published .gz file (the same files as the MD5 sums in
# zalandoresearch/fashion-mnist's README; the SHA-256 sums are TensorFlow Datasets' for them).
CHECKSUMS: dict[str, tuple[int, str]] = {
    "train-images-idx3-ubyte.gz": (26421880, "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84"),
    "train-labels-idx1-ubyte.gz": (29515, "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845"),
    "t10k-images-idx3-ubyte.gz": (4422102, "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073"),
    "t10k-labels-idx1-ubyte.gz": (5148, "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5"),
}
IMAGE_SHAPE = (28, 28)
NUM_CLASSES = 10
MAX_EXAMPLES = 60000  # the larger split; a header claiming more is not Fashion-MNIST
_CHUNK = 1 << 16

Split = tuple[torch.Tensor, torch.Tensor]  # uint8 images (N, 28, 28), int64 labels (N,)


def _find(root: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (root / name).is_file():
            return root / name
    raise UsageError(f"{root} has no {stem} (or {stem}.gz); give the directory holding the four "
                     f"Fashion-MNIST IDX files, or download them with download_fashion_mnist({str(root)!r})")


def _pair(root: Path, images: str, labels: str) -> Split:
    """Images and labels of one split, checked to be what the trainer needs."""
    image_bytes = IMAGE_SHAPE[0] * IMAGE_SHAPE[1]
    X = read_idx(_find(root, images), max_bytes=MAX_EXAMPLES * image_bytes)
    y = read_idx(_find(root, labels), max_bytes=MAX_EXAMPLES)
    if X.dtype != torch.uint8 or X.dim() != 3 or tuple(X.shape[1:]) != IMAGE_SHAPE:
        raise UsageError(f"{root}/{images}: images are {X.dtype} {tuple(X.shape)}, expected uint8 (N, 28, 28) "
                         "as in Fashion-MNIST; give the Fashion-MNIST files")
    if y.dim() != 1 or y.dtype.is_floating_point:
        raise UsageError(f"{root}/{labels}: labels are {y.dtype} {tuple(y.shape)}, expected integers (N,)")
    if X.shape[0] != y.shape[0]:
        raise UsageError(f"{root}: {X.shape[0]} images in {images} but {y.shape[0]} labels in {labels}; "
                         "give files from the same split")
    if X.shape[0] == 0:
        raise UsageError(f"{root}: {images} has no examples; give the Fashion-MNIST files")
    y = y.long()
    bad = (y < 0) | (y >= NUM_CLASSES)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise UsageError(f"{root}/{labels}: label {int(y[i])} at example {i} is not a class 0-{NUM_CLASSES - 1}; "
                         "the file is damaged or not Fashion-MNIST")
    return X, y


def load_fashion_mnist(root: str | Path) -> tuple[Split, Split]:
    """``((train_images, train_labels), (test_images, test_labels))`` from the IDX files in ``root``."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise UsageError(f"data directory {str(root)!r} is a file, not a directory; give the directory "
                         "holding the Fashion-MNIST IDX files")
    if not root.is_dir():
        raise UsageError(f"data directory {str(root)!r} does not exist")
    return (_pair(root, FILES["train_images"], FILES["train_labels"]),
            _pair(root, FILES["test_images"], FILES["test_labels"]))


def _check_mirror(mirror: str) -> None:
    url = urllib.parse.urlsplit(mirror)
    loopback = url.hostname in ("127.0.0.1", "localhost", "::1")
    if url.scheme != "https" and not (url.scheme == "http" and loopback):
        raise UsageError(f"mirror {mirror!r} is not https; give an https:// mirror (plain http only for a "
                         "mirror on this machine)")


def _fetch(url: str, size: int, timeout_s: float) -> bytes:
    """The body at ``url``, refused as soon as it is longer than ``size``."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        declared = response.headers.get("Content-Length")
        if declared is not None and declared.isdigit() and int(declared) > size:
            raise UsageError(f"{url} is {int(declared)} bytes, expected {size}; nothing was saved: the mirror "
                             "serves another file, try the default mirror")
        body = bytearray()
        while chunk := response.read(_CHUNK):
            body += chunk
            if len(body) > size:
                raise UsageError(f"{url} is more than the {size} bytes expected; nothing was saved: the "
                                 "mirror serves another file, try the default mirror")
    return bytes(body)


def download_fashion_mnist(root: str | Path, mirror: str = MIRROR, timeout_s: float = 30.0) -> Path:
    """Fetch the four ``.gz`` files into ``root`` (skipping ones already there); needs a network.

    Each file must have its published size and SHA-256 before it is written (atomically) under its
    name; a mismatch raises :class:`~dlperf.errors.UsageError` and leaves nothing behind.
    """
    _check_mirror(mirror)
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise UsageError(f"data directory {str(root)!r} is a file, not a directory; give a directory")
    root.mkdir(parents=True, exist_ok=True)
    base = mirror if mirror.endswith("/") else mirror + "/"
    for stem in FILES.values():
        dest = root / f"{stem}.gz"
        if dest.exists() or (root / stem).exists():
            continue
        size, sha256 = CHECKSUMS[dest.name]
        url = base + dest.name
        try:
            body = _fetch(url, size, timeout_s)
        except (OSError, ValueError) as exc:  # URLError, timeouts, refused connections, bad URLs
            raise UsageError(f"could not download {url}: {exc}; copy the files into {root} by hand, or train "
                             "on the embedded dataset (data=None)") from None
        got = hashlib.sha256(body).hexdigest()
        if len(body) != size or got != sha256:
            raise UsageError(f"{url} does not match the published Fashion-MNIST file ({len(body)} bytes, "
                             f"SHA-256 {got}; expected {size} bytes, {sha256}); nothing was saved: try again "
                             "or use the default mirror")
        atomic_write_bytes(dest, body)
    return root
