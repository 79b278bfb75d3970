"""Faults on one node: a killed rank is named with its role and host, nothing survives it, restarts resume.

Every other rank must be gone within seconds of a SIGKILL (pytorch/pytorch#46874, apache/mxnet#7888:
peers wait forever), along with the processes each worker started; with ``max_restarts`` the group
comes back and resumes from the last checkpoint to the same bits as a run that was never interrupted.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dlperf._io import FileAccessError
from dlperf.errors import UsageError
from dlperf.parallel.launchers import (
    LaunchError,
    ProcessLauncher,
    checkpoint_path,
    free_port,
    rank_info,
    rank_role,
    restart_count,
)
from dlperf.parallel.launchers.faults import (
    FailureRecord,
    FaultBoard,
    first_cause,
    kill_process_groups,
    session_members,
)

FAULT_LIMIT_S = 20.0  # the most a kill may take to bring every other process down
STEPS, KILL_AT = 6, 3

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc to find processes")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper has finished)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _recorded_pids(pid_dir: Path) -> list[int]:
    return [int(p) for f in pid_dir.glob("*.pids") for p in f.read_text().split()]


# --- worker functions: top level, so spawned workers can import them -------------------------------

def _start_child(pid_dir: str) -> None:
    """A process of the worker's own, as a KVStore server or a data loader would be."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    Path(pid_dir, f"{os.getpid()}.pids").write_text(f"{os.getpid()} {child.pid}")


def _kill_rank_1_while_others_compute(pid_dir: str) -> None:
    import torch.distributed as dist

    _start_child(pid_dir)
    Path(pid_dir, f"role.{rank_info().rank}").write_text(rank_role())
    dist.barrier()  # both ranks are up, and their children recorded
    if rank_info().rank == 1:
        Path(pid_dir, "killed_at").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    end = time.monotonic() + 120
    while time.monotonic() < end:  # outside any collective: only the launcher can stop this rank
        torch.ones(32, 32) @ torch.ones(32, 32)
        time.sleep(0.01)


def _interrupt_rank_1_while_others_compute(pid_dir: str) -> None:
    """Rank 1 gets a Ctrl-C of its own (SIGINT to its process group); rank 0 computes outside collectives."""
    import torch.distributed as dist

    _start_child(pid_dir)
    dist.barrier()
    if rank_info().rank == 1:
        Path(pid_dir, "interrupted_at").write_text(repr(time.time()))
        os.killpg(os.getpgid(0), signal.SIGINT)
        time.sleep(30)  # the KeyboardInterrupt arrives here
    end = time.monotonic() + 120
    while time.monotonic() < end:
        torch.ones(32, 32) @ torch.ones(32, 32)
        time.sleep(0.01)


def _skip_a_collective() -> None:
    import torch.distributed as dist

    if rank_info().rank == 1:
        time.sleep(120)  # never joins the barrier
    dist.barrier()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    X = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * step + rank))
    return X, X.sum(1, keepdim=True)


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _train(kill_at: int | None) -> dict:
    """Data-parallel SGD with momentum on a linear model; rank 0 checkpoints after every step."""
    import torch.distributed as dist

    from dlperf._io import atomic_open, safe_torch_load

    rank, world, _ = rank_info()
    model, opt = _model_and_optimizer()
    start, path = 0, checkpoint_path()
    if path is not None and os.path.exists(path):
        state = safe_torch_load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
    for step in range(start, STEPS):
        if step == kill_at and rank == 1 and restart_count() == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        X, y = _batch(step, rank)
        opt.zero_grad()
        ((model(X) - y) ** 2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        if rank == 0 and path is not None:
            with atomic_open(path) as f:
                torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, f)
        dist.barrier()  # the checkpoint of this step is on disk before any rank starts the next
    return {"params": [p.detach().clone() for p in model.parameters()], "start": start, "attempt": restart_count()}


def _train_in_one_process(world: int) -> list[torch.Tensor]:
    """The same training without processes: each rank's gradient in turn, summed, averaged."""
    model, opt = _model_and_optimizer()
    for step in range(STEPS):
        grads = []
        for rank in range(world):
            opt.zero_grad()
            X, y = _batch(step, rank)
            ((model(X) - y) ** 2).mean().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, *per_rank in zip(model.parameters(), *grads):
            p.grad = sum(per_rank[1:], per_rank[0]) / world
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


# --- processes ------------------------------------------------------------------------------------

@needs_proc
@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_killed_server_rank_is_named_and_nothing_it_or_its_peers_started_survives(tmp_path):
    with pytest.raises(LaunchError) as info:
        ProcessLauncher(2, join_timeout_s=80, roles=["worker", "server"]).launch(
            _kill_rank_1_while_others_compute, str(tmp_path))
    gone_after = time.time() - float((tmp_path / "killed_at").read_text())
    err = info.value
    assert (err.rank, err.role, err.host) == (1, "server", socket.gethostname())
    assert err.cause == "killed by SIGKILL (exit code -9)"
    assert str(err) == f"rank 1 failed: killed by SIGKILL (exit code -9) (role server, host {socket.gethostname()})"
    assert [(tmp_path / f"role.{r}").read_text() for r in (0, 1)] == ["worker", "server"]
    assert gone_after < FAULT_LIMIT_S
    pids = _recorded_pids(tmp_path)
    assert len(pids) == 4  # two workers, one child each
    assert [p for p in pids if _alive(p)] == []


