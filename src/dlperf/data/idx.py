"""The IDX file format of MNIST and Fashion-MNIST: a magic number, the dimensions, then raw data.

Header: two zero bytes, a type code (0x08 = unsigned byte, ...), the number of dimensions, then each
dimension as a big-endian 32-bit integer. Files may be gzip-compressed (``.gz``).
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from ..errors import UsageError

__all__ = ["read_idx", "write_idx"]

_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"),
          0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(">i2"): 0x0B,
          np.dtype(">i4"): 0x0C, np.dtype(">f4"): 0x0D, np.dtype(">f8"): 0x0E}


def _open(path: Path):
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def read_idx(path: str | Path) -> torch.Tensor:
    """Read one IDX file (gzip-compressed or not) into a tensor of its stored shape.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "x-idx1-ubyte")
    >>> write_idx(p, np.arange(3, dtype=np.uint8))
    >>> read_idx(p).tolist()
    [0, 1, 2]
    """
    path = Path(path)
    try:
        with _open(path) as f:
            raw = f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        # a download cut short leaves a gzip stream without its end marker
        raise UsageError(f"{path} is a damaged gzip file ({exc}); download it again") from exc
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _TYPES:
        raise UsageError(f"{path} is not an IDX file (bad magic number {raw[:4].hex() or 'empty'})")
    dtype, ndim = np.dtype(_TYPES[raw[2]]), raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise UsageError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    count = int(np.prod(shape)) if shape else 1
    if len(raw) - header != count * dtype.itemsize:
        raise UsageError(f"{path}: IDX header says shape {shape} ({count * dtype.itemsize} bytes) but "
                         f"the file has {len(raw) - header} data bytes")
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return torch.from_numpy(data.astype(dtype.newbyteorder("="), copy=True))


def write_idx(path: str | Path, array: np.ndarray | torch.Tensor, compress: bool | None = None) -> None:
    """Write ``array`` as IDX (gzip-compressed when ``compress`` or the name ends in ``.gz``)."""
    a = array.numpy() if isinstance(array, torch.Tensor) else np.asarray(array)
    big = a.dtype.newbyteorder(">") if a.dtype.itemsize > 1 else a.dtype
    if big not in _CODES:
        raise UsageError(f"IDX cannot store dtype {a.dtype}")
    body = bytes([0, 0, _CODES[big], a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.astype(big).tobytes()
    path = Path(path)
    if compress is None:
        compress = path.suffix == ".gz"
    with (gzip.open(path, "wb") if compress else open(path, "wb")) as f:
        f.write(body)
