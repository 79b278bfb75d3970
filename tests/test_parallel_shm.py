"""Shared-memory allreduce between processes: against a float64 reference and gloo, failures, and no leftovers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dlperf
from dlperf._shm import Segment, mapped_segments
from dlperf.errors import UsageError
from dlperf.parallel.allreduce.shm import (
    ShmAllreduce,
    ShmAllreduceError,
    ShmUnavailableError,
    _setup_problem,
    host_allreduce_,
)
from dlperf.parallel.launchers import ProcessLauncher, rank_info

SIZES = (0, 1, 2, 7, 1000, 4099)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
SMALL_CHUNK = 256  # bytes per rank per chunk: many chunks, so the buffer rotation and a short last chunk run
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12), torch.bfloat16: (2e-2, 2e-2),
       torch.float16: (2e-3, 2e-3)}


def _dev_shm() -> set[str]:
    """dlperf's names in /dev/shm: the segments are anonymous, so none may ever appear."""
    try:
        return {n for n in os.listdir("/dev/shm") if "dlperf" in n}
    except OSError:
        return set()


def _input(case: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * case + rank), dtype=torch.float64).to(dtype)


def _cases():
    case = 0
    for n in SIZES:
        for dtype in DTYPES:
            for op in ("sum", "mean"):
                yield case, n, dtype, op
                case += 1


def _reference(case: int, n: int, dtype: torch.dtype, op: str, world: int) -> torch.Tensor:
    total = sum(_input(case, r, n, dtype).double() for r in range(world))
    return total / world if op == "mean" else total


def _gloo(t: torch.Tensor, op: str, world: int) -> torch.Tensor:
    import torch.distributed as dist

    out = t.clone()
    dist.all_reduce(out)
    return out / world if op == "mean" else out


def _correctness_worker(hosts: list[str] | None) -> dict:
    """Every case through ShmAllreduce (small and default chunks) and host_allreduce_, beside gloo's answer."""
    import torch.distributed as dist

    rank, world, _ = rank_info()
    torch.set_num_threads(1)
    out: dict = {"shm": [], "gloo": [], "host": [], "errors": []}
    with ShmAllreduce(timeout_s=30, chunk_bytes=SMALL_CHUNK) as small, ShmAllreduce(timeout_s=30) as big:
        out["held_after_setup"] = mapped_segments()
        for case, n, dtype, op in _cases():
            x = _input(case, rank, n, dtype)
            t = x.clone()
            assert small.allreduce_(t, op) is t
            out["shm"].append(t)
            out["gloo"].append(_gloo(x, op, world))
        # larger than one default chunk, and not contiguous: the result lands in the caller's tensor
        x = _input(10_000, rank, 2 * 300_007, torch.float32).view(2, 300_007).t()
        big.allreduce_(x)
        out["big"] = x.contiguous()
        y = _input(10_001, rank, 5000, torch.float32)
        out["broadcast"] = small.broadcast_(y, src=world - 1).clone()
        out["errors"] = _error_cases(small, rank, world)
        after = torch.full((33,), float(rank + 1))
        small.allreduce_(after)  # the group survives every argument error above
        out["after_errors"] = after
    out["held_after_close"] = mapped_segments()
    z = _input(10_002, rank, 3001, torch.float32)
    host_allreduce_(z, host_name=hosts[rank] if hosts else None, chunk_bytes=SMALL_CHUNK)
    out["host"] = z
    from dlperf.parallel.allreduce.shm import _plans

    out["plan"] = next(iter(_plans.values()))[1].kind
    if hosts:
        # every rank on its own named host: plain torch.distributed, with the same argument checks
        everyone = dist.new_group(list(range(world)))
        w = _input(10_003, rank, 777, torch.float64)
        host_allreduce_(w, group=everyone, op="mean", host_name=f"host{rank}")
        out["dist"] = (w, _plans[id(everyone)][1].kind)
        try:
            host_allreduce_(torch.ones(3, dtype=torch.int32), group=everyone)
        except UsageError as exc:
            out["dist_error"] = str(exc)
    dist.barrier()
    return out


