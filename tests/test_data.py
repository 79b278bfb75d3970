from __future__ import annotations

import threading
import time

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
