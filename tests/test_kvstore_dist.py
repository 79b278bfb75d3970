"""Distributed KVStores with real processes: gloo on 127.0.0.1 through the ProcessLauncher.

Each launch costs seconds (fresh interpreters import torch), so one launch per configuration does all
the work in its workers and returns plain data; the tests assert on that against a plain dict oracle
that every worker can compute (the values each worker pushes come from a seed per step and worker).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from dlperf._shm import ShmUnavailableError, mapped_segments
from dlperf.cli import main
from dlperf.errors import UsageError
from dlperf.kvstore import KVStore, Placement, create_kvstore, kvstore_types
from dlperf.kvstore.control import MAX_FRAME_BYTES, ControlClient, ControlServer, KVStoreLinkError
from dlperf.kvstore.shm import SHM_ENV, Arena, shm_wanted
from dlperf.parallel.launchers import ProcessLauncher

JOIN_S = 90
KEYS = [3, 11, 12, 40, 41, 57, 90, 123]  # int keys, small: hashed over the servers
BIG = 2_500  # elements; the tests set big_array_bound below it so BIG splits over every server


def _value(step: int, worker: int, key: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * step + 7919 * worker + key)
    return torch.randn(numel, generator=g)


def _numel(key: int) -> int:
    return BIG if key == KEYS[-1] else 1 + key % 5


def _worker_group(num_servers: int):
    """A process group of the workers alone, made on every rank (new_group is collective)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    return dist.new_group(ranks=list(range(world - num_servers)))


# --- worker functions (top level: spawned processes import them) -----------------------------------

def _sync_worker(num_servers: int, ckpt: str) -> dict:
    import torch.distributed as dist

    workers = _worker_group(num_servers)
    kv = create_kvstore("dist_sync", num_servers=num_servers, big_array_bound=BIG - 1)
    if kv.role == "server":
        kv.serve()
        kv.close()
        # every store is created by every rank: the server takes part in the later rounds too
        _updater_round(num_servers)
        _checkpoint_round(num_servers, ckpt, workers)
        return {"role": "server"}
    out: dict = {"role": "worker", "rank": kv.rank, "num_workers": kv.num_workers}
    n = kv.num_workers
    init = {k: _value(-1, 0, k, _numel(k)) for k in KEYS}
    kv.init(KEYS, [init[k] for k in KEYS])
    oracle: dict[int, torch.Tensor] = {}
    errors = []
    for step in range(4):
        # each step pushes a random subset of keys, two devices' values per key, in one batched call
        chosen = [k for k in KEYS if _value(step, 99, k, 1).item() > -0.3]
        pushes = [[_value(step, kv.rank, k, _numel(k)), _value(step, kv.rank + 50, k, _numel(k))] for k in chosen]
        if step % 2:
            kv.push(chosen, pushes)
            outs = [torch.empty(_numel(k)) for k in chosen]
            kv.pull(chosen, out=outs)
        else:
            outs = [torch.empty(_numel(k)) for k in chosen]
            ops = [kv.pushpull_async(k, p, out=o) for k, p, o in zip(chosen, pushes, outs, strict=True)]
            for op in ops:
                op.wait()
        for k, o in zip(chosen, outs, strict=True):
            oracle[k] = sum(_value(step, w, k, _numel(k)) + _value(step, w + 50, k, _numel(k)) for w in range(n))
            errors.append((o - oracle[k]).abs().max().item())
    untouched = [k for k in KEYS if k not in oracle]
    for k in untouched:
        o = torch.empty(_numel(k))
        kv.pull(k, out=o)
        errors.append((o - init[k]).abs().max().item())
    out["max_error"] = max(errors)
    out["pulls"] = len(errors)
    out["placement"] = {k: [(s.server, s.start, s.stop) for s in v] for k, v in kv.placement().keys.items()}
    out["placement_text"] = str(kv.placement())
    out["errors"] = _bad_inputs(kv)
    out["traffic"] = kv.traffic()
    kv.close()
    out["updater"] = _updater_round(num_servers)
    out["checkpoint"] = _checkpoint_round(num_servers, ckpt, workers)
    dist.barrier(workers)
    return out


def _bad_inputs(kv: KVStore) -> dict:
    found = {}
    for name, call in {
        "pull_shape": lambda: kv.pull(KEYS[0], out=torch.empty(2, _numel(KEYS[0]))),
        "push_shape": lambda: kv.push(KEYS[0], torch.empty(_numel(KEYS[0]) + 1)),
        "str_key": lambda: kv.init("w", torch.zeros(1)),
        "uninitialized": lambda: kv.pull(7, out=torch.empty(1)),
        "serve_on_worker": lambda: kv.serve(),
        "count": lambda: kv.push([KEYS[0], KEYS[1]], [torch.zeros(_numel(KEYS[0]))]),
    }.items():
        try:
            call()
            found[name] = None
        except UsageError as exc:
            found[name] = str(exc)
    return found


def _accumulate(key, received, stored):
    stored += 0.5 * received


