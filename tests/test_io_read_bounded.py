"""The one reader of small files (dlperf._io.read_bounded) and the four readers built on it: the build
cache, the probe cache, an export's graph.json and a trace. Each is given what a hostile or careless
hand can put at its path (a FIFO, a directory, a link, too many bytes, a file swapped for a FIFO
after it was looked at) and must answer at once with one line naming the path, or read the file."""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dlperf._buildcache as buildcache
import dlperf.engine.trace as trace_mod
import dlperf.hybrid.export_load as export_load
from dlperf._io import read_bounded
from dlperf.engine import create_engine
from dlperf.errors import UsageError
from dlperf.hybrid import export
from dlperf.hybrid.export_format import ExportFormatError
from dlperf.probe.cache import ProbeCacheError, read_cache_file

WAIT_S = 10.0  # a reader that blocks on a FIFO would never return: give up long before pytest's timeout


@dataclass
class Reader:
    """One caller of read_bounded: how to read a path, the error it raises and what a good file holds."""

    name: str
    read: Callable[[Path, int], Any]  # (path, byte limit) -> what the caller makes of the file
    error: type[Exception]
    follows_links: bool


def _read_build_cache(path: Path, limit: int) -> bytes:
    return buildcache._read_regular(str(path), limit)


def _read_probe_cache(path: Path, limit: int) -> bytes:
    return read_cache_file(str(path), max_bytes=limit)


def _read_graph(path: Path, limit: int) -> dict:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export_load, "MAX_GRAPH_BYTES", limit)
        return export_load._read_graph(str(path))


def _read_trace(path: Path, limit: int) -> Any:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trace_mod, "MAX_TRACE_BYTES", limit)
        return trace_mod.load_trace(path)


READERS = [Reader("build cache", _read_build_cache, buildcache.CacheUnsafe, follows_links=False),
           Reader("probe cache", _read_probe_cache, ProbeCacheError, follows_links=False),
           Reader("export graph", _read_graph, ExportFormatError, follows_links=True),
           Reader("trace", _read_trace, UsageError, follows_links=True)]


@pytest.fixture(scope="module")
def good_files(tmp_path_factory) -> dict[str, bytes]:
    """A file each reader accepts."""
    root = tmp_path_factory.mktemp("good")
    export(nn.Linear(3, 2), root / "export", (torch.randn(1, 3),))
    with create_engine("naive", trace=True) as eng:
        eng.push(sum, args=([1, 2],), name="add").wait()
        eng.stop_trace().save(root / "trace.json")
    return {"build cache": b"\x7fELF any bytes", "probe cache": b'{"format": 1}',
            "export graph": (root / "export" / "graph.json").read_bytes(),
            "trace": (root / "trace.json").read_bytes()}


def _put(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)  # a cache file must be the user's alone
    return path


def _within_time(read: Callable[[], Any], fifo: Path | None = None) -> tuple[Any, BaseException | None]:
    """Run ``read`` in a thread; fail the test if it has not returned within WAIT_S."""
    outcome: list[Any] = [None, None]

    def run() -> None:
        try:
            outcome[0] = read()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome[1] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    if thread.is_alive():
        if fifo is not None:  # a writer that opens and closes at once ends the blocked read
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            thread.join(WAIT_S)
        pytest.fail(f"the read of {fifo} did not return within {WAIT_S:g} s (it blocked)")
    return outcome[0], outcome[1]


def _refused(reader: Reader, path: Path, limit: int, *needles: str, fifo: Path | None = None) -> str:
    result, exc = _within_time(lambda: reader.read(path, limit), fifo)
    assert exc is not None, f"{reader.name} read {path} ({result!r:.80}) instead of refusing it"
    assert isinstance(exc, reader.error), repr(exc)
    message = str(exc)
    assert "\n" not in message and str(path) in message, message
    assert all(n in message for n in needles), message
    return message


@pytest.mark.parametrize("reader", READERS, ids=lambda r: r.name)
def test_a_fifo_is_refused_at_once_in_one_line(reader, tmp_path):
    fifo = tmp_path / "file.json"
    os.mkfifo(fifo, 0o600)
    _refused(reader, fifo, 1 << 20, "a FIFO, not a regular file", fifo=fifo)