def _error_cases(group: ShmAllreduce, rank: int, world: int) -> list[str]:
    """(error type, message) of each wrong call; every rank must raise at the same barrier."""
    seen = []
    calls = [
        lambda: group.allreduce_(torch.ones(10 + rank)),  # sizes differ between ranks
        lambda: group.allreduce_(torch.ones(4, dtype=torch.int64)),  # unsupported dtype on every rank
        lambda: group.allreduce_(torch.ones(4, dtype=torch.int64 if rank == 1 else torch.float32)),  # on one rank
        lambda: group.allreduce_(torch.ones(4), op="max"),
        lambda: group.allreduce_(torch.ones(4, dtype=torch.float64 if rank == 0 else torch.float32)),
    ]
    for call in calls:
        try:
            call()
        except (UsageError, ShmAllreduceError) as exc:
            seen.append(f"{'UsageError' if isinstance(exc, UsageError) else 'ShmAllreduceError'}: {exc}")
        else:
            seen.append("no error")
    return seen


def _check(results: list[dict], world: int) -> None:
    for i, (case, n, dtype, op) in enumerate(_cases()):
        ref = _reference(case, n, dtype, op, world)
        rtol, atol = TOL[dtype]
        for r in range(world):
            got = results[r]["shm"][i]
            assert got.dtype == dtype and got.shape == (n,)
            # each slice is summed once, by one rank: every rank holds the same bits
            assert torch.equal(got, results[0]["shm"][i]), (case, n, dtype, op, r)
            torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol)
            torch.testing.assert_close(got, results[r]["gloo"][i], rtol=rtol, atol=atol)
    big = sum(_input(10_000, r, 2 * 300_007, torch.float32).double() for r in range(world)).view(2, 300_007).t()
    host = sum(_input(10_002, r, 3001, torch.float32).double() for r in range(world))
    for r in range(world):
        torch.testing.assert_close(results[r]["big"].double(), big, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(results[r]["host"].double(), host, rtol=1e-5, atol=1e-5)
        assert torch.equal(results[r]["broadcast"], _input(10_001, world - 1, 5000, torch.float32))
        assert torch.equal(results[r]["after_errors"], torch.full((33,), float(world * (world + 1) // 2)))
        # two groups mapped, no descriptor but the one each mmap keeps: nothing outlives the mappings
        assert results[r]["held_after_setup"] == (2, 2) and results[r]["held_after_close"] == (0, 0)
        errors = results[r]["errors"]
        assert "no error" not in errors, errors
        assert "rank 0 passed 10 elements of torch.float32 (sum), rank 1 passed 11 elements" in errors[0]
        assert errors[1].startswith("UsageError") and "dtype torch.int64 is not supported" in errors[1]
        if r == 1:
            assert errors[2].startswith("UsageError") and "int64" in errors[2]
        else:
            assert errors[2].startswith("ShmAllreduceError") and "rank 1 passed an unusable argument" in errors[2]
        assert "op='max' is not supported" in errors[3] or "rank" in errors[3]
        assert "rank 0 passed 4 elements of torch.float64" in errors[4]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_two_processes_match_the_reference_and_gloo_and_leave_nothing_in_dev_shm():
    before = _dev_shm()
    results = ProcessLauncher(2, backend="gloo", join_timeout_s=150).launch(_correctness_worker, None)
    _check(results, 2)
    assert [r["plan"] for r in results] == ["shm", "shm"]
    assert _dev_shm() <= before


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_three_processes_on_two_named_hosts_reduce_hierarchically():
    before = _dev_shm()
    # ranks 0 and 1 share a segment; rank 2 stands for another host, reached through a leaders' gloo group
    results = ProcessLauncher(3, backend="gloo", join_timeout_s=150).launch(_correctness_worker, ["a", "a", "b"])
    _check(results, 3)
    assert [r["plan"] for r in results] == ["hierarchical"] * 3
    mean = sum(_input(10_003, r, 777, torch.float64) for r in range(3)) / 3
    for r in results:
        assert r["dist"][1] == "dist"
        torch.testing.assert_close(r["dist"][0], mean)
        assert "dtype torch.int32 is not supported" in r["dist_error"]
    assert _dev_shm() <= before


# --- a peer that dies or hangs: the other raises within the timeout, naming it ---------------------------------

_PEER = """
import os, sys, time, torch, torch.distributed as dist
from dlperf.parallel.allreduce.shm import ShmAllreduce
store = dist.FileStore(sys.argv[1], 2)
group = ShmAllreduce(rank=1, world_size=2, store=store, timeout_s=60)
group.allreduce_(torch.ones(8))
if sys.argv[2] == "die":
    os._exit(3)
if sys.argv[2] == "close":
    group.close()
time.sleep(120)
"""


def _peer(tmp_path: Path, mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(Path(dlperf.__file__).parents[1]), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", _PEER, str(tmp_path / "store"), mode], env=env)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, timeout_s, expected", [
    ("die", 60, "rank 1 (pid {pid}) exited"),
    ("close", 60, "rank 1 closed the group"),
    ("hang", 3, "rank 1 did not arrive within timeout_s=3 s"),
])
def test_a_peer_that_dies_closes_or_hangs_makes_the_other_raise_naming_it(tmp_path, mode, timeout_s, expected):
    import torch.distributed as dist

    before = _dev_shm()
    peer = _peer(tmp_path, mode)
    try:
        store = dist.FileStore(str(tmp_path / "store"), 2)
        with ShmAllreduce(rank=0, world_size=2, store=store, timeout_s=60) as group:
            x = torch.ones(8)
            group.allreduce_(x)
            assert x.tolist() == [2.0] * 8
            group.timeout_s = timeout_s  # short only now: on a busy machine the peer may start late
            start = time.monotonic()
            with pytest.raises(ShmAllreduceError, match=re.escape(expected.format(pid=peer.pid))):
                group.allreduce_(torch.ones(1 << 20))
            assert time.monotonic() - start < timeout_s + 10
            with pytest.raises(ShmAllreduceError, match="broke in an earlier call"):
                group.allreduce_(x)
    finally:
        peer.kill()
        peer.wait()
    assert _dev_shm() <= before


# --- single process: arguments, setup decisions, hostile segments ----------------------------------------------


def test_one_rank_returns_its_tensor_and_still_checks_it(tmp_path):
    import torch.distributed as dist

    group = ShmAllreduce(rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "s"), 1))
    x = torch.arange(5.0)
    assert group.allreduce_(x, "mean") is x and x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(UsageError, match="dtype torch.int32 is not supported"):
        group.allreduce_(torch.ones(3, dtype=torch.int32))
    with pytest.raises(UsageError, match="expected a torch.Tensor"):
        group.allreduce_([1.0])
    with pytest.raises(UsageError, match="timeout_s=-1"):
        group.timeout_s = -1
    group.close()


@pytest.mark.parametrize("kwargs, match", [
    ({"rank": 0, "world_size": 2, "chunk_bytes": 8}, "chunk_bytes=8"),
    ({"rank": 0, "world_size": 2, "timeout_s": 0}, "timeout_s=0"),
    ({"rank": 2, "world_size": 2}, "rank=2: expected less than world_size=2"),
    ({"rank": -1, "world_size": 2}, "rank=-1"),
])
def test_bad_arguments_raise_one_clear_error(tmp_path, kwargs, match):
    import torch.distributed as dist

    with pytest.raises(UsageError, match=match):
        ShmAllreduce(store=dist.FileStore(str(tmp_path / "s"), 2), **kwargs)


def test_setup_refuses_ranks_on_different_hosts_or_machines_alike_on_every_rank():
    ok = {"host": "h", "supported": True, "machine": "x86_64"}
    assert _setup_problem([ok, ok]) is None
    assert "different hosts (rank 0 on 'h', rank 1 on 'g')" in _setup_problem([ok, dict(ok, host="g")])
    assert "rank 1 ('aarch64') lacks" in _setup_problem([ok, dict(ok, supported=False, machine="aarch64")])
    assert "rank 0: no room" in _setup_problem([dict(ok, error="no room"), ok])


def test_a_hostile_or_foreign_segment_is_refused_before_it_is_trusted():
    for handle in ({"pid": "../etc", "fd": 3, "token": 1}, {"pid": 1, "fd": -1, "token": 1}, ["x"], None):
        with pytest.raises(ShmUnavailableError, match="expected a pid, a descriptor and a token"):
            Segment.attach(handle, 2, 64, 1024)
    with pytest.raises(ShmUnavailableError, match="cannot open the creating rank's segment"):
        Segment.attach({"pid": os.getpid(), "fd": 999_999, "token": 1}, 2, 64, 1024)
    # A handle naming a pipe (opening its other end would block) or an unsealed file: refused at once.
    r, w = os.pipe()
    unsealed = os.memfd_create("not-a-segment")
    try:
        os.ftruncate(unsealed, Segment.layout(2, 1024)[1])
        for fd in (r, w, unsealed):
            with pytest.raises(ShmUnavailableError, match="not a sealed shared-memory file"):
                Segment.attach({"pid": os.getpid(), "fd": fd, "token": 1}, 2, 64, 1024)
    finally:
        for fd in (r, w, unsealed):
            os.close(fd)
    seg, handle = Segment.create(2, 64, 1024)
    try:
        assert mapped_segments() == (1, 2)  # the descriptor peers open, and the one mmap keeps
        with pytest.raises(ShmUnavailableError, match="bytes, expected"):
            Segment.attach(handle, 2, 64, 1 << 20)
        with pytest.raises(ShmUnavailableError, match="not the segment the creating rank announced"):
            Segment.attach(dict(handle, token=handle["token"] + 1), 2, 64, 1024)
        peer = Segment.attach(handle, 2, 64, 1024)
        seg.release_handle()
        assert mapped_segments() == (2, 2)
        peer.ctl[100] = 7  # one memory behind both mappings
        assert seg.ctl[100] == 7
        peer.close()
    finally:
        seg.close()
    assert mapped_segments() == (0, 0)


def test_host_allreduce_needs_a_process_group():
    with pytest.raises(UsageError, match="needs an initialised torch.distributed process group"):
        host_allreduce_(torch.ones(2))


def test_a_peer_that_never_joins_fails_setup_without_leaving_the_segment(tmp_path):
    import torch.distributed as dist

    before = _dev_shm()
    start = time.monotonic()
    with pytest.raises(ShmUnavailableError, match="rank 1 did not join the shm group"):
        ShmAllreduce(rank=0, world_size=2, store=dist.FileStore(str(tmp_path / "s"), 2), timeout_s=1)
    assert time.monotonic() - start < 10
    assert _dev_shm() <= before


def _across_worker() -> dict:
    """The Trainer's one cross-process sum, on both transports, against gloo's own answer."""
    import torch.distributed as dist

    from dlperf.parallel.allreduce import shm
    from dlperf.parallel.communication.process_group import PROCESS_ALLREDUCE_ENV, allreduce_across_processes

    rank = rank_info().rank
    x = _input(7, rank, 1003, torch.float32)
    auto, expected = x.clone(), x.clone()
    allreduce_across_processes(auto)
    dist.all_reduce(expected)
    kinds = [entry[1].kind for entry in shm._plans.values()]
    os.environ[PROCESS_ALLREDUCE_ENV] = "gloo"
    try:
        forced = x.clone()
        allreduce_across_processes(forced)
    finally:
        del os.environ[PROCESS_ALLREDUCE_ENV]
    return {"auto": torch.equal(auto, expected), "forced": torch.equal(forced, expected), "kinds": kinds}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_trainers_sum_across_processes_takes_shared_memory_on_one_host():
    results = ProcessLauncher(2, backend="gloo", join_timeout_s=100).launch(_across_worker)
    # two addends: every order of summation gives the same bits, so equality with gloo is exact
    assert results == [{"auto": True, "forced": True, "kinds": ["shm"]}] * 2
