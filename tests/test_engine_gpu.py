"""GPU paths of the engine: streams, events, copy lanes. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from dlperf.devices import cpu, gpu
from dlperf.engine import array as dnp
from dlperf.engine import create_engine

pytestmark = pytest.mark.gpu


def test_gpu_results_match_cpu_reference():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(256, 256, generator=g)
    with create_engine() as eng:
        x = dnp.array(t, device=gpu(0), engine=eng)
        ys = [x.dot(x) + i for i in range(5)]
        back = [y.copyto(cpu(0)) for y in ys]  # copy lane, waits on the compute stream's events
        for i, b in enumerate(back):
            torch.testing.assert_close(b.tensor(), t @ t + i, rtol=1e-3, atol=1e-3)
        assert {"gpu(0)/compute", "gpu(0)/copy"} <= set(eng.workers)


def test_write_after_read_across_streams():
    # The copy stream reads x; a later in-place write on the compute stream must wait for it.
    with create_engine() as eng:
        x = dnp.ones((2048, 2048), device=gpu(0), engine=eng)
        snapshot = x.copyto(cpu(0))
        x += 1
        assert snapshot.tensor().max().item() == 1.0
        assert x.copyto(cpu(0)).tensor().min().item() == 2.0


def test_cpu_op_reading_gpu_result_waits_for_the_event():
    with create_engine() as eng:
        x = dnp.ones((1024, 1024), device=gpu(0), engine=eng)
        y = (x * 3).copyto(cpu(0))
        z = y + 1  # runs on the CPU worker: must see the finished copy
        assert z.tensor().min().item() == 4.0


def test_naive_engine_on_gpu():
    with create_engine("naive") as eng:
        x = dnp.ones(4, device=gpu(0), engine=eng)
        assert (x * 2).copyto(cpu(0)).tolist() == [2.0] * 4


def test_cpu_and_gpu_work_overlap_in_the_trace():
    with create_engine(trace=True) as eng:
        xc = dnp.random.uniform(size=(500, 500), engine=eng)
        xg = dnp.random.uniform(size=(2000, 2000), device=gpu(0), engine=eng)
        eng.waitall()
        eng.start_trace()
        for _ in range(10):
            xc.dot(xc)
            xg.dot(xg)
        eng.waitall()
        s = eng.stop_trace().summary()
    assert {w.worker for w in s.workers} >= {"cpu(0)/compute", "gpu(0)/compute"}