def _updater_round(num_servers: int) -> list[float]:
    kv = create_kvstore("dist_device_sync", num_servers=num_servers, big_array_bound=BIG - 1)
    kv.set_updater(_accumulate)
    if kv.role == "server":
        kv.serve()
        kv.close()
        return []
    kv.init("w", torch.ones(4))
    for _ in range(3):
        kv.push("w", [torch.full((4,), float(kv.rank + 1)), torch.ones(4)])
    out = torch.empty(4)
    kv.pull("w", out=out)
    kv.close()
    return out.tolist()


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _checkpoint_round(num_servers: int, path: str, workers) -> dict:
    import torch.distributed as dist

    grads = [_value(s, 0, 1, BIG) for s in range(5)]
    kv = create_kvstore("dist_sync", num_servers=num_servers, big_array_bound=BIG - 1)
    kv.set_optimizer(_sgd)
    if kv.role == "server":
        kv.serve()
        kv.close()
        kv2 = create_kvstore("dist_sync", num_servers=num_servers, big_array_bound=BIG - 1)
        kv2.set_optimizer(_sgd)
        kv2.serve()
        kv2.close()
        return {}
    w0 = _value(-1, 0, 1, BIG)
    kv.init(0, w0)
    for g in grads[:3]:
        kv.push(0, g)
    if kv.rank == 0:
        kv.save(path)
    state = kv.state_dict()
    for g in grads[3:]:
        kv.push(0, g)
    first = torch.empty(BIG)
    kv.pull(0, out=first)
    kv.close()
    dist.barrier(workers)  # the file is written before anyone reads it
    kv2 = create_kvstore("dist_sync", num_servers=num_servers, big_array_bound=BIG - 1)
    kv2.set_optimizer(_sgd)
    kv2.load(path)
    for g in grads[3:]:
        kv2.push(0, g)
    second = torch.empty(BIG)
    kv2.pull(0, out=second)
    kv2.close()
    # the reference: plain torch SGD on the sum of every worker's gradient
    ref = torch.nn.Parameter(w0.clone())
    opt = _sgd([ref])
    n = dist.get_world_size(workers)
    for g in grads:
        ref.grad = n * g
        opt.step()
    return {"resumed_error": (second - first).abs().max().item(),
            "sgd_error": (first - ref.detach()).abs().max().item(),
            "parts": state["parts"][0], "momentum_parts": sorted(state["optimizers"][0])}


def _async_worker(num_servers: int, staleness: int | None) -> dict:
    import torch.distributed as dist

    workers = _worker_group(num_servers)
    kv = create_kvstore("dist_async", num_servers=num_servers, staleness=staleness, big_array_bound=BIG - 1)
    kv.set_updater(_accumulate)
    if kv.role == "server":
        kv.serve()
        kv.close()
        if num_servers:
            _mismatched_updater_round(num_servers)
        return {"role": "server"}
    n = kv.num_workers
    init = {k: _value(-1, 0, k, _numel(k)) for k in KEYS}
    kv.init(KEYS, [init[k] for k in KEYS])
    result: dict = {"role": "worker", "rank": kv.rank}
    if staleness is None:
        # rank 0 pushes and pulls before rank 1 pushes at all: an async store answers at once
        probe = torch.empty(_numel(KEYS[0]))
        if kv.rank == 0:
            kv.push(KEYS[0], torch.ones(_numel(KEYS[0])))
            kv.pull(KEYS[0], out=probe)
        dist.barrier(workers)
        if kv.rank != 0:
            kv.push(KEYS[0], torch.ones(_numel(KEYS[0])))
        result["early_pull"] = (probe - init[KEYS[0]]).tolist() if kv.rank == 0 else None
    else:
        # rank 1 comes late; with staleness 0 rank 0's pull waits for it
        probe = torch.empty(_numel(KEYS[0]))
        if kv.rank != 0:
            time.sleep(0.5)
        kv.push(KEYS[0], torch.ones(_numel(KEYS[0])))
        kv.pull(KEYS[0], out=probe)
        result["early_pull"] = (probe - init[KEYS[0]]).tolist()
    steps = 3
    for step in range(steps):
        kv.push(KEYS, [_value(step, kv.rank, k, _numel(k)) for k in KEYS])
    dist.barrier(workers)
    outs = [torch.empty(_numel(k)) for k in KEYS]
    kv.pull(KEYS, out=outs)
    errors = []
    for k, o in zip(KEYS, outs, strict=True):
        want = init[k] + 0.5 * sum(_value(s, w, k, _numel(k)) for s in range(steps) for w in range(n))
        if k == KEYS[0]:
            want = want + 0.5 * n
        errors.append((o - want).abs().max().item())
    result["max_error"] = max(errors)
    kv.close()
    if num_servers:
        result["mismatch"] = _mismatched_updater_round(num_servers)
    return result


