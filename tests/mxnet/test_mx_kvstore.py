"""What MXNet 1.9.1's tests/python/unittest/test_kvstore.py expects, asked of dlperf's single-process stores.

MXNet's store is ``mx.kv.create()`` (``local``); dlperf's is ``create_kvstore("local")``. Logical CPU devices
stand in for MXNet's ``mx.Context('cpu', i)``. Besides MXNet's own cases, the store is checked against a
dict on random inputs (the project's oracle for a store), and against MXNet's custom updater.
"""

from __future__ import annotations

import pytest
import torch

from dlperf.devices import copy_to, cpu
from dlperf.errors import UsageError
from dlperf.kvstore import KVStore, create_kvstore, kvstore_types

SHAPE = (4, 4)
KEYS = [5, 7, 11]
STR_KEYS = ["b", "c", "d"]
DEVICES = [cpu(i) for i in range(4)]


def _init_kv(str_keys: bool = False) -> KVStore:
    kv = create_kvstore()
    single, keys = ("a", STR_KEYS) if str_keys else (3, KEYS)
    kv.init(single, torch.zeros(SHAPE))
    kv.init(keys, [torch.zeros(SHAPE)] * len(keys))
    return kv


def _all(t: torch.Tensor, value: float) -> bool:
    return bool((t == value).all())


@pytest.mark.parametrize("str_keys", [False, True])
def test_single_kv_pair(str_keys):
    with _init_kv(str_keys) as kv:
        key = "a" if str_keys else 3
        kv.push(key, torch.ones(SHAPE))
        val = torch.empty(SHAPE)
        kv.pull(key, out=val)
        assert _all(val, 1)


@pytest.mark.parametrize("key", [3, "a"])
def test_init(key):
    with create_kvstore() as kv:
        kv.init(key, torch.ones(SHAPE) * 4)
        a = torch.zeros(SHAPE)
        kv.pull(key, out=a)
        assert _all(a, 4)


@pytest.mark.parametrize("str_keys", [False, True])
def test_list_kv_pair(str_keys):
    keys = STR_KEYS if str_keys else KEYS
    with _init_kv(str_keys) as kv:
        kv.push(keys, [torch.ones(SHAPE) * 4] * len(keys))
        val = [torch.empty(SHAPE)] * len(keys)  # one tensor pulled into three times, as MXNet's test does
        kv.pull(keys, out=val)
        for v in val:
            assert _all(v, 4)


@pytest.mark.parametrize("str_keys", [False, True])
def test_aggregator(str_keys):
    key, keys = ("a", STR_KEYS) if str_keys else (3, KEYS)
    with _init_kv(str_keys) as kv:
        vals = [copy_to(torch.ones(SHAPE), d) for d in DEVICES]
        kv.push(key, vals)
        kv.pull(key, out=vals)  # into the very tensors pushed
        for v in vals:
            assert _all(v, len(DEVICES))
        # the same list of per-device values for every key (MXNet's `[[...]] * len(keys)`)
        vals = [[copy_to(torch.ones(SHAPE) * 2.0, d) for d in DEVICES]] * len(keys)
        kv.push(keys, vals)
        kv.pull(keys, out=vals)
        for vv in vals:
            for v in vv:
                assert _all(v, len(DEVICES) * 2.0)


def _plus_equals(key, recv, local):
    """MXNet's test updater: ``local += recv``."""
    local += recv


@pytest.mark.parametrize("str_keys", [False, True])
def test_updater(str_keys):
    key, keys = ("a", STR_KEYS) if str_keys else (3, KEYS)
    with _init_kv(str_keys) as kv:
        kv.set_updater(_plus_equals)
        vals = [copy_to(torch.ones(SHAPE), d) for d in DEVICES]
        kv.push(key, vals)
        kv.pull(key, out=vals)
        for v in vals:
            assert _all(v, len(DEVICES))
        vals = [[copy_to(torch.ones(SHAPE), d) for d in DEVICES]] * len(keys)
        num_push = 4
        for _ in range(num_push):
            kv.push(keys, vals)
        kv.pull(keys, out=vals)
        for vv in vals:
            for v in vv:
                assert _all(v, len(DEVICES) * num_push)


@pytest.mark.parametrize("alias,made", [("local_allreduce_cpu", "LocalKVStore"), ("local_update_cpu", "LocalKVStore"),
                                        ("local_allreduce_device", "DeviceKVStore"),
                                        ("LOCAL_ALLREDUCE_CPU", "LocalKVStore")])
def test_get_type(alias, made):
    for kv in (create_kvstore(alias), KVStore(alias)):
        with kv:
            assert kv.type == alias.lower()
            assert type(kv).__name__ == made
            kv.init(0, torch.zeros(2))
            kv.push(0, [torch.ones(2), torch.ones(2)])
            out = torch.empty(2)
            kv.pull(0, out=out)
            assert out.tolist() == [2.0, 2.0]


