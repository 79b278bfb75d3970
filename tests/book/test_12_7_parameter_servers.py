"""d2l 12.7 (parameter servers) worked through with dlperf's KVStore, as a reader would write it.

The book's store is MXNet's ``mx.kv.create(...)``; dlperf spells it ``KVStore(...)`` or
``create_kvstore(...)`` with the same verbs: ``init``, ``push``, ``pull``, ``pushpull``, ``set_optimizer``
and MXNet's custom updater as ``set_updater``. Logical CPU devices (``cpu(0)``, ``cpu(1)``, ...) stand
in for the book's GPUs.
"""

from __future__ import annotations

import pytest
import torch

from dlperf.devices import copy_to, cpu
from dlperf.kvstore import KVStore, create_kvstore
from dlperf.parallel.launchers import ProcessLauncher

SHAPE = (2, 3)
DEVICES = [cpu(i) for i in range(4)]


def test_init_then_pull_gives_back_the_initial_value():
    with KVStore("local") as kv:
        kv.init(3, torch.ones(SHAPE) * 2)
        a = torch.zeros(SHAPE)
        kv.pull(3, out=a)
    assert torch.equal(a, torch.full(SHAPE, 2.0))


def test_push_replaces_the_value_and_pull_reads_it():
    with KVStore("local") as kv:
        kv.init(3, torch.ones(SHAPE) * 2)
        kv.push(3, torch.ones(SHAPE) * 8)
        a = torch.zeros(SHAPE)
        kv.pull(3, out=a)
    assert torch.equal(a, torch.full(SHAPE, 8.0))


@pytest.mark.parametrize("kind", ["local", "device"])
def test_push_from_several_devices_is_their_sum(kind):
    # (12.7.1): g_i = sum over GPUs j of g_ij, here four logical devices each pushing ones
    with KVStore(kind) as kv:
        kv.init(3, torch.ones(SHAPE) * 2)
        kv.push(3, [copy_to(torch.ones(SHAPE), d) for d in DEVICES])
        a = torch.zeros(SHAPE)
        kv.pull(3, out=a)
    assert torch.equal(a, torch.full(SHAPE, 4.0))


def test_pull_to_every_device():
    with KVStore("device") as kv:
        kv.init(3, torch.arange(6.0).reshape(SHAPE))
        outs = [copy_to(torch.zeros(SHAPE), d) for d in DEVICES]
        kv.pull(3, out=outs)
    assert all(torch.equal(o, torch.arange(6.0).reshape(SHAPE)) for o in outs)


def test_each_parameter_aggregated_separately():
    # 12.7.1: four parameter vectors v1..v4, each one's gradients summed on its own (a key per vector)
    g = torch.Generator().manual_seed(0)
    grads = {i: [torch.randn(5, generator=g) for _ in DEVICES] for i in range(4)}
    with KVStore("device") as kv:
        kv.init(list(grads), [torch.zeros(5) for _ in grads])
        kv.push(list(grads), [[copy_to(x, d) for x, d in zip(gs, DEVICES, strict=True)] for gs in grads.values()])
        outs = [torch.empty(5) for _ in grads]
        kv.pull(list(grads), out=outs)
    for out, gs in zip(outs, grads.values(), strict=True):
        torch.testing.assert_close(out, sum(gs))


def test_a_custom_updater_merges_pushes_into_the_stored_value():
    # MXNet's updater(key, input, stored): here the stored value grows by twice what is pushed
    def update(key, received, stored):
        stored += received * 2

    with KVStore("local") as kv:
        kv.set_updater(update)
        kv.init(3, torch.ones(SHAPE) * 2)
        kv.push(3, [torch.ones(SHAPE) for _ in DEVICES])
        a = torch.zeros(SHAPE)
        kv.pull(3, out=a)
    assert torch.equal(a, torch.full(SHAPE, 2.0 + 2 * 4))


def test_pushpull_sums_and_returns_in_place():
    grads = [copy_to(torch.full(SHAPE, float(i + 1)), d) for i, d in enumerate(DEVICES)]
    with create_kvstore("device") as kv:
        kv.init("w", torch.zeros(SHAPE))
        kv.pushpull("w", grads)
    assert all(torch.equal(x, torch.full(SHAPE, 10.0)) for x in grads)


def test_update_on_the_store_with_an_optimizer():
    # push gradients, pull weights: the store runs SGD on the summed gradient
    with KVStore("local") as kv:
        kv.set_optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
        kv.init("w", torch.ones(3))
        kv.push("w", [torch.ones(3), torch.ones(3)])
        w = torch.empty(3)
        kv.pull("w", out=w)
    torch.testing.assert_close(w, torch.full((3,), 1 - 0.1 * 2))


def test_one_process_is_worker_zero_of_one():
    with KVStore("local") as kv:
        assert (kv.rank, kv.num_workers) == (0, 1)


def _two_machines() -> list[float]:
    # every worker runs this: 2 workers, 2 devices each, one key
    kv = create_kvstore("dist_sync")
    kv.init(0, torch.zeros(3))
    g = [torch.full((3,), 10.0 * kv.rank + j) for j in range(2)]  # g_ijk for worker k, device j
    kv.push(0, g)
    out = torch.empty(3)
    kv.pull(0, out=out)
    kv.close()
    return out.tolist()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sum_over_workers_and_devices():
    # (12.7.2): g_i = sum over workers k and GPUs j of g_ijk; (0 + 1) + (10 + 11) = 22 on every worker
    assert ProcessLauncher(2, join_timeout_s=90).launch(_two_machines) == [[22.0] * 3, [22.0] * 3]