def _mismatched_updater_round(num_servers: int) -> str | None:
    """Workers merge by an updater, the server process by assignment: init must say so and name it."""
    kv = create_kvstore("dist_sync", num_servers=num_servers)
    if kv.role == "server":
        kv.serve()  # no set_updater here
        kv.close()
        return None
    kv.set_updater(_accumulate)
    try:
        kv.init(0, torch.zeros(2))
    except UsageError as exc:
        return str(exc)
    finally:
        kv.close()
    return None


# --- the same-host path: shared memory and the control channel -----------------------------------------

FAST_KEYS = {"a": 270_000, "b": 270_000, "c": 20_000, "s": 10}  # 1.08 MB, 1.08 MB, 80 KB, 40 B


def _fast_value(seed: int, step: int, worker: int, key: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1_000_003 * step + 7919 * worker + ord(key))
    return torch.randn(FAST_KEYS[key], generator=g)


def _fast_store_round(kind: str, seed: int, setting: str, workers) -> dict | None:
    """2 workers and a server process; returns each step's pulls and which paths the bytes took."""
    from dlperf.kvstore.shm import SHM_ENV

    os.environ[SHM_ENV] = setting  # every rank, the server included, before the store is made
    try:
        kv = create_kvstore(kind, num_servers=1)
    finally:
        del os.environ[SHM_ENV]
    if kind == "dist_async":
        kv.set_updater(_accumulate)
    if kv.role == "server":
        kv.serve()
        kv.close()
        return None
    keys = list(FAST_KEYS)
    kv.init(keys, [_fast_value(seed, -1, 0, k) for k in keys])
    pulls = []
    for step in range(3):
        pushes = [_fast_value(seed, step, kv.rank, k) for k in keys]
        outs = [torch.empty(FAST_KEYS[k]) for k in keys]
        if step < 2:
            kv.pushpull(keys, pushes, out=outs)  # several whole keys on one server: the pipelined form
        else:
            kv.push(keys, pushes)
            kv.pull(keys, out=outs)
        pulls.append(outs)
    if kind == "dist_async":
        import torch.distributed as dist

        dist.barrier(workers)  # every push has arrived: the final value does not depend on their order
        final = [torch.empty(FAST_KEYS[k]) for k in keys]
        kv.pull(keys, out=final)
        pulls = [final]
    traffic = kv.traffic()
    kv.close()
    return {"pulls": pulls, "traffic": traffic}


def _fast_worker(seed: int) -> dict:
    """The same pushes through the same-host path and through RPC only, for dist_sync and dist_async."""
    import torch.distributed as dist

    from dlperf._shm import mapped_segments

    workers = dist.new_group([0, 1])
    runs = {f"{kind} {setting}": _fast_store_round(kind, seed, setting, workers)
            for kind in ("dist_sync", "dist_async") for setting in ("on", "off")}
    threads = [t.name for t in threading.enumerate() if "control" in t.name]
    return {"rank": dist.get_rank(), "runs": runs, "segments_left": mapped_segments(), "control_threads": threads}


def _server_dies_worker() -> None:
    """The server process exits while worker 0 waits in a sync pushpull over the control channel."""
    kv = create_kvstore("dist_sync", num_servers=1)
    if kv.role == "server":
        threading.Timer(2.0, os._exit, args=(3,)).start()
        kv.serve()
        return
    kv.init("w", torch.zeros(100_000))
    if kv.rank == 0:
        kv.pushpull("w", torch.ones(100_000))  # waits for rank 1's push, which never comes
    time.sleep(120)  # rank 1 idles until the launcher ends it


def _double_accumulate(key, received, stored):
    stored += 2 * received  # every true value is an even multiple of what is pushed


def _slot_sharing_worker() -> dict | None:
    """dist_async, same host: one thread pulls a key while another pushes it; the pulls must be true values."""
    kv = create_kvstore("dist_async", num_servers=1)
    kv.set_updater(_double_accumulate)
    if kv.role == "server":
        kv.serve()
        kv.close()
        return None
    n = 300_000
    pattern = torch.arange(1, n + 1, dtype=torch.float64)
    kv.init("w", torch.zeros(n, dtype=torch.float64))
    bad = []
    if kv.rank == 0:
        done = threading.Event()

        def pushes():
            try:
                for _ in range(150):
                    kv.push("w", pattern)
            finally:
                done.set()

        pusher = threading.Thread(target=pushes, name="pusher")
        pusher.start()
        out = torch.empty(n, dtype=torch.float64)
        pulls = 0
        while not done.is_set() or pulls < 5:
            kv.pull("w", out=out)
            pulls += 1
            ratio = out / pattern
            if not (torch.all(ratio == ratio[0]) and ratio[0] % 2 == 0):
                bad.append(sorted({float(r) for r in ratio.unique()[:4]}))
        pusher.join()
    traffic = kv.traffic()
    kv.close()
    return {"bad": bad, "shm": traffic["shm"]}


# --- launches ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """dist_sync, 2 workers each hosting a server (the default layout)."""
    path = str(tmp_path_factory.mktemp("kv") / "state.pt")
    return ProcessLauncher(2, join_timeout_s=JOIN_S).launch(_sync_worker, 0, path)


