from __future__ import annotations

import pytest
import torch

from dlperf.devices import copy_to, cpu
from dlperf.errors import UsageError
from dlperf.kvstore import DeviceKVStore, KVStore, LocalKVStore, create_kvstore, kvstore_types

TYPES = ["local", "device"]


def test_types_and_constructor_spelling():
    assert set(TYPES) <= set(kvstore_types())
    assert isinstance(KVStore("local"), LocalKVStore)
    assert isinstance(KVStore("device"), DeviceKVStore)
    with pytest.raises(UsageError, match="unknown kvstore type 'dist'.*local, device"):
        KVStore("dist")


@pytest.mark.parametrize("kind", TYPES)
def test_matches_a_dict_oracle(kind):
    g = torch.Generator().manual_seed(0)
    oracle: dict = {}
    with create_kvstore(kind) as kv:
        for key in [3, "w", 7]:
            v = torch.randn(4, 3, generator=g)
            kv.init(key, v)
            oracle[key] = v.clone()
        for step in range(4):
            key = [3, "w", 7][step % 3]
            pushed = [copy_to(torch.randn(4, 3, generator=g), cpu(i)) for i in range(3)]
            kv.push(key, pushed)
            oracle[key] = sum(pushed)
            outs = [torch.empty(4, 3) for _ in range(2)]
            kv.pull(key, out=outs)
            for o in outs:
                torch.testing.assert_close(o, oracle[key])
        assert sorted(map(str, kv.keys())) == sorted(map(str, oracle))


@pytest.mark.parametrize("kind", TYPES)
def test_pushpull_in_place_and_batched_keys(kind):
    with KVStore(kind) as kv:
        kv.init([0, 1], [torch.zeros(2), torch.zeros(3)])
        a = [torch.ones(2), torch.full((2,), 2.0)]
        b = [torch.ones(3), torch.ones(3)]
        kv.pushpull([0, 1], [a, b])
        assert all(torch.equal(t, torch.full((2,), 3.0)) for t in a)
        assert all(torch.equal(t, torch.full((3,), 2.0)) for t in b)


@pytest.mark.parametrize("kind", TYPES)
def test_update_on_store_equals_torch_sgd(kind):
    w0 = torch.randn(5)
    grads = [torch.randn(5), torch.randn(5)]
    ref = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    with KVStore(kind) as kv:
        kv.set_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        kv.init("w", w0)
        for _ in range(3):
            ref.grad = grads[0] + grads[1]
            opt.step()
            kv.push("w", grads)
        out = torch.empty(5)
        kv.pull("w", out=out)
        torch.testing.assert_close(out, ref.detach())
        state = kv.state_dict()
    with KVStore(kind) as kv2:
        kv2.set_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        kv2.load_state_dict(state)
        ref.grad = grads[0] + grads[1]
        opt.step()
        kv2.push("w", grads)
        kv2.pull("w", out=out)
        torch.testing.assert_close(out, ref.detach())


def test_errors_are_clear():
    with KVStore("local") as kv:
        with pytest.raises(UsageError, match="key 9 is not initialized"):
            kv.pull(9, out=torch.empty(1))
        kv.init(9, torch.zeros(2))
        with pytest.raises(UsageError, match="already initialized"):
            kv.init(9, torch.zeros(2))
        with pytest.raises(UsageError, match="does not match the stored"):
            kv.push(9, [torch.zeros(3)])
    with pytest.raises(RuntimeError, match="closed"):
        kv.push(9, torch.zeros(2))


def test_single_process_identity():
    kv = create_kvstore("device")
    assert (kv.rank, kv.num_workers) == (0, 1)
