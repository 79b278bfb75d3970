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
        for key in [3, 5, 7]:
            v = torch.randn(4, 3, generator=g)
            kv.init(key, v)
            oracle[key] = v.clone()
        for step in range(4):
            key = [3, 5, 7][step % 3]
            pushed = [copy_to(torch.randn(4, 3, generator=g), cpu(i)) for i in range(3)]
            kv.push(key, pushed)
            oracle[key] = sum(pushed)
            outs = [torch.empty(4, 3) for _ in range(2)]
            kv.pull(key, out=outs)
            for o in outs:
                torch.testing.assert_close(o, oracle[key])
        assert sorted(kv.keys()) == sorted(oracle)


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


@pytest.mark.parametrize("kind", TYPES)
def test_set_updater_is_called_with_key_received_stored(kind):
    calls = []

    def scaled_accumulate(key, received, stored):
        calls.append((key, received.clone(), stored.clone()))
        stored += 0.5 * received

    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(3, generator=g)
    expected = w0.clone()
    with KVStore(kind) as kv:
        kv.set_updater(scaled_accumulate)
        kv.init(4, w0)
        for _ in range(3):
            grads = [torch.randn(3, generator=g) for _ in range(2)]
            kv.push(4, grads)
            expected += 0.5 * (grads[0] + grads[1])
        out = torch.empty(3)
        kv.pull(4, out=out)
    torch.testing.assert_close(out, expected)
    assert [c[0] for c in calls] == [4, 4, 4]
    torch.testing.assert_close(calls[0][2], w0)  # the stored value before the first update


def test_set_updater_and_set_optimizer_replace_each_other():
    with KVStore("local") as kv:
        kv.set_updater(lambda k, r, s: s.add_(r))
        kv.set_optimizer(lambda ps: torch.optim.SGD(ps, lr=1.0))
        kv.init(0, torch.zeros(2))
        kv.push(0, torch.ones(2))
        out = torch.empty(2)
        kv.pull(0, out=out)
        assert out.tolist() == [-1.0, -1.0]  # SGD's step, not the updater's sum
        with pytest.raises(UsageError, match="set_updater needs a callable"):
            kv.set_updater("add")


@pytest.mark.parametrize("kind", TYPES)
def test_broadcast_inits_and_fills_every_out(kind):
    value = torch.arange(6.0).reshape(2, 3)
    outs = [torch.zeros(2, 3), torch.zeros(2, 3)]
    with KVStore(kind) as kv:
        kv.broadcast("w", value, out=outs)
        assert all(torch.equal(o, value) for o in outs)
        with pytest.raises(UsageError, match="already initialized"):
            kv.broadcast("w", value, out=outs)


@pytest.mark.parametrize("out_shape", [(3,), (1, 3), (2, 3, 1), (6,)])
def test_pull_into_a_different_shape_names_both_shapes(out_shape):
    with KVStore("local") as kv:
        kv.init(1, torch.ones(2, 3))
        out = torch.full(out_shape, 7.0)
        with pytest.raises(UsageError) as info:
            kv.pull(1, out=out)
        message = str(info.value)
        assert "\n" not in message
        assert str(tuple(out_shape)) in message and "(2, 3)" in message
        assert torch.all(out == 7.0)  # nothing was written


def test_mixed_int_and_str_keys_raise():
    with KVStore("local") as kv:
        kv.init(1, torch.ones(1))
        with pytest.raises(UsageError, match="key 'w' is a str but this store's keys are ints"):
            kv.init("w", torch.ones(1))
    with KVStore("local") as kv:
        kv.init("w", torch.ones(1))
        with pytest.raises(UsageError, match="key 2 is an int but this store's keys are strs"):
            kv.init([2], [torch.ones(1)])
        for bad in (1.5, True, None):
            with pytest.raises(UsageError, match="expected an int or a str"):
                kv.init(bad, torch.ones(1))