@pytest.fixture(scope="module")
def async_launch():
    """dist_async launches by (staleness, num_servers), each run once for every test that needs it."""
    done: dict = {}

    def launch(staleness: int | None, num_servers: int) -> list[dict]:
        if (staleness, num_servers) not in done:
            done[staleness, num_servers] = ProcessLauncher(2 + num_servers, join_timeout_s=JOIN_S).launch(
                _async_worker, num_servers, staleness)
        return done[staleness, num_servers]

    return launch


def _workers(results: list[dict]) -> list[dict]:
    return [r for r in results if r["role"] == "worker"]


@pytest.fixture(scope="module")
def fast_path():
    """dist_sync and dist_async over 2 workers and a server process, each with the same-host path on and off."""
    seed = secrets.randbelow(2**31)  # fresh inputs every run; the seed is in the failure report
    return seed, ProcessLauncher(3, join_timeout_s=JOIN_S).launch(_fast_worker, seed)


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_sync_pulls_match_a_dict_oracle(colocated):
    for r in _workers(colocated):
        assert r["num_workers"] == 2
        assert r["pulls"] >= len(KEYS)
        assert r["max_error"] < 1e-5


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_placement_spreads_small_keys_and_splits_big_ones(colocated):
    placement = colocated[0]["placement"]
    small_servers = {placement[k][0][0] for k in KEYS[:-1]}
    assert small_servers == {0, 1}
    assert placement[KEYS[-1]] == [(0, 0, BIG // 2), (1, BIG // 2, BIG)]
    assert colocated[1]["placement"] == placement  # every worker places alike
    assert "per server: rank 0:" in colocated[0]["placement_text"]


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_set_updater_merges_every_workers_sum_per_round(colocated):
    # ones + 3 rounds x 0.5 x (worker 0: 1 + 1, worker 1: 2 + 1)
    for r in _workers(colocated):
        assert r["updater"] == [1 + 3 * 0.5 * 5] * 4


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_checkpoint_round_trip_resumes_values_and_momentum(colocated):
    for r in _workers(colocated):
        ckpt = r["checkpoint"]
        assert ckpt["parts"] == 2 and ckpt["momentum_parts"] == [0, 1]
        assert ckpt["sgd_error"] < 1e-5
        assert ckpt["resumed_error"] == 0.0


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_bad_inputs_give_one_line_errors(colocated):
    errors = colocated[0]["errors"]
    assert all(e is not None and "\n" not in e for e in errors.values()), errors
    assert "out shape (2, 4) does not match the stored (4,)" in errors["pull_shape"]
    assert "does not match the stored" in errors["push_shape"]
    assert "key 'w' is a str but this store's keys are ints" in errors["str_key"]
    assert "key 7 is not initialized" in errors["uninitialized"]
    assert "serve() runs on server ranks" in errors["serve_on_worker"]
    assert "2 keys and 1 values" in errors["count"]


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("staleness", "num_servers"), [(None, 0), (0, 1)])
def test_async_applies_on_arrival_and_staleness_bounds_it(async_launch, staleness, num_servers):
    # co-located servers, then one server process
    workers = _workers(async_launch(staleness, num_servers))
    assert [r["rank"] for r in workers] == [0, 1]
    assert all(r["max_error"] < 1e-5 for r in workers)
    early = workers[0]["early_pull"]
    if staleness is None:
        assert early == [0.5] * len(early)  # only rank 0's own push had arrived
    else:
        assert early == [1.0] * len(early)  # the pull waited for rank 1's push


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_server_that_merges_differently_is_named(async_launch):
    for r in _workers(async_launch(0, 1)):
        assert r["mismatch"] is not None and "\n" not in r["mismatch"]
        assert (f"kvstore server rank 2: UsageError: worker rank {r['rank']} merges pushes by 'updater' but "
                "server rank 2 by 'assign'") in r["mismatch"]


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_colocated_servers_move_remote_keys_through_shared_memory(colocated):
    for r in _workers(colocated):
        traffic = r["traffic"]
        # each worker's own server is called in-process; the other worker's through its arena
        assert traffic["in-process"] > 0 and traffic["shm"] > 0 and traffic["rpc"] == 0, traffic
        assert traffic["requests"]["control"] > 0 and traffic["refused"] == {}


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_same_host_path_matches_a_plain_sum_and_the_rpc_path(fast_path):
    seed, results = fast_path
    workers = [r for r in results if r["rank"] != 2]
    for r in workers:
        fast, rpc = r["runs"]["dist_sync on"]["pulls"], r["runs"]["dist_sync off"]["pulls"]
        assert len(fast) == len(rpc) == 3
        for step, (got_fast, got_rpc) in enumerate(zip(fast, rpc, strict=True)):
            for key, a, b in zip(FAST_KEYS, got_fast, got_rpc, strict=True):
                want = _fast_value(seed, step, 0, key) + _fast_value(seed, step, 1, key)
                assert torch.equal(a, want), (seed, step, key, (a - want).abs().max().item())
                assert torch.equal(a, b), (seed, step, key)


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_same_host_async_applies_every_push_on_both_paths(fast_path):
    seed, results = fast_path
    for r in [r for r in results if r["rank"] != 2]:
        for setting in ("on", "off"):
            (final,) = r["runs"][f"dist_async {setting}"]["pulls"]
            for key, got in zip(FAST_KEYS, final, strict=True):
                want = _fast_value(seed, -1, 0, key) + 0.5 * sum(
                    _fast_value(seed, s, w, key) for s in range(3) for w in range(2))
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"seed {seed}, {setting}, {key}")


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_same_host_path_is_the_one_used_and_the_switch_turns_it_off(fast_path):
    _, results = fast_path
    for r in [r for r in results if r["rank"] != 2]:
        for kind in ("dist_sync", "dist_async"):
            on, off = r["runs"][f"{kind} on"]["traffic"], r["runs"][f"{kind} off"]["traffic"]
            assert on["shm"] > 0 and on["rpc"] == 0 and on["refused"] == {}, on
            assert off["shm"] == 0 and off["requests"]["control"] == 0 and off["rpc"] == on["shm"], off
            assert on["requests"]["rpc"] == 1  # init: every push and pull took the control channel
        # 2 pushpulls cut into 3 pipelined requests each ([a], [b], [c, s]), then one push and one pull
        assert r["runs"]["dist_sync on"]["traffic"]["requests"]["control"] == 2 * 3 + 2


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_same_host_path_leaves_no_mapping_and_no_thread(fast_path):
    _, results = fast_path
    assert len(results) == 3
    for r in results:  # the server included
        assert r["segments_left"] == (0, 0)
        assert r["control_threads"] == []


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_training_through_dist_async_converges_like_dist_sync(capfd):
    losses = {}
    for kvstore in ("dist_sync", "dist_async"):
        assert main(["train", "--nproc-per-node", "2", "--kvstore", kvstore, "--epochs", "4", "--train-size", "2048",
                     "--test-size", "256", "--batch-size", "64", "--lr", "0.3", "--no-progress", "--json"]) == 0
        record = json.loads(capfd.readouterr().out.splitlines()[-1])
        losses[kvstore] = [e["loss"] for e in record["epochs"]]
    sync, not_sync = losses["dist_sync"], losses["dist_async"]
    # measured: both fall from 2.15 to 0.64-0.65; async applies each worker's gradient on arrival, so
    # its path differs, but it must reach about the same loss
    assert sync[-1] < 0.6 * sync[0], losses
    assert not_sync[-1] < 0.6 * not_sync[0], losses
    assert abs(not_sync[-1] - sync[-1]) < 0.25, losses


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sync_with_server_processes_matches_the_oracle(tmp_path):
    results = ProcessLauncher(4, join_timeout_s=240).launch(_sync_worker, 1, str(tmp_path / "s.pt"))
    for r in _workers(results):
        assert r["max_error"] < 1e-5
        assert {s for k in KEYS for s, _, _ in r["placement"][k]} == {3}
        assert r["updater"] == [1 + 3 * 0.5 * (2 + 3 + 4)] * 4
        assert r["checkpoint"]["parts"] == 1 and r["checkpoint"]["resumed_error"] == 0.0
        assert r["checkpoint"]["sgd_error"] < 1e-5


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_server_that_dies_during_a_same_host_pull_ends_the_job_with_one_line():
    from dlperf.parallel.launchers.launcher import LaunchError

    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        ProcessLauncher(3, join_timeout_s=100).launch(_server_dies_worker)
    message = str(info.value)
    assert "\n" not in message and "rank 2" in message, message
    assert time.monotonic() - started < 60  # the waiting worker learns of it at once, not at a timeout


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_same_host_pull_never_reads_a_push_of_the_same_key_from_another_thread():
    results = [r for r in ProcessLauncher(3, join_timeout_s=JOIN_S).launch(_slot_sharing_worker) if r]
    assert results[0]["shm"] > 0  # the shared-memory path was the one taken
    assert [r["bad"] for r in results] == [[], []]


