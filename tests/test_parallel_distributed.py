"""Oracle across launchers: one step of PyTorch DDP over gloo (2 processes) equals the threaded Trainer."""

from __future__ import annotations

import queue
import socket

import pytest
import torch

from dlperf.devices import cpu
from dlperf.models import get_spec
from dlperf.parallel import Trainer

BATCH = 16


def _batch():
    spec = get_spec("lenet")
    torch.manual_seed(0)
    net = spec.build()
    X, y = spec.input.make_batch(BATCH, generator=torch.Generator().manual_seed(1))
    return spec, net, X, y


def _rank(rank: int, port: int, out) -> None:
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        spec, net, X, y = _batch()
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
        spec.loss(model(X[half]), y[half]).backward()
        opt.step()
        # numpy arrays travel by value; tensors would travel as shared-memory handles that die with us
        out.put((rank, [p.detach().numpy().copy() for p in net.parameters()]))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_ddp_two_processes_equals_trainer_on_two_logical_devices():
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=120) for _ in range(2))
    except queue.Empty:
        pytest.fail("DDP ranks did not report within 120 s")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        out.close()
        out.join_thread()
    assert all(p.exitcode == 0 for p in procs)

    spec, net, X, y = _batch()
    with Trainer(net, [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, loss=spec.loss) as trainer:
        trainer.train_step(X, y)
        for ours, theirs0, theirs1 in zip(trainer.module.parameters(), results[0], results[1]):
            theirs0, theirs1 = torch.from_numpy(theirs0), torch.from_numpy(theirs1)
            torch.testing.assert_close(ours.detach().contiguous(), theirs0, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(theirs0, theirs1)
