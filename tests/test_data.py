from __future__ import annotations

import gzip
import http.server
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch

from dlperf.data import ArrayLoader, glyphs, load_data, load_fashion_mnist, read_idx, write_idx
from dlperf.data.fashion_mnist import FILES
from dlperf.errors import UsageError


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
def test_idx_round_trip(tmp_path, compress, dtype):
    a = (np.arange(24).reshape(2, 3, 4) - 5).astype(dtype)
    p = tmp_path / ("a.gz" if compress else "a")
    write_idx(p, a, compress=compress)
    out = read_idx(p)
    assert tuple(out.shape) == (2, 3, 4)
    np.testing.assert_array_equal(out.numpy(), a)


def test_idx_header_matches_the_standard_layout(tmp_path):
    p = tmp_path / "labels-idx1-ubyte"
    write_idx(p, np.array([7, 2, 1], dtype=np.uint8))
    assert p.read_bytes() == bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 2, 1])


def test_idx_bad_magic_and_truncation(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"PK\x03\x04junk")
    with pytest.raises(UsageError, match="not an IDX file"):
        read_idx(bad)
    short = tmp_path / "short"
    short.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 5, 1, 2]))
    with pytest.raises(UsageError, match="5 bytes"):
        read_idx(short)


def test_idx_truncated_or_corrupt_gzip_names_the_file(tmp_path):
    good = tmp_path / "x-idx1-ubyte.gz"
    write_idx(good, np.arange(200, dtype=np.uint8))
    cut = tmp_path / "cut-idx1-ubyte.gz"
    cut.write_bytes(good.read_bytes()[:-12])  # stream without its end marker: gzip raises EOFError
    with pytest.raises(UsageError, match="cut-idx1-ubyte.gz.*damaged gzip"):
        read_idx(cut)
    garbled = tmp_path / "garbled-idx1-ubyte.gz"
    raw = bytearray(good.read_bytes())
    raw[-8] ^= 0xFF  # wrong CRC-32 in the trailer
    garbled.write_bytes(bytes(raw))
    with pytest.raises(UsageError, match="garbled-idx1-ubyte.gz"):
        read_idx(garbled)
    with pytest.raises(UsageError, match="cannot read .*missing"):
        read_idx(tmp_path / "missing")