# --- without processes ---------------------------------------------------------------------------------

def test_types_are_registered_and_need_a_process_group():
    assert {"dist_sync", "dist_async", "dist_device_sync"} <= set(kvstore_types())
    for kind in ("dist_sync", "dist_async", "dist_device_sync"):
        with pytest.raises(UsageError, match=f"'{kind}' needs torch.distributed's process group"):
            KVStore(kind)


@pytest.mark.parametrize("env,needle", [
    ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 with WORLD_SIZE=2"),
    ({"RANK": "zero", "WORLD_SIZE": "2"}, "RANK='zero' is not an integer"),
])
def test_a_launcher_environment_that_cannot_be_joined_is_one_line(monkeypatch, env, needle):
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", **env}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with pytest.raises(UsageError, match=needle):
        KVStore("dist_sync")


def test_without_a_launcher_environment_there_is_nothing_to_join(monkeypatch):
    from dlperf.kvstore.dist import join_launched_processes

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert join_launched_processes() is False


def test_placement_is_stable_spread_and_splits_evenly():
    servers = [4, 5, 6, 7]
    a, b = Placement(servers, 1000), Placement(servers, 1000)
    for k in range(200):
        assert a.place(k, 10) == b.place(k, 10)
    load = a.by_server()
    assert set(load) == set(servers) and min(load.values()) > 200 * 10 / 4 / 2  # no server starves
    split = a.place("big", 1003)
    assert [s.server for s in split] == servers
    assert [s.stop - s.start for s in split] == [250, 251, 251, 251]
    assert split[0].start == 0 and split[-1].stop == 1003
    assert all(x.stop == y.start for x, y in zip(split, split[1:]))
    one = Placement([2], 1000)
    assert one.place("big", 5000)[0].stop == 5000


