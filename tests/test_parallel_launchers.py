"""Launchers: results per rank, a process group around the work, failures and hangs, nothing left behind.

Each process launch costs a few seconds (fresh interpreters import torch), so the launches that succeed
run once per module and the assertions share them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from dlperf.errors import UsageError
from dlperf.parallel.launchers import (
    HOST_ENV,
    LaunchError,
    ProcessLauncher,
    ThreadLauncher,
    free_port,
    rank_host,
    rank_info,
)
from dlperf.parallel.launchers.processes import _failure_message
from dlperf.parallel.launchers.watchdog import Watchdog

HANG_TIMEOUT_S = 6.0
LAST_SUM_STALL_S = 3.0


# --- worker functions: top level, so spawned workers can import them -------------------------------

def _pure(x: int) -> tuple[int, int, int, int]:
    rank, world, local = rank_info()
    return rank, world, local, x * (rank + 1)


def _report(x: int) -> dict:
    import torch.distributed as dist

    t = torch.tensor([float(rank_info().rank)])
    dist.all_reduce(t)
    return {"pure": _pure(x), "allreduced": t.item(), "pid": os.getpid(),
            "initialized": dist.is_initialized(), "backend": dist.get_backend(),
            "master_port": os.environ["MASTER_PORT"]}


def _fail_on_rank_1() -> None:
    import torch.distributed as dist

    if rank_info().rank == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()  # rank 0 waits for a peer that never comes: the launcher must still stop it


def _fail_on_rank_1_leaving_a_child(pid_file: str) -> None:
    import subprocess
    import sys

    if rank_info().rank == 1:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # in the worker's group
        Path(pid_file).write_text(str(child.pid))
        raise ValueError("rank one cannot go on")
    time.sleep(120)  # stopped by the agent once rank 1 failed


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _exit_on_rank_1() -> None:
    import torch.distributed as dist

    if rank_info().rank == 1:
        os._exit(3)  # no exception, no report of its own: the agent's view is all there is
    dist.barrier()


def _fail_first_attempt_on_rank_1() -> tuple[int, int]:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if rank_info().rank == 1 and attempt == 0:
        raise RuntimeError("first attempt fails")
    return rank_info().rank, attempt


def _hang_on_rank_1() -> int:
    if rank_info().rank == 1:
        time.sleep(120)
    return 0


# --- a plain reference for "no process left behind" ----------------------------------------------

def _children() -> set[int]:
    """Live child processes of this process from every /proc/<pid>/stat, except multiprocessing's own
    resource tracker (one per process, started on first use, gone with us)."""
    me, out = os.getpid(), set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z" and b"resource_tracker" not in cmdline:
            out.add(int(entry.name))
    return out


def _handlers() -> dict:
    return {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc to list children")


@pytest.fixture(scope="module")
def launches():
    """Two launches in a row: 3 workers on a port we name, then 2 on a free one the launcher picks."""
    children, handlers, port = _children(), _handlers(), free_port()
    three = ProcessLauncher(3, master_port=port, join_timeout_s=90).launch(_report, 7)
    two = ProcessLauncher(2, join_timeout_s=90).launch(_report, 7)
    return {"2": two, "3": three, "port": port, "children_before": children, "children_after": _children(),
            "handlers_before": handlers, "handlers_after": _handlers()}


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_results_come_back_per_rank_in_order(launches, world):
    results = launches[str(world)]
    assert [r["pure"] for r in results] == [(rank, world, rank, 7 * (rank + 1)) for rank in range(world)]
    assert len({r["pid"] for r in results} | {os.getpid()}) == world + 1
    assert all(r["initialized"] and r["backend"] == "gloo" for r in results)


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_allreduce_of_ranks_is_the_sum_of_ranks_on_every_rank(launches, world):
    assert [r["allreduced"] for r in launches[str(world)]] == [world * (world - 1) / 2] * world


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_a_second_launch_works_on_a_new_port(launches):
    # the second launch ran after the first had torn its process group and rendezvous store down
    assert launches["2"][0]["master_port"] != launches["3"][0]["master_port"]
    assert ProcessLauncher(2).master_port is None


@needs_proc
@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_launches_leave_no_process_or_signal_handler_behind(launches):
    assert launches["children_after"] <= launches["children_before"]
    assert launches["handlers_after"] == launches["handlers_before"]


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_thread_launcher_gives_the_process_launchers_results(launches):
    assert ThreadLauncher(2).launch(_pure, 7) == [r["pure"] for r in launches["2"]]


@needs_proc
@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_an_exception_in_rank_1_is_one_error_naming_rank_1():
    before = _children()
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"rank 1 failed: ValueError: rank one cannot go on"):
        ProcessLauncher(2, join_timeout_s=50).launch(_fail_on_rank_1)
    assert time.monotonic() - t0 < 25  # the agent stops rank 0 at once; no waiting for the join timeout
    assert _children() <= before


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_rank_that_raises_leaves_no_traceback_file_of_torchs_behind(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where torch's spawn puts its traceback files
    with pytest.raises(LaunchError, match=r"rank 1 failed: ValueError: rank one cannot go on") as info:
        ProcessLauncher(2, join_timeout_s=50).launch(_fail_on_rank_1)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("pytorch-errorfile-")] == []
    assert "Traceback" in Path(info.value.log_path).read_text()  # torch read it first: it is in the kept log


@needs_proc
@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_failed_watchdog_neither_hides_the_ranks_failure_nor_leaves_their_processes(tmp_path, monkeypatch,
                                                                                       capsys):

    def broken(self):
        raise OSError("the markers went away")

    monkeypatch.setattr(Watchdog, "_run", broken)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # (its death is reported as it happens)
    before, pid_file = _children(), tmp_path / "child.pid"
    with pytest.raises(LaunchError, match=r"rank 1 failed: ValueError: rank one cannot go on"):
        ProcessLauncher(2, join_timeout_s=50).launch(_fail_on_rank_1_leaving_a_child, str(pid_file))
    assert not _alive(int(pid_file.read_text()))  # the workers' leftovers are killed all the same
    assert _children() <= before
    assert "the launch watchdog failed too (OSError: the markers went away)" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_an_interrupt_is_published_and_raised_even_when_the_watchdog_failed(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace


    def broken(self):
        raise OSError("the markers went away")

    def interrupted():
        raise KeyboardInterrupt

    published: list = []
    monkeypatch.setattr(Watchdog, "_run", broken)
    monkeypatch.setattr(Watchdog, "publish_interrupt", lambda self: published.append(self.interrupted))
    monkeypatch.setattr(threading, "excepthook", lambda args: None)
    watchdog = Watchdog(str(tmp_path), 1, 60.0, SimpleNamespace(node_rank=1))
    with pytest.raises(KeyboardInterrupt):
        ProcessLauncher(1)._run(interrupted, (), watchdog, tmp_path, "host")
    assert published == [signal.SIGINT]  # the other nodes still hear of it
    assert "the launch watchdog failed too (OSError: the markers went away)" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_rank_that_exits_without_an_exception_is_named_with_its_exit_code():
    with pytest.raises(LaunchError, match=r"rank 1 failed: exited with code 3"):
        ProcessLauncher(2, join_timeout_s=50).launch(_exit_on_rank_1)


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_the_agent_restarts_failed_workers_up_to_max_restarts():
    assert ProcessLauncher(2, max_restarts=1, join_timeout_s=80).launch(_fail_first_attempt_on_rank_1) == [
        (0, 1), (1, 1)]


@needs_proc
@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_hung_rank_fails_within_the_join_timeout_and_is_killed():
    before = _children()
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"join_timeout_s=6 s \(ranks still running: \[(0, )?1\]\)"):
        ProcessLauncher(2, join_timeout_s=HANG_TIMEOUT_S).launch(_hang_on_rank_1)
    assert time.monotonic() - t0 < HANG_TIMEOUT_S + 5
    assert _children() <= before


@needs_proc
@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_ctrl_c_during_a_launch_stops_the_workers_and_raises_keyboard_interrupt():
    before = _children()
    ctrl_c = threading.Timer(4.0, os.kill, (os.getpid(), signal.SIGINT))
    ctrl_c.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ProcessLauncher(2, join_timeout_s=50).launch(_hang_on_rank_1)
    finally:
        ctrl_c.cancel()
        ctrl_c.join()
    assert _children() <= before


def _last_sum_with_a_slow_peer() -> list[float]:
    """One shared-memory sum, the function's last; rank 1 reaches its final barrier late, and rank 0, having
    seen it missing there, looks again only after rank 1 had time to finish and leave."""
    import torch.distributed as dist

    from dlperf import _shm as shm_segment
    from dlperf.parallel.allreduce import shm as shm_module
    from dlperf.parallel.allreduce.shm import host_allreduce_

    rank = rank_info().rank
    host_allreduce_(torch.zeros(1))  # the segment is set up
    if rank == 1:
        reduce = shm_module._Chunks.reduce

        def late_reduce(self, i):
            time.sleep(0.5)
            reduce(self, i)

        shm_module._Chunks.reduce = late_reduce
    else:
        wait, real_time = shm_segment.SequenceBarrier._wait, shm_segment.time

        class StallOnce:
            """``time`` for the barrier: its second look at the clock in a chunk barrier's wait, right after
            it found the peer missing, lasts STALL_S."""

            calls = None

            def monotonic(self):
                if self.calls is not None:
                    self.calls += 1
                    if self.calls == 2:
                        self.calls = None
                        real_time.sleep(LAST_SUM_STALL_S)
                return real_time.monotonic()

            def __getattr__(self, name):
                return getattr(real_time, name)

        stall = shm_segment.time = StallOnce()

        def stalled_wait(self, seq, context):
            if "chunk" in context and stall.calls is None:
                stall.calls = 0
            return wait(self, seq, context)

        shm_segment.SequenceBarrier._wait = stalled_wait
    dist.barrier()  # both start the sum together
    t = torch.ones(4) * (rank + 1)
    host_allreduce_(t)
    return t.tolist()


@needs_proc
@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_rank_done_first_does_not_close_the_shared_memory_under_a_peer_still_leaving_the_last_sum():
    from dlperf._shm import spin_barrier_supported

    if not spin_barrier_supported():
        pytest.skip("shared-memory allreduce needs Linux memfd and x86-64")
    assert ProcessLauncher(2, join_timeout_s=80).launch(_last_sum_with_a_slow_peer) == [[3.0] * 4] * 2


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_port_taken_before_the_store_binds_it_is_one_clear_error_or_with_a_picked_port_another_try(monkeypatch):
    import socket

    from dlperf.parallel.launchers import processes

    with socket.create_server(("127.0.0.1", 0)) as taken:  # another program got there first
        busy = taken.getsockname()[1]
        with pytest.raises(LaunchError, match=rf"the rendezvous store on 127.0.0.1:{busy} could not be hosted "
                                              r"\(.*\); pick another free master_port") as info:
            ProcessLauncher(1, master_port=busy, join_timeout_s=60).launch(_pure, 1)
        assert "\n" not in str(info.value)
        picks = iter([busy])
        monkeypatch.setattr(processes, "free_port", lambda host: next(picks, None) or free_port(host))
        assert ProcessLauncher(1, join_timeout_s=60).launch(_pure, 1) == [(0, 1, 0, 1)]


# --- no processes ---------------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_thread_launcher_names_the_failing_rank():
    def fail_on_1():
        if rank_info().rank == 1:
            raise KeyError("nope")
        return rank_info()

    with pytest.raises(LaunchError, match=r"rank 1 failed: KeyError"):
        ThreadLauncher(3).launch(fail_on_1)
    assert rank_info() == (0, 1, 0)  # the caller's thread is no worker


@pytest.mark.timeout(30)
def test_rank_info_reads_the_agents_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert rank_info() == (3, 4, 1)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(LaunchError, match="RANK='x'"):
        rank_info()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kwargs, message", [
    ({"nproc_per_node": 0}, "nproc_per_node=0"),
    ({"nproc_per_node": 2, "nnodes": 2}, "master_port=None with nnodes=2"),
    ({"nproc_per_node": 2, "node_rank": 1}, "node_rank=1"),
    ({"nproc_per_node": 2, "master_port": 70000}, "master_port=70000"),
    ({"nproc_per_node": 2, "join_timeout_s": 0}, "join_timeout_s=0"),
    ({"nproc_per_node": 2, "max_restarts": -1}, "max_restarts=-1"),
])
def test_bad_process_launcher_settings_are_named(kwargs, message):
    with pytest.raises(UsageError, match=message):
        ProcessLauncher(**kwargs)


@pytest.mark.timeout(30)
def test_a_function_that_cannot_reach_the_workers_fails_before_any_process_starts():
    with pytest.raises(UsageError, match="top level"):
        ProcessLauncher(2).launch(lambda: 0)


def test_failure_message_without_an_error_file_says_how_the_process_ended():
    class Failure:
        error_file_data: dict = {}

        def __init__(self, exitcode):
            self.exitcode = exitcode

        def signal_name(self):
            return "SIGKILL"

    assert _failure_message(Failure(-9)) == "killed by SIGKILL (exit code -9)"
    assert "exited with code 1" in _failure_message(Failure(1))


def test_rank_host_is_the_launchers_label_for_the_host_else_the_host_name(monkeypatch):
    import socket

    monkeypatch.delenv(HOST_ENV, raising=False)
    assert rank_host() == socket.gethostname()
    monkeypatch.setenv(HOST_ENV, f"{socket.gethostname()} (10.77.0.2)")  # a node of a launch over namespaces
    assert rank_host() == f"{socket.gethostname()} (10.77.0.2)"


def test_kept_launch_logs_are_private_and_bounded(tmp_path, monkeypatch):
    import tempfile

    from dlperf.parallel.launchers import processes

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    logs = processes._log_dir()
    assert logs.parent == tmp_path and (logs.stat().st_mode & 0o777) == 0o700
    for i in range(processes._KEPT_LOGS + 5):
        path = logs / f"dlperf-agent-1-{i:04d}.log"
        path.write_text("x")
        os.utime(path, (1000 + i, 1000 + i))
    assert processes._log_dir() == logs
    left = sorted(p.name for p in logs.iterdir())
    assert len(left) == processes._KEPT_LOGS - 1  # room for the new launch's log
    assert left[-1] == f"dlperf-agent-1-{processes._KEPT_LOGS + 4:04d}.log"  # the newest are kept
    logs.chmod(0o777)  # a directory others may write to (made by someone else, say) is not used
    other = processes._log_dir()
    assert other != logs and other.name.startswith("dlperf-logs-") and other.parent == tmp_path


def test_a_launch_config_and_keyword_options_build_the_same_launcher():
    from dlperf.parallel.launchers import LaunchConfig

    by_config = ProcessLauncher(LaunchConfig(2, join_timeout_s=90, roles={1: "server"}))
    by_options = ProcessLauncher(2, join_timeout_s=90, roles={1: "server"})
    for name in ("nproc_per_node", "nnodes", "join_timeout_s", "collective_timeout_s", "roles", "backend"):
        assert getattr(by_config, name) == getattr(by_options, name), name
    assert by_options.collective_timeout_s == 90.0 and by_options.roles == {1: "server"}
    with pytest.raises(UsageError, match="not both"):
        ProcessLauncher(LaunchConfig(2), nnodes=1)
    with pytest.raises(UsageError, match="the options are nproc_per_node, nnodes"):
        ProcessLauncher(2, join_timeout=90)


CTRL_C_SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
import support.slow_import as slow  # imported here at full speed: only the workers are slow
from dlperf.parallel.launchers import ProcessLauncher
os.environ["SLOW_IMPORT_MARKERS"] = {markers!r}
try:
    ProcessLauncher(2).launch(slow.work)
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)
"""


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ctrl_c_while_the_workers_import_is_the_launchers_alone(tmp_path):
    """The terminal's Ctrl-C reaches every process of its group, the workers importing too: they print nothing."""
    import signal
    import subprocess
    import sys
    import time

    markers = tmp_path / "markers"
    markers.mkdir()
    script = CTRL_C_SCRIPT.format(tests=str(Path(__file__).parent), markers=str(markers))
    env = {**os.environ, "SLOW_IMPORT_S": "20"}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True,  # its own group: the Ctrl-C below reaches it alone
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 90
        while len(list(markers.glob("*.importing"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the whole foreground group
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and err.strip() == "interrupted", err
    assert "Traceback" not in err + out and "KeyboardInterrupt" not in err, err
    for marker in markers.glob("*.importing"):  # no worker outlives the launch
        pid = int(marker.name.split(".")[0])
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