@needs_proc
@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_rank_interrupted_by_ctrl_c_is_named_as_interrupted_and_stops_the_others(tmp_path):
    with pytest.raises(LaunchError) as info:
        ProcessLauncher(2, join_timeout_s=80, roles=["worker", "server"]).launch(
            _interrupt_rank_1_while_others_compute, str(tmp_path))
    gone_after = time.time() - float((tmp_path / "interrupted_at").read_text())
    err = info.value
    assert (err.rank, err.role, err.host) == (1, "server", socket.gethostname())
    assert str(err) == (f"rank 1 failed: interrupted by SIGINT (Ctrl-C) in rank 1's process "
                        f"(role server, host {socket.gethostname()})")
    assert gone_after < FAULT_LIMIT_S
    assert [p for p in _recorded_pids(tmp_path) if _alive(p)] == []


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_rank_that_skips_a_collective_fails_its_peer_within_the_collective_timeout():
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 0 failed: .*(?i:timed out|timeout)") as info:
        ProcessLauncher(2, join_timeout_s=80, collective_timeout_s=4).launch(_skip_a_collective)
    assert time.monotonic() - t0 < 4 + FAULT_LIMIT_S
    assert info.value.role == "worker"


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_restarted_group_resumes_from_the_checkpoint_to_the_same_bits(tmp_path):
    resumed = ProcessLauncher(2, join_timeout_s=60, max_restarts=1, checkpoint=tmp_path / "ckpt.pt").launch(
        _train, KILL_AT)
    assert [(r["start"], r["attempt"]) for r in resumed] == [(KILL_AT, 1), (KILL_AT, 1)]
    uninterrupted = _train_in_one_process(world=2)
    for ours, reference in zip(resumed[0]["params"] + resumed[1]["params"], uninterrupted * 2):
        assert torch.equal(ours, reference)
    assert not torch.equal(uninterrupted[0], _model_and_optimizer()[0].weight)  # it did train


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_an_uninterrupted_launch_gives_the_same_bits_as_one_process():
    plain = ProcessLauncher(2, join_timeout_s=60).launch(_train, None)
    assert [(r["start"], r["attempt"]) for r in plain] == [(0, 0), (0, 0)]
    for ours, reference in zip(plain[0]["params"] + plain[1]["params"], _train_in_one_process(world=2) * 2):
        assert torch.equal(ours, reference)


