"""The IDX file format of MNIST and Fashion-MNIST: a magic number, the dimensions, then raw data.

Header: two zero bytes, a type code (0x08 = unsigned byte, ...), the number of dimensions, then each
dimension as a big-endian 32-bit integer. Files may be gzip-compressed (``.gz``).
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from ..errors import UsageError

__all__ = ["read_idx", "write_idx"]

_TYPES: dict[int, np.dtype] = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
                               0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(">i2"): 0x0B,
          np.dtype(">i4"): 0x0C, np.dtype(">f4"): 0x0D, np.dtype(">f8"): 0x0E}


MAX_DIMS = 8
"""Most dimensions an IDX file may declare (image sets have 3; more is a damaged header)."""


def _open(path: Path):
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rb") if gzipped else open(path, "rb")


def read_idx(path: str | Path, max_bytes: int | None = None) -> torch.Tensor:
    """Read one IDX file (gzip-compressed or not) into a tensor of its stored shape.

    The header is checked before any data is read: the magic number, at most ``MAX_DIMS`` dimensions,
    and a data size that matches the file, fits in memory and, when given, stays within
    ``max_bytes``. A ``.gz`` file is decompressed only up to the size its header declares, so a
    small file cannot expand into all of memory.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "x-idx1-ubyte")
    >>> write_idx(p, np.arange(3, dtype=np.uint8))
    >>> read_idx(p).tolist()
    [0, 1, 2]
    """
    path = Path(path)
    if path.exists() and not path.is_file():  # a directory, FIFO or device: reading could block
        raise UsageError(f"{path} is not a regular file; give an IDX file")
    try:
        with _open(path) as f:
            dtype, shape, header = _read_header(f, path)
            nbytes = _check_size(path, f, shape, dtype, header, max_bytes)
            raw = f.read(nbytes + 1)  # one byte more shows a file longer than its header says
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        # a download cut short leaves a gzip stream without its end marker
        raise UsageError(f"{path} is a damaged gzip file ({exc}); download it again") from exc
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(raw) != nbytes:
        have = f"more than {nbytes}" if len(raw) > nbytes else str(len(raw))
        raise UsageError(f"{path}: IDX header says shape {shape} ({nbytes} bytes) but the file has {have} "
                         "data bytes; the file is damaged: get it again")
    data = np.frombuffer(raw, dtype=dtype, count=nbytes // dtype.itemsize).reshape(shape)
    return torch.from_numpy(data.astype(dtype.newbyteorder("="), copy=True))


def _read_header(f, path: Path) -> tuple[np.dtype, tuple[int, ...], int]:
    magic = f.read(4)
    if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _TYPES:
        raise UsageError(f"{path} is not an IDX file (bad magic number {magic.hex() or 'empty'}); "
                         "give an IDX file such as train-images-idx3-ubyte")
    dtype, ndim = np.dtype(_TYPES[magic[2]]), magic[3]
    if ndim > MAX_DIMS:
        raise UsageError(f"{path}: IDX header declares {ndim} dimensions, more than {MAX_DIMS}; the file is damaged")
    dims = f.read(4 * ndim)
    if len(dims) < 4 * ndim:
        raise UsageError(f"{path}: truncated IDX header; the file is damaged: get it again")
    return dtype, struct.unpack(f">{ndim}I", dims), 4 + 4 * ndim


def _check_size(path: Path, f, shape: tuple[int, ...], dtype: np.dtype, header: int,
                max_bytes: int | None) -> int:
    """The data bytes the header declares, refused before reading if they cannot be right or cannot fit."""
    from .._cliargs import require_memory

    nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no overflow for absurd headers
    if max_bytes is not None and nbytes > max_bytes:
        raise UsageError(f"{path}: IDX header says shape {shape} ({nbytes} bytes), more than the {max_bytes} "
                         "bytes this file may hold; the file is damaged or not the expected one")
    if not isinstance(f, gzip.GzipFile):
        have = os.fstat(f.fileno()).st_size - header
        if have != nbytes:
            raise UsageError(f"{path}: IDX header says shape {shape} ({nbytes} bytes) but the file has {have} "
                             "data bytes; the file is damaged: get it again")
    require_memory(nbytes, f"{path} (IDX shape {shape})", "free memory or use a smaller file")
    return nbytes


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