def test_small_keys_travel_packed_in_one_buffer_and_big_ones_as_they_are():
    from dlperf.kvstore.wire import from_wire as _from_wire
    from dlperf.kvstore.wire import to_wire as _to_wire

    g = torch.Generator().manual_seed(3)
    small = [torch.randn(n, generator=g) for n in (1, 3, 7, 100)] + [torch.arange(5, dtype=torch.int64)]
    big = torch.randn(40_000, generator=g)  # 160 KB
    tensors = small[:2] + [big] + small[2:]
    wire = _to_wire(tensors)
    # one packed buffer for the five small ones, then the big one, not copied
    assert len(wire) == 2 and wire[1].data_ptr() == big.data_ptr()
    back = _from_wire(wire, [(str(t.dtype), t.numel()) for t in tensors])
    assert all(torch.equal(a, b) for a, b in zip(back, tensors, strict=True))
    with pytest.raises(UsageError, match="carries 0 large tensors; its metadata names 1"):
        _from_wire(wire[:1], [(str(t.dtype), t.numel()) for t in tensors])
    with pytest.raises(UsageError, match="dtype 'torch.complex64'"):
        _from_wire(wire, [("torch.complex64", 1)])


# --- the same-host path's parts, without processes ----------------------------------------------------

def test_shm_setting_parses_and_refuses_other_values(monkeypatch):
    monkeypatch.setenv(SHM_ENV, "off")
    assert shm_wanted(None) is False
    assert shm_wanted(False) is False
    monkeypatch.setenv(SHM_ENV, "On")
    assert shm_wanted(None) is True
    monkeypatch.setenv(SHM_ENV, "maybe")
    with pytest.raises(UsageError, match="DLPERF_KVSTORE_SHM='maybe': expected on"):
        shm_wanted(None)
    with pytest.raises(UsageError, match="shared_memory='yes'"):
        shm_wanted("yes")


def test_arena_slots_are_shared_and_checked():
    before = mapped_segments()
    arena = Arena.create(1 << 20)
    peer = Arena.attach(arena.handle, arena.nbytes)
    values = torch.randn(1000)
    arena.view(4096, 1000, torch.float32).copy_(values)
    assert torch.equal(peer.view(4096, 1000, torch.float32), values)
    for offset in (-64, 1 << 20, (1 << 20) - 64, 4100, True):
        with pytest.raises(UsageError, match="slot offset"):
            peer.view(offset, 1000, torch.float32)
    with pytest.raises(ShmUnavailableError):
        Arena.attach({**arena.handle, "token": arena.handle["token"] ^ 1}, arena.nbytes)
    with pytest.raises(ShmUnavailableError):
        Arena.attach({**arena.handle, "pid": "1; rm"}, arena.nbytes)
    with pytest.raises(UsageError, match="arena of"):
        Arena.attach(arena.handle, -5)
    peer.close()
    arena.close()
    assert mapped_segments() == before


def _raw(server: ControlServer) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect("\0" + server.name)
    return sock


def _frame(doc) -> bytes:
    data = json.dumps(doc).encode()
    return struct.pack("<I", len(data)) + data


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    finally:
        sock.close()