def _write_fashion(root, n_train=6, n_test=4, gz=True):
    rng = np.random.default_rng(0)
    data = {}
    for split, n in (("train", n_train), ("test", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        suffix = ".gz" if gz else ""
        write_idx(root / (FILES[f"{split}_images"] + suffix), images)
        write_idx(root / (FILES[f"{split}_labels"] + suffix), labels)
        data[split] = (images, labels)
    return data


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_loader_reads_idx_directory(tmp_path, gz):
    data = _write_fashion(tmp_path, gz=gz)
    (Xtr, ytr), (Xte, yte) = load_fashion_mnist(tmp_path)
    np.testing.assert_array_equal(Xtr.numpy(), data["train"][0])
    np.testing.assert_array_equal(yte.numpy(), data["test"][1])
    assert ytr.dtype == torch.int64
    train, test = load_data(4, tmp_path)
    xb, yb = next(iter(train))
    assert xb.shape == (4, 1, 28, 28) and float(xb.max()) <= 1.0


def test_fashion_mnist_missing_files_says_which(tmp_path):
    with pytest.raises(UsageError, match="t10k-images-idx3-ubyte"):
        _write_fashion(tmp_path)
        (tmp_path / (FILES["test_images"] + ".gz")).unlink()
        load_fashion_mnist(tmp_path)
    with pytest.raises(UsageError, match="does not exist"):
        load_fashion_mnist(tmp_path / "nope")


def test_glyphs_are_deterministic_balanced_and_varied():
    (a, ya), (t, yt) = glyphs(train=200, test=50, seed=3)
    (b, yb), _ = glyphs(train=200, test=50, seed=3)
    assert torch.equal(a, b) and torch.equal(ya, yb)
    assert torch.bincount(ya, minlength=10).tolist() == [20] * 10
    (c, _), _ = glyphs(train=200, test=50, seed=4)
    assert not torch.equal(a, c)
    assert not torch.equal(a[:50], t)  # the test split is its own draw
    # two images of one class differ (random pose, stroke and noise)
    same = (ya == 0).nonzero().squeeze(1)[:2]
    assert not torch.equal(a[same[0]], a[same[1]])


def test_loader_epoch_order_is_reproducible_and_complete():
    X = torch.arange(10, dtype=torch.uint8).view(10, 1, 1).expand(10, 2, 2).contiguous()
    y = torch.arange(10)
    loader = ArrayLoader(X, y, batch_size=3, seed=1)
    first = torch.cat([yb for _, yb in loader.epoch_batches(0)])
    again = torch.cat([yb for _, yb in loader.epoch_batches(0)])
    other = torch.cat([yb for _, yb in loader.epoch_batches(1)])
    assert torch.equal(first, again) and sorted(first.tolist()) == list(range(10))
    assert not torch.equal(first, other)
    xb, yb = next(iter(ArrayLoader(X, y, batch_size=4, shuffle=False)))
    torch.testing.assert_close(xb[:, 0, 0, 0], yb.float() / 255)


def test_loader_stopped_early_leaves_no_thread():
    X, y = torch.zeros(100, 4, 4, dtype=torch.uint8), torch.zeros(100, dtype=torch.long)
    before = threading.active_count()
    it = ArrayLoader(X, y, batch_size=2, prefetch=1).epoch_batches(0)
    next(it)
    it.close()
    assert threading.active_count() == before


def test_loader_closed_after_producer_finished_does_not_hang():
    # the producer has put every batch and waits to put the end marker into a full queue
    X, y = torch.zeros(12, 28, 28, dtype=torch.uint8), torch.arange(12)
    it = ArrayLoader(X, y, batch_size=4, shuffle=False, prefetch=2).epoch_batches(0)
    next(it)
    time.sleep(0.5)
    closer = threading.Thread(target=it.close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "closing the loader hung"


def test_loader_bad_arguments():
    with pytest.raises(UsageError, match="batch size"):
        ArrayLoader(torch.zeros(2, 2), torch.zeros(2), batch_size=0)
    with pytest.raises(UsageError, match="labels"):
        ArrayLoader(torch.zeros(2, 2), torch.zeros(3), batch_size=1)


@pytest.mark.gpu
def test_loader_pins_memory_for_gpus():
    loader = ArrayLoader(torch.zeros(4, 2, 2, dtype=torch.uint8), torch.zeros(4), batch_size=2, pin_memory=True)
    xb, _ = next(iter(loader))
    assert xb.is_pinned()


def _idx_gz_bomb(path, count, expanded_mib):
    """A gzip IDX file declaring ``count`` 28x28 images whose stream expands to ``expanded_mib`` MiB."""
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(bytes([0, 0, 8, 3]) + count.to_bytes(4, "big") + (28).to_bytes(4, "big") * 2)
        zeros = bytes(1 << 20)
        for _ in range(expanded_mib):
            f.write(zeros)


@pytest.mark.timeout(60)
def test_gzip_is_decompressed_only_as_far_as_the_header_says(tmp_path):
    bomb = tmp_path / "bomb-idx3-ubyte.gz"
    _idx_gz_bomb(bomb, 10, 128)  # a few hundred KB on disk, 128 MiB expanded
    assert bomb.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(UsageError, match=r"shape \(10, 28, 28\) \(7840 bytes\) but the file has more than 7840"):
            read_idx(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # the expanded stream was never held


def test_header_larger_than_allowed_or_than_memory_is_refused_before_reading(tmp_path, monkeypatch):
    import dlperf._cliargs

    huge = tmp_path / "huge-idx3-ubyte.gz"
    _idx_gz_bomb(huge, 2**32 - 1, 1)
    with pytest.raises(UsageError, match="more than the 47040000 bytes this file may hold"):
        read_idx(huge, max_bytes=60000 * 784)
    monkeypatch.setattr(dlperf._cliargs, "available_memory_bytes", lambda: 2**30)
    with pytest.raises(UsageError, match=r"needs about 3\d{3}\.\d GiB but only 1\.0 GiB of memory is available"):
        read_idx(huge)
    raw = tmp_path / "raw-idx1-ubyte"
    raw.write_bytes(bytes([0, 0, 8, 1]) + (2**31).to_bytes(4, "big") + b"\x01\x02")
    with pytest.raises(UsageError, match="2147483648 bytes.*has 2 data bytes"):
        read_idx(raw)


def test_too_many_dimensions_or_a_directory_is_refused(tmp_path):
    p = tmp_path / "dims"
    p.write_bytes(bytes([0, 0, 8, 200]) + bytes(800))
    with pytest.raises(UsageError, match="200 dimensions"):
        read_idx(p)
    with pytest.raises(UsageError, match="not a regular file"):
        read_idx(tmp_path)


@pytest.mark.parametrize("images, labels, match", [
    (np.zeros((2, 28, 28), np.uint8), np.array([3, 10], np.uint8), "label 10 at example 1 is not a class 0-9"),
    (np.zeros((2, 28, 28), np.uint8), np.array([-1, 3], np.int8), "label -1 at example 0"),
    (np.zeros((2, 32, 32), np.uint8), np.array([1, 2], np.uint8), r"uint8 \(2, 32, 32\), expected uint8 \(N, 28, 28\)"),
    (np.zeros((2, 784), np.uint8), np.array([1, 2], np.uint8), r"\(2, 784\)"),
    (np.zeros((2, 28, 28), np.float32), np.array([1, 2], np.uint8), "torch.float32"),
    (np.zeros((2, 28, 28), np.uint8), np.array([1.0, 2.0], np.float32), "labels are torch.float32"),
    (np.zeros((2, 28, 28), np.uint8), np.array([1, 2, 3], np.uint8), "2 images .* but 3 labels"),
    (np.zeros((0, 28, 28), np.uint8), np.zeros(0, np.uint8), "has no examples"),
], ids=["label-10", "label-negative", "32x32", "flat", "float-images", "float-labels", "count", "empty"])
def test_fashion_mnist_files_must_be_what_the_trainer_needs(tmp_path, images, labels, match):
    for split in ("train", "test"):
        write_idx(tmp_path / FILES[f"{split}_images"], images)
        write_idx(tmp_path / FILES[f"{split}_labels"], labels)
    with pytest.raises(UsageError, match=match):
        load_fashion_mnist(tmp_path)


def test_fashion_mnist_directory_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        load_fashion_mnist(f)


class _Mirror:
    """A local http server for the four file names, serving whatever bytes a test puts in ``files``."""

    def __init__(self, files: dict[str, bytes]):
        mirror = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (the stdlib's name)
                body = mirror.files.get(self.path.lstrip("/"))
                self.send_response(200 if body is not None else 404)
                if body is not None and not mirror.hide_length:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if body is not None:
                    self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.files, self.hide_length = files, False
        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/"
        self.thread = threading.Thread(target=self.server.serve_forever, name="test-mirror")

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def _published(monkeypatch, files: dict[str, bytes]) -> None:
    """Make ``files`` the published Fashion-MNIST files (their sizes and SHA-256 become the expected ones)."""
    import hashlib

    from dlperf.data import fashion_mnist

    monkeypatch.setattr(fashion_mnist, "CHECKSUMS",
                        {n: (len(b), hashlib.sha256(b).hexdigest()) for n, b in files.items()})


def _fashion_gz_files() -> dict[str, bytes]:
    rng = np.random.default_rng(1)
    out = {}
    for split, n in (("train", 6), ("test", 4)):
        for kind, arr in (("images", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)),
                          ("labels", rng.integers(0, 10, n, dtype=np.uint8))):
            body = bytes([0, 0, 8, arr.ndim]) + b"".join(d.to_bytes(4, "big") for d in arr.shape) + arr.tobytes()
            out[FILES[f"{split}_{kind}"] + ".gz"] = gzip.compress(body)
    return out


def test_the_published_checksums_are_pinned():
    from dlperf.data.fashion_mnist import CHECKSUMS, MIRROR

    assert MIRROR.startswith("https://")
    assert CHECKSUMS["train-images-idx3-ubyte.gz"] == (
        26421880, "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84")
    assert sorted(CHECKSUMS) == sorted(f + ".gz" for f in FILES.values())


@pytest.mark.timeout(30)
def test_download_verifies_each_file_before_saving_it(tmp_path, monkeypatch):
    from dlperf.data import download_fashion_mnist

    files = _fashion_gz_files()
    _published(monkeypatch, files)
    served = dict(files)
    served["t10k-labels-idx1-ubyte.gz"] = gzip.compress(b"\0\0\x08\x01\0\0\0\x04" + bytes([9, 9, 9, 9]))
    served["t10k-labels-idx1-ubyte.gz"] += bytes(len(files["t10k-labels-idx1-ubyte.gz"])
                                                 - len(served["t10k-labels-idx1-ubyte.gz"]))
    with _Mirror(served) as mirror:
        with pytest.raises(UsageError, match="t10k-labels-idx1-ubyte.gz does not match the published .*SHA-256"):
            download_fashion_mnist(tmp_path / "d", mirror=mirror.url)
        assert not (tmp_path / "d" / "t10k-labels-idx1-ubyte.gz").exists()
        assert not [p for p in (tmp_path / "d").iterdir() if p.name.startswith(".")]  # no temporary left
        mirror.files = files
        download_fashion_mnist(tmp_path / "d", mirror=mirror.url)
    for name, body in files.items():
        assert (tmp_path / "d" / name).read_bytes() == body
    (Xtr, ytr), _ = load_fashion_mnist(tmp_path / "d")
    assert Xtr.shape == (6, 28, 28)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("hide_length", [False, True], ids=["content-length", "streamed"])
def test_download_stops_at_the_published_size(tmp_path, monkeypatch, hide_length):
    from dlperf.data import download_fashion_mnist

    files = _fashion_gz_files()
    _published(monkeypatch, files)
    big = dict(files, **{"train-images-idx3-ubyte.gz": bytes(10 << 20)})
    with _Mirror(big) as mirror:
        mirror.hide_length = hide_length
        with pytest.raises(UsageError, match="train-images-idx3-ubyte.gz (is 10485760 bytes|is more than the)"):
            download_fashion_mnist(tmp_path, mirror=mirror.url)
    assert not list(tmp_path.iterdir())


def test_download_refuses_plain_http_and_reports_unreachable_mirrors(tmp_path):
    from dlperf.data import download_fashion_mnist

    with pytest.raises(UsageError, match="is not https"):
        download_fashion_mnist(tmp_path, mirror="http://example.com/fashion/")
    with pytest.raises(UsageError, match="could not download http://127.0.0.1:9/"):
        download_fashion_mnist(tmp_path, mirror="http://127.0.0.1:9/", timeout_s=5)