@needs_proc
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_of_a_killed_launcher_die_with_it(tmp_path):
    code = ("import sys; sys.path[:0] = sys.argv[1:3]\n"
            "from test_parallel_faults import _hang_and_record\n"
            "from dlperf.parallel.launchers import ProcessLauncher\n"
            "if __name__ == '__main__':\n"
            "    ProcessLauncher(2, join_timeout_s=100).launch(_hang_and_record, sys.argv[3])\n")
    script = tmp_path / "launch_and_hang.py"
    script.write_text(code)
    launcher = subprocess.Popen([sys.executable, str(script), str(Path(__file__).parent),
                                 str(Path(__file__).parents[1] / "src"), str(tmp_path)], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(_recorded_pids(tmp_path)) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = _recorded_pids(tmp_path)
        assert len(pids) == 4
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while [p for p in pids[::2] if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in pids[::2] if _alive(p)] == []  # the workers (their own children are not ours)
    finally:
        for pid in [launcher.pid, *session_members(launcher.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        launcher.wait(10)


def _hang_and_record(pid_dir: str) -> None:
    _start_child(pid_dir)
    time.sleep(120)


# --- no processes ---------------------------------------------------------------------------------

def _record(rank, reported, when, role="worker"):
    return FailureRecord(rank, role, "h", f"cause {rank}", when, reported)


def test_the_cause_is_a_rank_that_could_not_report_before_the_earliest_error():
    echo, killed, later_killed = _record(0, True, 1.0), _record(1, False, 2.0), _record(2, False, 3.0)
    assert first_cause([echo, later_killed, killed]) == killed
    assert first_cause([_record(3, True, 5.0), echo]) == echo
    assert first_cause([]) is None
    assert killed.message() == "rank 1 failed: cause 1 (role worker, host h)"


@pytest.mark.parametrize("data", [None, [], "x", {"rank": 1}, {"rank": "one", "role": "w", "host": "h",
                                                                "cause": "c", "when": 1, "reported": True}])
def test_a_malformed_failure_record_from_another_node_is_ignored(data):
    assert FailureRecord.from_dict(data) is None


def test_a_failure_record_survives_the_trip_through_the_store():
    from dataclasses import asdict

    record = _record(4, False, 12.5, role="server")
    assert FailureRecord.from_dict(asdict(record)) == record


@needs_proc
@pytest.mark.timeout(30)
def test_killing_a_process_group_takes_the_children_of_a_dead_leader_too():
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                               "print(c.pid, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True, process_group=0)
    child = int(leader.stdout.readline())
    leader.kill()
    leader.wait(10)
    assert _alive(child)  # its leader is gone: only the group still finds it
    assert kill_process_groups({leader.pid}) == 1
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    leader.stdout.close()


@pytest.mark.parametrize("roles, message", [
    (["worker"], "roles has 1 labels: expected one per rank, 2"),
    ({5: "server"}, "roles names rank 5"),
    ({0: ""}, r"roles\[0\]=''"),
    ("server", "roles='server'"),
])
def test_bad_roles_are_named(roles, message):
    with pytest.raises(UsageError, match=message):
        ProcessLauncher(2, roles=roles)


@pytest.mark.parametrize("kwargs, message", [
    ({"fault_timeout_s": 0}, "fault_timeout_s=0"),
    ({"collective_timeout_s": -1}, "collective_timeout_s=-1"),
    ({"run_id": " "}, "run_id=' '"),
])
def test_bad_fault_settings_are_named(kwargs, message):
    with pytest.raises(UsageError, match=message):
        ProcessLauncher(2, **kwargs)


def test_roles_default_to_worker_and_can_be_given_by_rank():
    launcher = ProcessLauncher(2, nnodes=2, master_port=29500, roles={3: "server"})
    assert [launcher.role(r) for r in range(4)] == ["worker", "worker", "worker", "server"]


@pytest.mark.timeout(30)
def test_an_unwritable_checkpoint_fails_before_any_process_starts(tmp_path):
    (tmp_path / "dir").mkdir()
    with pytest.raises(FileAccessError, match="directory"):
        ProcessLauncher(2, checkpoint=tmp_path / "dir").launch(_skip_a_collective)


def test_worker_environment_helpers_outside_a_launch(monkeypatch):
    assert (rank_role(), restart_count(), checkpoint_path()) == ("worker", 0, None)
    monkeypatch.setenv("DLPERF_ROLE", "server")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("DLPERF_CHECKPOINT", "/x/ckpt.pt")
    assert (rank_role(), restart_count(), checkpoint_path()) == ("server", 2, "/x/ckpt.pt")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "two")
    with pytest.raises(LaunchError, match="TORCHELASTIC_RESTART_COUNT='two'"):
        restart_count()


def _wait_for(predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


@pytest.mark.timeout(60)
def test_the_fault_board_carries_failures_and_notices_a_silent_node():
    import torch.distributed as dist

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    boards = [FaultBoard("127.0.0.1", port, "t", n, 2, f"host{n}", fault_timeout_s=1.0) for n in range(2)]
    try:
        boards[0].beat([0])
        boards[1].beat([1])
        assert not boards[0].others_failed() and boards[0].lost() == []
        # node 1 stops beating: node 0 reports it, with its ranks and host, once fault_timeout_s has passed
        lost = _wait_for(lambda: boards[0].lost(), 5.0)
        assert [(r.rank, r.host, r.reported) for r in lost] == [(1, "host1", False)]
        assert "node 1 (ranks [1]) stopped answering" in lost[0].cause
        record = _record(1, False, 3.0)
        boards[1].publish([record])
        # one look may miss the store's short timeout on a loaded machine (it then reads as "no news")
        assert _wait_for(lambda: boards[0].others_failed(), 5.0)
        boards[1].publish([record])
        # node 0 has written nothing and stopped beating: node 1 does not wait for it, and names it lost
        gathered = boards[1].gather()
        assert [(r.rank, r.host) for r in gathered] == [(0, "host0")] and "stopped answering" in gathered[0].cause
        boards[0].publish([])
        assert boards[0].gather() == [record]
    finally:
        for board in boards:
            board.close()
        del server
    # with its store gone, node 1 names the store once it has been silent for fault_timeout_s
    lost = _wait_for(lambda: boards[1].lost(), 5.0)
    assert [r.role for r in lost] == ["rendezvous store"]


@pytest.mark.timeout(60)
def test_a_store_that_is_not_up_yet_is_not_a_lost_node():
    board = FaultBoard("127.0.0.1", free_port(), "t", 1, 2, "h", fault_timeout_s=0.5)
    time.sleep(0.6)
    assert board.lost() == [] and not board.others_failed()


@pytest.mark.timeout(60)
def test_an_interrupt_once_the_workers_started_is_told_before_the_board_first_answered():
    # the signal may come between the workers' start and the watchdog's first call to the store
    import torch.distributed as dist

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    boards = [FaultBoard("127.0.0.1", port, "t", n, 2, f"host{n}", fault_timeout_s=2.0) for n in range(2)]
    try:
        record = _record(1, False, 3.0)
        assert not boards[1].publish_interrupt(record)  # no rendezvous yet: no one to tell
        assert not _wait_for(lambda: boards[0].others_failed(), 0.3)
        boards[1].rendezvous_met()
        assert boards[1].publish_interrupt(record)
        assert _wait_for(lambda: boards[0].others_failed(), 5.0)
        assert boards[0].gather() == [record]
    finally:
        for board in boards:
            board.close()
        del server