@pytest.mark.timeout(60)
def test_control_channel_drops_hostile_peers_and_answers_workers():
    calls = []

    def handle(src, op, meta, reply):
        calls.append((src, op, meta))
        if op != 99:  # 99: never answered, for the timeout below
            reply.set_result((0, {"echo": meta}, []))

    server = ControlServer(handle, {0, 1}, "test")
    try:
        for first in (_frame({"token": "wrong", "rank": 0}), _frame({"token": server.token, "rank": 5}),
                      _frame({"token": server.token, "rank": [0]}), _frame(["not", "a", "hello"]),
                      struct.pack("<I", MAX_FRAME_BYTES + 1), struct.pack("<I", 5) + b"nope!",
                      struct.pack("<I", 3) + b"\xff\xfe\xfd"):
            sock = _raw(server)
            sock.sendall(first)
            assert _closed_by_peer(sock), first
        assert calls == []
        # a malformed request after a good hello is answered with an error; the connection stays usable
        sock = _raw(server)
        sock.sendall(_frame({"token": server.token, "rank": 1}))
        assert sock.recv(64).endswith(b"[0,{}]")
        sock.sendall(_frame("just a string"))
        assert b"a control request is [op, meta]" in sock.recv(256)
        sock.close()
        client = ControlClient(server.name, server.token, 0, 9, timeout_s=10, server_pid=os.getpid())
        assert client.request(1, {"items": [["k", 0]]}, "a push")() == (0, {"echo": {"items": [["k", 0]]}})
        assert calls == [(0, 1, {"items": [["k", 0]]})]
        slow = ControlClient(server.name, server.token, 1, 9, timeout_s=0.3, server_pid=os.getpid())
        started = time.monotonic()
        with pytest.raises(KVStoreLinkError, match="server rank 9 did not answer a pull within timeout_s=0.3"):
            slow.request(99, {}, "a pull")()
        assert time.monotonic() - started < 5
        slow.close()
    finally:
        server.close()
    with pytest.raises(KVStoreLinkError, match="control connection failed during a push"):
        client.request(1, {}, "a push")()
    client.close()


def _bare_worker():
    """A worker's store without processes: only what reading a server's offers and answers needs."""
    from dlperf.kvstore.dist import DistSyncKVStore

    kv = object.__new__(DistSyncKVStore)
    kv._placement = Placement([1], 1000)
    kv._placement.place("w", 100)
    kv._meta = {"w": (torch.Size([100]), torch.float32)}
    kv._arenas, kv._shm_refused, kv._slots, kv._control = {}, {}, {}, {}
    kv._traffic = {"shm": 0, "rpc": 0, "in-process": 0}
    kv._global_rank, kv._timeout_s, kv._server = 0, 5.0, None
    return kv


def test_a_hostile_shared_memory_offer_or_answer_gives_one_clear_error():
    before = mapped_segments()
    arena = Arena.create(1 << 16)
    good = [0, arena.handle["pid"], arena.handle["fd"], arena.handle["token"], arena.nbytes]
    workers = []
    try:
        for offer, match in [
            ("junk", "offered shared memory as str"),
            ({"arenas": [[1, 2]], "slots": []}, "named arena"),
            ({"arenas": [good], "slots": [["w", 0, 0]]}, "named slots"),
            ({"arenas": [good], "slots": [["w", 5, 0, 0, 512, 1024]]}, "part 5, which it does not hold"),
            ({"arenas": [good], "slots": [["w", 0, 0, 0, 1 << 16, 1024]]}, "slot offset 65536"),
            ({"arenas": [good], "slots": [["w", 0, 0, 0, 100, 1024]]}, "slot offset 100"),
            ({"arenas": [good], "slots": [[["w"], 0, 0, 0, 512, 1024]]}, "expected an int or a str"),
            ({"arenas": [good], "slots": [["w", 0, 0, 0, 512, 1024]], "control": ["/tmp/x", "t"]},
             "named control channel"),
            ({"arenas": [good], "slots": [["w", 0, 0, 0, 512, 1024]], "control": None}, "named control channel"),
        ]:
            kv = _bare_worker()
            workers.append(kv)
            with pytest.raises(UsageError, match=match) as info:
                kv._adopt_slots(1, offer)
            assert "\n" not in str(info.value)
            del info  # its traceback holds views of the arena
        # an arena that cannot be mapped from here (its token differs): that server's slices stay on RPC
        kv = _bare_worker()
        workers.append(kv)
        kv._adopt_slots(1, {"arenas": [[0, good[1], good[2], good[3] ^ 1, good[4]]],
                            "slots": [["w", 0, 0, 0, 512, 1024]], "control": ["dlperf-kvstore-x", "t"]})
        assert kv._slots == {} and kv._control == {} and "not the segment" in kv._shm_refused[1]
        # an answer naming a slot this worker was not given, or a where it cannot mean
        for where, match in [([2], "slot this worker does not have"), ([7], "where=\\[7\\]"),
                             ([True], "where=\\[True\\]"), ("0", "where='0'"), ([0, 0], "where=\\[0, 0\\]"),
                             ([1.0], "where=\\[1.0\\]"), ([-1], "carries no tensors")]:
            with pytest.raises(UsageError, match=match):
                kv._pulled(1, [["w", 0, 1, 1]], {"where": where}, [])
    finally:
        for kv in workers:
            kv._release_shared_memory()
        arena.close()
    assert mapped_segments() == before