def test_aliases_are_accepted_but_not_listed_as_types():
    assert "local_allreduce_cpu" not in kvstore_types() and "local" in kvstore_types()
    with pytest.raises(UsageError, match="unknown kvstore type 'local_allreduce_gpu'; valid choices: .*local"):
        create_kvstore("local_allreduce_gpu")


# -- the store against a dict, on random inputs -----------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["local", "device"])
def test_pushes_and_pulls_agree_with_a_dict(seed, kind):
    g = torch.Generator().manual_seed(seed)
    shapes = {k: tuple(int(d) for d in torch.randint(1, 6, (int(torch.randint(1, 4, (1,), generator=g)),),
                                                     generator=g)) for k in range(5)}
    reference: dict[int, torch.Tensor] = {}
    with create_kvstore(kind) as kv:
        for k, shape in shapes.items():
            reference[k] = torch.randn(shape, generator=g)
            kv.init(k, reference[k].clone())
        for _ in range(12):
            keys = sorted(torch.randperm(5, generator=g)[:int(torch.randint(1, 5, (1,), generator=g))].tolist())
            devices = int(torch.randint(1, 4, (1,), generator=g))
            values = [[torch.randn(shapes[k], generator=g) for _ in range(devices)] for k in keys]
            pushed = [[v.clone() for v in vs] for vs in values]
            if len(keys) > 1:
                kv.push(keys, values)
            else:
                kv.push(keys[0], values[0])
            for k, vs in zip(keys, values):
                reference[k] = torch.stack(vs).sum(0)
            for vs, before in zip(values, pushed):  # the pushed tensors are read, never written
                for v, b in zip(vs, before):
                    assert torch.equal(v, b)
            outs = [[torch.empty(shapes[k]) for _ in range(2)] for k in keys]
            kv.pull(keys, out=outs)
            for k, os_ in zip(keys, outs):
                for o in os_:
                    torch.testing.assert_close(o, reference[k], rtol=1e-6, atol=1e-6)


def test_a_bad_key_in_a_batched_push_leaves_every_key_as_it_was():
    with create_kvstore("local") as kv:
        kv.init([0, 1], [torch.zeros(3), torch.zeros(2)])
        with pytest.raises(UsageError, match="push to key 1: shape \\(3,\\) does not match the stored \\(2,\\)"):
            kv.push([0, 1], [torch.ones(3), torch.ones(3)])
        out = torch.empty(3)
        kv.pull(0, out=out)
        assert out.tolist() == [0.0, 0.0, 0.0]


def test_a_push_of_tensors_that_require_grad_sums_their_values():
    with create_kvstore("local") as kv:
        kv.init(0, torch.zeros(2))
        w = torch.ones(2, requires_grad=True)
        kv.push(0, [w, w * 2])
        out = torch.zeros(2, requires_grad=True)
        kv.pull(0, out=out)
        assert out.tolist() == [3.0, 3.0]


# -- the store's optimizer, for learning-rate schedules ----------------------------------------------------
def test_a_scheduler_on_the_stores_optimizer_sets_every_keys_rate():
    with create_kvstore("local") as kv:
        kv.set_optimizer(lambda ps: torch.optim.SGD(ps, lr=1.0))
        kv.init([0, 1], [torch.zeros(2), torch.zeros(3)])
        scheduler = torch.optim.lr_scheduler.StepLR(kv.optimizer, step_size=1, gamma=0.5)
        for _ in range(3):
            kv.push([0, 1], [torch.ones(2), torch.ones(3)])
            scheduler.step()
        out = torch.empty(3)
        kv.pull(1, out=out)
        assert out.tolist() == pytest.approx([-(1.0 + 0.5 + 0.25)] * 3)
        kv.init(2, torch.zeros(1))  # a key made later joins the group
        assert len(kv.optimizer.param_groups) == 3


def test_the_stores_optimizer_needs_set_optimizer():
    with create_kvstore("local") as kv, pytest.raises(UsageError, match="call set_optimizer"):
        kv.optimizer  # noqa: B018


def test_reset_gives_new_values_and_drops_momentum_but_keeps_the_rate():
    with create_kvstore("local") as kv:
        kv.set_optimizer(lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.5))
        kv.init(0, torch.zeros(2))
        kv.push(0, torch.ones(2))
        kv.optimizer.param_groups[0]["lr"] = 0.5
        kv.reset(0, torch.full((2,), 10.0))
        kv.push(0, torch.ones(2))
        out = torch.empty(2)
        kv.pull(0, out=out)
        assert out.tolist() == [9.5, 9.5]  # 10 - 0.5 * 1: no velocity carried over
        with pytest.raises(UsageError, match="key 9 is not initialized"):
            kv.reset(9, torch.zeros(2))
