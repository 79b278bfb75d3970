"""Cross-stream ordering of the GPU workers, checked on the CPU with recording fake streams/events.

The real CUDA paths run in tests/test_engine_gpu.py (marked gpu); this checks the bookkeeping
that decides which events a stream waits for, which needs no device.
"""

from __future__ import annotations

import contextlib

import pytest

from dlperf.devices import gpu
from dlperf.engine import create_engine
from dlperf.engine import cuda as engine_cuda
from dlperf.engine.var import Op


class FakeEvent:
    count = 0

    def __init__(self):
        FakeEvent.count += 1
        self.name = f"e{FakeEvent.count}"
        self.stream = None

    def record(self, stream):
        self.stream = stream

    def synchronize(self):
        pass


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.waited: list[str] = []

    def wait_event(self, ev):
        self.waited.append(ev.name)


@pytest.fixture
def lanes(monkeypatch):
    monkeypatch.setattr(engine_cuda.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(engine_cuda.torch.cuda, "stream", lambda s: contextlib.nullcontext())
    with create_engine() as eng:  # workers built by hand, never started: no CUDA calls
        compute = engine_cuda.GpuWorker(eng, gpu(0), "compute")
        copy = engine_cuda.GpuWorker(eng, gpu(0), "copy")
        compute.stream, copy.stream = FakeStream("compute"), FakeStream("copy")
        yield eng, compute, copy


def _run(eng, worker, reads=(), writes=()):
    op = Op(eng, lambda: None, (), tuple(reads), tuple(writes), worker, 0, None)
    worker.run_op(op, worker.label)
    return op


def test_read_after_write_on_another_stream_waits_for_the_write(lanes):
    eng, compute, copy = lanes
    y = eng.new_var("y")
    _run(eng, compute, writes=[y])
    write_event = y._wev.name
    _run(eng, copy, reads=[y])
    assert copy.stream.waited == [write_event]


def test_write_after_read_waits_for_reads_on_other_streams_only(lanes):
    eng, compute, copy = lanes
    x = eng.new_var("x")
    _run(eng, compute, writes=[x])
    _run(eng, copy, reads=[x])        # the copy lane reads x
    copy_read = x._revs[id(copy.stream)].name
    _run(eng, compute, reads=[x])     # and so does compute
    compute_read = x._revs[id(compute.stream)].name
    compute.stream.waited.clear()
    _run(eng, compute, writes=[x])    # a later write on compute must wait for the copy's read
    assert copy_read in compute.stream.waited
    assert compute_read not in compute.stream.waited  # its own stream orders it already
    assert x._revs is None and x._wev.stream is compute.stream


def test_read_events_keep_one_per_stream(lanes):
    eng, compute, copy = lanes
    x = eng.new_var("x")
    for _ in range(50):
        _run(eng, compute, reads=[x])
        _run(eng, copy, reads=[x])
    assert len(x._revs) == 2  # bounded, however often x is read


def test_cpu_consumer_synchronizes_on_gpu_events(lanes):
    eng, compute, _ = lanes
    synced = []

    class SyncEvent(FakeEvent):
        def synchronize(self):
            synced.append(self.name)

    y = eng.new_var("y")
    op = Op(eng, lambda: None, (), (), (y,), compute, 0, None)
    engine_cuda.torch.cuda.Event = SyncEvent  # restored by monkeypatch
    compute.run_op(op, compute.label)
    eng.has_gpu = True
    out = eng.push(lambda: "cpu saw it", reads=[y])
    assert out.wait() == "cpu saw it"
    assert synced == [y._wev.name]  # the CPU side blocked on the GPU write's event first