@pytest.mark.parametrize("reader", READERS, ids=lambda r: r.name)
def test_a_directory_is_refused_in_one_line(reader, tmp_path):
    directory = tmp_path / "file.json"
    directory.mkdir()
    _refused(reader, directory, 1 << 20, "a directory, not a regular file")


@pytest.mark.parametrize("reader", READERS, ids=lambda r: r.name)
def test_a_file_over_the_limit_is_refused_in_one_line(reader, tmp_path, good_files):
    data = good_files[reader.name]
    path = _put(tmp_path / "file.json", data)
    _refused(reader, path, len(data) - 1, f"larger than {len(data) - 1} bytes ({len(data)} bytes)")
    assert reader.read(path, len(data)) is not None  # exactly at the limit reads


@pytest.mark.parametrize("reader", READERS, ids=lambda r: r.name)
def test_a_symbolic_link_is_followed_only_where_the_reader_says(reader, tmp_path, good_files):
    target = _put(tmp_path / "target.json", good_files[reader.name])
    link = tmp_path / "file.json"
    link.symlink_to(target)
    if reader.follows_links:
        assert reader.read(link, 1 << 20) is not None
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo, 0o600)
        link.unlink()
        link.symlink_to(fifo)  # followed to a FIFO: refused like the FIFO itself
        _refused(reader, link, 1 << 20, "a FIFO, not a regular file", fifo=fifo)
    else:  # a cache: a link could point it at any file
        _refused(reader, link, 1 << 20, "a symbolic link")


def _swap_for_a_fifo_that_looks_regular(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Put a FIFO at ``path`` in place of its regular file, while every look at it by name (``os.stat``) still
    sees the regular file: the swap between a reader's look and its open, made certain."""
    before = os.stat(path)
    path.unlink()
    os.mkfifo(path, 0o600)
    real_stat = os.stat

    def looks_regular(target, *args, **kwargs):
        return before if os.fspath(target) == str(path) else real_stat(target, *args, **kwargs)

    monkeypatch.setattr(os, "stat", looks_regular)


@pytest.mark.parametrize("reader", READERS, ids=lambda r: r.name)
def test_a_file_swapped_for_a_fifo_after_a_look_at_it_never_blocks(reader, tmp_path, good_files, monkeypatch):
    """A reader that looks (stat) and then opens would open a FIFO put there in between and wait for a
    writer forever; one that opens without waiting and judges what it opened refuses the FIFO at once.

    The swap is made certain: the path holds a FIFO, and every look at it by name sees the regular file
    that was there before.
    """
    path = _put(tmp_path / "file.json", good_files[reader.name])
    _swap_for_a_fifo_that_looks_regular(path, monkeypatch)
    _refused(reader, path, 1 << 20, "a FIFO, not a regular file", fifo=path)


def test_read_bounded_reads_a_regular_file_and_refuses_one_that_grew(tmp_path, monkeypatch):
    def fail(path: str, problem: str) -> ValueError:
        return ValueError(f"{path}: {problem}")

    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    assert read_bounded(path, 10, fail) == b"0123456789"
    assert read_bounded(path, None, fail) == b"0123456789"
    real_fstat = os.fstat
    # the size looked at says 4 bytes; 10 arrive: more than the limit is never returned
    monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result((*real_fstat(fd)[:6], 4, *real_fstat(fd)[7:])))
    with pytest.raises(ValueError, match=f"^{path}: larger than 5 bytes$"):
        read_bounded(path, 5, fail)


def test_read_bounded_leaves_other_errors_to_the_caller_and_closes_what_it_opened(tmp_path):
    def fail(path: str, problem: str) -> ValueError:
        return ValueError(f"{path}: {problem}")

    with pytest.raises(FileNotFoundError):
        read_bounded(tmp_path / "missing", 10, fail)
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    directory = tmp_path / "d"
    directory.mkdir()
    for _ in range(20):
        with pytest.raises(ValueError, match="a directory, not a regular file"):
            read_bounded(directory, 10, fail)
    if before is not None:
        assert len(os.listdir("/proc/self/fd")) == before

    def refuse_all(st: os.stat_result) -> None:
        raise PermissionError(errno.EACCES, "not ours")

    path = tmp_path / "f"
    path.write_bytes(b"x")
    with pytest.raises(PermissionError):
        read_bounded(path, 10, fail, check=refuse_all)


# --- an export's weights: one descriptor is judged, hashed and loaded -------------------------------