def test_shared_memory_is_released_when_the_control_server_fails_to_close(capsys):
    from types import SimpleNamespace

    def fails():
        raise OSError("a control thread failed")

    before = mapped_segments()
    kv = _bare_worker()
    kv._server = server = SimpleNamespace(control=SimpleNamespace(close=fails), arenas=[Arena.create(1 << 16)],
                                          entries={"w": None})
    kv._arenas = {1: Arena.create(1 << 16)}
    assert mapped_segments() != before
    with pytest.raises(OSError, match="a control thread failed"):
        kv._release_shared_memory()
    assert mapped_segments() == before  # released all the same
    assert server.control is None and server.arenas == [] and server.entries == {} and kv._arenas == {}
    server.control, server.arenas = SimpleNamespace(close=fails), [Arena.create(1 << 16)]
    with pytest.raises(UsageError, match="not every worker closed"):
        try:
            raise UsageError("not every worker closed the store")
        finally:  # as in close(): the error on its way out wins
            kv._release_shared_memory()
    assert mapped_segments() == before and server.control is None
    assert "the kvstore's control server failed too (OSError: a control thread failed)" in capsys.readouterr().err


ABUSE_ROUNDS = 30


def _abused_worker(name_file: str) -> dict:
    """dist_sync with one server process; the server writes its control socket's name for an abuser to flood,
    and samples how many control threads it runs."""
    import torch.distributed as dist

    from dlperf.kvstore.server import SERVERS

    kv = create_kvstore("dist_sync", num_servers=1, timeout_s=60)
    if kv.role == "server":
        done, peak = threading.Event(), [0]

        def watch() -> None:
            named = False
            while not done.wait(0.005):
                if not named:
                    control = next((s.control for s in SERVERS.values() if s.control is not None), None)
                    if control is not None:
                        tmp = name_file + ".tmp"
                        Path(tmp).write_text(control.name)
                        os.replace(tmp, name_file)
                        named = True
                peak[0] = max(peak[0], sum("control" in t.name for t in threading.enumerate()))

        watcher = threading.Thread(target=watch, name="abuse watch")
        watcher.start()
        try:
            kv.serve()
        finally:
            done.set()
            watcher.join()
        kv.close()
        return {"role": "server", "peak_control_threads": peak[0]}
    kv.init("w", torch.zeros(50_000))
    out = torch.empty(50_000)
    for step in range(ABUSE_ROUNDS):
        kv.pushpull("w", torch.full((50_000,), float(step + kv.rank)), out=out)
        expected = float(2 * step + 1)  # both workers' pushes: step + 0 and step + 1
        assert torch.equal(out, torch.full((50_000,), expected)), (step, out[:3])
        time.sleep(0.02)
    traffic = kv.traffic()
    kv.close()
    dist.barrier()
    return {"role": "worker", "requests": traffic["requests"]}


def _flood(name_file: Path, stop: threading.Event, counts: list[int]) -> None:
    """Another local process's view: connect to the control socket and close, in a loop, as fast as it can."""
    while not name_file.exists():
        if stop.wait(0.005):
            return
    address = "\0" + name_file.read_text()
    while not stop.is_set():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(address)
            counts[0] += 1
        except OSError:
            counts[1] += 1
        finally:
            sock.close()


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_flood_on_the_control_socket_at_job_start_neither_hangs_nor_fails_the_job(tmp_path):
    name_file = tmp_path / "control-name"
    stop, counts = threading.Event(), [0, 0]
    flooder = threading.Thread(target=_flood, args=(name_file, stop, counts), name="flooder")
    flooder.start()
    try:
        results = ProcessLauncher(3, join_timeout_s=120).launch(_abused_worker, str(name_file))
    finally:
        stop.set()
        flooder.join(10)
    assert counts[0] > 100, counts  # the flood did reach the socket while the job ran
    server = next(r for r in results if r["role"] == "server")
    # one accepting thread and one per worker connection (two workers, one calling thread each, plus
    # answers' writers): not one per connection the flood made
    assert server["peak_control_threads"] <= 8, server
    workers = [r for r in results if r["role"] == "worker"]
    assert len(workers) == 2 and all(r["requests"]["control"] >= ABUSE_ROUNDS for r in workers), workers


def _link_fails_worker() -> None:
    """Worker 1 cannot reach its server's control socket any more (as when its connects keep failing): its
    pushpull fails, and it must leave at once, not in RPC's graceful shutdown waiting for worker 0."""
    from dlperf.kvstore import control

    control.CONNECT_RETRY_S = 1.0
    kv = create_kvstore("dist_sync", num_servers=1, timeout_s=60)
    if kv.role == "server":
        kv.serve()
        kv.close()
        return
    with kv:
        kv.init("w", torch.zeros(50_000))
        if kv.rank == 1:
            for client in kv._control.values():
                client.close()
                client._closed = False
                client._address = "\0dlperf-kvstore-" + secrets.token_hex(8)  # nothing listens there
        kv.pushpull("w", torch.ones(50_000))  # worker 0 waits for worker 1's push, which never comes


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_worker_whose_link_fails_ends_the_job_at_once_naming_the_cause():
    from dlperf.parallel.launchers.launcher import LaunchError

    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        ProcessLauncher(3, join_timeout_s=150).launch(_link_fails_worker)
    message = str(info.value)
    assert "\n" not in message and "rank 1" in message and "took no connection" in message, message
    assert time.monotonic() - started < 60  # not the store's timeout_s, nor the launch's