def test_save_and_load_round_trip_through_a_file(tmp_path):
    path = tmp_path / "kv.pt"
    with KVStore("local") as kv:
        kv.set_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        kv.init(0, torch.ones(3))
        kv.push(0, torch.ones(3))
        kv.save(path)
        kv.push(0, torch.ones(3))
        want = torch.empty(3)
        kv.pull(0, out=want)
    with KVStore("local") as kv2:
        kv2.set_optimizer(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
        kv2.load(path)
        kv2.push(0, torch.ones(3))
        got = torch.empty(3)
        kv2.pull(0, out=got)
    torch.testing.assert_close(got, want)  # momentum came back too
    path.write_bytes(b"not a checkpoint")
    with KVStore("local") as kv3, pytest.raises(UsageError, match="kvstore state"):
        kv3.load(path)


@pytest.mark.parametrize("state", [{"values": {0: [1.0]}, "optimizers": {}},
                                   {"values": {1.5: torch.ones(1)}, "optimizers": {}},
                                   {"values": {0: torch.ones(1)}, "optimizers": {0: [1]}},
                                   {"values": []}])
def test_load_refuses_a_file_of_the_wrong_shape(tmp_path, state):
    path = tmp_path / "odd.pt"
    torch.save(state, path)
    with KVStore("local") as kv, pytest.raises(UsageError, match="is not a file written by KVStore.save"):
        kv.load(path)


@pytest.mark.parametrize("call", ["init", "push", "pull"])
@pytest.mark.parametrize("key,value,needle", [
    (("tuple", object()), lambda: torch.ones(3), "got key <object object at"),
    (["a", "b"], lambda: torch.ones(3), "got 2 keys and a Tensor"),
    (["a", "b"], lambda: [torch.ones(3)], "got 2 keys and 1 values"),
    ([1.5], lambda: [torch.ones(3)], "got key 1.5 of type float"),
    ([None], lambda: [torch.ones(3)], "got key None of type NoneType"),
])
def test_bad_keys_and_value_lists_are_one_usage_error(call, key, value, needle):
    with KVStore("local") as kv:
        if call != "init":
            kv.init(["a", "b"], [torch.zeros(3), torch.zeros(3)])
        with pytest.raises(UsageError) as info:
            getattr(kv, call)(key, value())
        assert needle in str(info.value) and call in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("kind", ["local", "device"])
def test_dtypes_are_checked_on_push_and_pull_naming_key_and_both_dtypes(kind):
    with KVStore(kind) as kv:
        kv.init("w", torch.zeros(3))
        with pytest.raises(UsageError, match=r"push to key 'w': dtype torch.float64 does not match the stored "
                                             r"torch.float32"):
            kv.push("w", torch.ones(3, dtype=torch.float64))
        out = torch.full((3,), 7, dtype=torch.int64)
        with pytest.raises(UsageError, match=r"pull from key 'w': dtype torch.int64 does not match the stored "
                                             r"torch.float32"):
            kv.pull("w", out=out)
        assert out.tolist() == [7, 7, 7]  # nothing was written
        with pytest.raises(UsageError, match="dtype torch.float64"):
            kv.push_async("w", torch.ones(3, dtype=torch.float64))
        kv.push("w", torch.ones(3))  # the matching dtype still works, and gives the oracle's value
        got = torch.empty(3)
        kv.pull("w", out=got)
        assert got.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("where", ["a directory", "a missing parent's file"])
def test_save_fails_with_the_error_of_the_one_torch_writer(tmp_path, where):
    """KVStore.save and a checkpoint write through _io.save_torch alike: its one-line error, unwrapped."""
    from dlperf._io import FileAccessError, save_torch

    path = tmp_path if where == "a directory" else tmp_path / "file" / "kv.pt"
    if where != "a directory":
        (tmp_path / "file").write_text("not a directory")
    with pytest.raises(FileAccessError) as expected:
        save_torch(path, {"w": torch.zeros(2)})
    with KVStore("local") as kv:
        kv.init("w", torch.zeros(2))
        with pytest.raises(FileAccessError) as got:
            kv.save(path)
    assert str(got.value) == str(expected.value) and "\n" not in str(got.value)
    assert got.value.errno == expected.value.errno


@pytest.mark.subprocess
def test_save_onto_a_full_disk_is_one_error_and_keeps_the_previous_file(tmp_path):
    """Fault injection: the file system fills up while the state is written (RLIMIT_FSIZE in a child process
    turns the write past 64 KiB into EFBIG, as a full disk turns it into ENOSPC)."""
    import subprocess
    import sys

    path = tmp_path / "kv.pt"
    with KVStore("local") as kv:
        kv.init("w", torch.arange(4.0))
        kv.save(path)
    before = path.read_bytes()
    child = f"""
import resource, signal, sys, torch
from dlperf.kvstore import KVStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
with KVStore("local") as kv:
    kv.init("w", torch.zeros(1_000_000))
    try:
        kv.save({str(path)!r})
    except OSError as exc:
        print(type(exc).__name__, exc)
        sys.exit(3)
"""
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    line = proc.stdout.strip()
    assert "\n" not in line and str(path) in line and "Traceback" not in proc.stderr, (line, proc.stderr)
    assert path.read_bytes() == before  # the previous file is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv.pt"]  # and no temporary is left