@pytest.fixture(scope="module")
def weights_export(tmp_path_factory) -> tuple[Path, nn.Module]:
    root = tmp_path_factory.mktemp("weights")
    model = nn.Linear(3, 2)
    export(model, root / "export", (torch.randn(1, 3),))
    return root / "export", model


def _export_copy(weights_export, tmp_path) -> tuple[Path, Path]:
    """A fresh copy of the export and the (real) path of its weights file."""
    directory = Path(os.path.realpath(tmp_path)) / "export"
    shutil.copytree(weights_export[0], directory)
    return directory, directory / "params.safetensors"


def _load_refused(directory: Path, weights: Path, *needles: str, fifo: Path | None = None) -> str:
    result, exc = _within_time(lambda: export_load.load(directory), fifo)
    assert exc is not None, f"loaded {directory} ({result!r:.80}) instead of refusing its weights"
    assert isinstance(exc, ExportFormatError), repr(exc)
    message = str(exc)
    assert "\n" not in message and str(weights) in message, message
    assert all(n in message for n in (*needles, "export the model again")), message
    return message


def test_weights_that_are_a_fifo_are_refused_at_once(weights_export, tmp_path):
    directory, weights = _export_copy(weights_export, tmp_path)
    weights.unlink()
    os.mkfifo(weights, 0o600)
    _load_refused(directory, weights, "a FIFO, not a regular file", fifo=weights)


def test_weights_swapped_for_a_fifo_after_a_look_at_them_never_block(weights_export, tmp_path, monkeypatch):
    """Every look at the weights by name sees the regular file that was there; the path holds a FIFO."""
    directory, weights = _export_copy(weights_export, tmp_path)
    _swap_for_a_fifo_that_looks_regular(weights, monkeypatch)
    _load_refused(directory, weights, "a FIFO, not a regular file", fifo=weights)


def test_weights_that_are_a_directory_are_refused(weights_export, tmp_path):
    directory, weights = _export_copy(weights_export, tmp_path)
    weights.unlink()
    weights.mkdir()
    _load_refused(directory, weights, "a directory, not a regular file")


def test_weights_behind_a_link_are_judged_by_what_it_reaches(weights_export, tmp_path):
    """Links are followed as for graph.json; a link to a FIFO or a device is refused like the file itself."""
    directory, weights = _export_copy(weights_export, tmp_path)
    x = torch.randn(4, 3)
    kept = tmp_path / "kept.safetensors"
    weights.rename(kept)
    weights.symlink_to(kept)
    torch.testing.assert_close(export_load.load(directory)(x), weights_export[1](x))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    for target, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device")):
        weights.unlink()
        weights.symlink_to(target)
        _load_refused(directory, weights, f"{kind}, not a regular file", fifo=fifo)


def test_weights_changed_after_their_checksum_are_never_loaded(weights_export, tmp_path, monkeypatch):
    """The file is rewritten in place (same size, other values) the moment its checksum has been found
    to match: what is loaded must still be what was checked."""
    import hashlib

    directory, weights = _export_copy(weights_export, tmp_path)
    data = weights.read_bytes()
    recorded = hashlib.sha256(data).hexdigest()
    start = 8 + int.from_bytes(data[:8], "little")  # the header's length, then the header, then float32s
    other = bytearray(data)
    other[start + 3::4] = bytes(b ^ 0x80 for b in data[start + 3::4])  # every value's sign flipped
    real_sha256 = hashlib.sha256
    rewritten: list[bool] = []

    class RewriteOnceChecked:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._hash = real_sha256(*args, **kwargs)

        def update(self, data: Any) -> None:
            self._hash.update(data)

        def hexdigest(self) -> str:
            digest = self._hash.hexdigest()
            if digest == recorded and not rewritten:
                with open(weights, "r+b") as f:
                    f.write(other)
                rewritten.append(True)
            return digest

        def __getattr__(self, name: str) -> Any:
            return getattr(self._hash, name)

    monkeypatch.setattr(hashlib, "sha256", RewriteOnceChecked)
    result, exc = _within_time(lambda: export_load.load(directory))
    monkeypatch.undo()
    assert rewritten, "the weights' checksum was never computed"
    if exc is not None:
        assert isinstance(exc, ExportFormatError), repr(exc)
        return
    x = torch.randn(4, 3)
    torch.testing.assert_close(result(x), weights_export[1](x))  # the checked bytes, not the rewritten ones
