"""The timer's contention rule on made-up signals, and on a real CPU hog beside a real ``dlperf bench``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlperf.timing import (
    MIN_TICKS,
    ContentionMonitor,
    ContentionSignals,
    Timing,
    best_of,
    judge_contention,
    median_of,
    per_call_samples,
    time_steps,
)

SRC = str(Path(__file__).resolve().parents[1] / "src")


def signals(**kw) -> ContentionSignals:
    """A quiet 2-thread window on 2 cores, changed by ``kw``."""
    base = dict(wall_s=1.0, cpu_s=1.95, threads=2, cores=2, run_s=1.95, wait_s=0.01, others_mean=0.0,
                others_max=0, load1=1.9, steal_ticks=0, total_ticks=200)
    base.update(kw)
    return ContentionSignals(**base)


def test_a_quiet_window_is_not_contended():
    verdict = judge_contention(signals())
    assert not verdict.contended and verdict.reason is None


def test_a_hog_on_one_of_two_cores_is_contended_and_the_reason_gives_the_numbers():
    verdict = judge_contention(signals(cpu_s=1.1, run_s=1.1, wait_s=0.9, others_mean=1.0, others_max=1, load1=3.2))
    assert verdict.contended
    assert verdict.reason.startswith("threads waited for a CPU 45% of the time")
    assert "cpu 1.1 of 2.0 cores" in verdict.reason and "load 3.2 on 2 cores" in verdict.reason


def test_waiting_needs_another_task_to_blame():
    # our own helper threads queued behind the workers: no other process was ever seen runnable
    assert not judge_contention(signals(run_s=1.0, wait_s=1.0, others_mean=0.0, others_max=0)).contended


@pytest.mark.parametrize("wait_fraction, contended", [(0.10, False), (0.20, True)])
def test_the_wait_limit(wait_fraction, contended):
    run = 1.0
    wait = run * wait_fraction / (1 - wait_fraction)
    assert judge_contention(signals(run_s=run, wait_s=wait, others_max=1)).contended is contended


def test_more_threads_than_cores_may_wait_for_each_other():
    # 4 threads on 2 cores queue half the time by themselves; only waiting beyond that counts
    assert not judge_contention(signals(threads=4, run_s=2.0, wait_s=2.0, others_max=1)).contended
    assert judge_contention(signals(threads=4, run_s=2.0, wait_s=6.0, others_max=1)).contended


def test_steal_counts_only_over_enough_ticks():
    assert judge_contention(signals(steal_ticks=20, total_ticks=200)).reason.startswith("steal 10% of CPU time")
    assert not judge_contention(signals(steal_ticks=4, total_ticks=200)).contended  # 2%
    assert not judge_contention(signals(steal_ticks=5, total_ticks=MIN_TICKS - 1)).contended


def test_a_window_too_short_to_judge_is_not_marked():
    assert not judge_contention(signals(wall_s=0.003, cpu_s=0.003, run_s=0.003, wait_s=0.003,
                                        others_mean=3.0, others_max=3)).contended


@pytest.mark.parametrize("cores_used, others, contended", [
    (1.0, 1.0, True),    # half the cores asked for, and another task runnable: contended
    (1.0, 0.0, False),   # tiny ops use one thread on a quiet machine
    (1.9, 1.0, False),   # another task ran, but not on our cores
])
def test_without_schedstat_low_cpu_use_counts_only_beside_other_tasks(cores_used, others, contended):
    s = signals(cpu_s=cores_used, run_s=None, wait_s=None, others_mean=others, others_max=int(others))
    assert judge_contention(s).contended is contended


def test_timing_keeps_the_verdict_and_the_warmup_times():
    verdict = judge_contention(signals(run_s=1.0, wait_s=1.0, others_max=1))
    t = Timing.from_samples([0.1, 0.1, 0.1], warmup_samples=[0.9], contention=verdict)
    assert t.contended and t.first_call_overhead_s == pytest.approx(0.8)
    d = t.to_dict()
    assert d["contended"] is True and d["contention"]["wait_fraction"] == 0.5
    assert d["warmup_samples"] == [0.9]
    assert Timing.from_samples([0.1]).to_dict()["contention"] is None


def test_the_monitor_reads_this_machine():
    monitor = ContentionMonitor(threads=1)
    monitor.start()
    # busy for 50 ms of this thread's own CPU time, so that there is CPU time to account for: 50 ms of wall time
    # gave it only 6-11 ms of a core on a loaded machine
    end = time.thread_time() + 0.05
    while time.thread_time() < end:
        monitor.sample()
    s = monitor.stop().signals
    assert s.wall_s >= 0.05 and 0 < s.cpu_s <= s.wall_s * s.cores + 0.05
    assert s.cores == len(os.sched_getaffinity(0))
    if Path("/proc/self/task").exists():
        assert s.run_s is not None and s.run_s > 0.02 and s.others_mean is not None


def test_time_steps_judges_the_timed_steps_with_the_threads_given():
    t = time_steps(lambda: sum(range(10_000)), warmup=1, steps=3, threads=3)
    assert t.contention is not None and t.contention.signals.threads == 3
    assert len(t.warmup_samples) == 1


# --- a real hog beside a real bench ----------------------------------------------------------

HOG = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nprint('spinning', flush=True)\nwhile True: pass\n"
BENCH = ["bench", "--networks", "lenet", "--threads", "1,2", "--steps", "3", "--warmup", "1", "--batch-size", "64"]


def _bench(tmp_path: Path) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": SRC}
    env.pop("PYTEST_CURRENT_TEST", None)
    done = subprocess.run([sys.executable, "-m", "dlperf.cli", *BENCH, "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), done.stdout


def _two_cores() -> list[int]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores: one for the hog, one free")
    return cores


@pytest.mark.subprocess
@pytest.mark.timeout(240)
def test_a_cpu_hog_on_one_core_marks_the_two_thread_cell(tmp_path):
    core = _two_cores()[0]
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(core)], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout.readline().strip() == "spinning"
        doc, table = _bench(tmp_path)
    finally:
        hog.kill()
        hog.wait(timeout=30)
        hog.stdout.close()
    assert doc["contended"] is True
    cells = {c["threads"]: c for c in doc["cells"]}
    two = cells[2]
    # two threads on two cores, one of them shared with the hog: every step waits for it
    assert two["contended"] is True and "waited for a CPU" in two["contention"]
    for cell in doc["cells"]:
        assert cell["contended"] is (cell["contention"] is not None)
        if cell["contended"]:
            label = "2 threads" if cell["threads"] == 2 else "1 thread"
            assert f"! lenet, cpu(0) {label}: " in table
    assert table.count("!") >= 1 + sum(c["contended"] for c in doc["cells"])  # the marks and the note


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_quiet_run_is_not_marked(tmp_path):
    """The same run without the hog; the machine is shared, so one clean run in three is enough."""
    reasons = []
    for attempt in range(3):
        run = tmp_path / str(attempt)
        run.mkdir()
        doc, _ = _bench(run)
        if not doc["contended"]:
            assert all(c["contended"] is False and c["contention"] is None for c in doc["cells"])
            return
        reasons.append([c["contention"] for c in doc["cells"] if c["contended"]])
        time.sleep(5)
    pytest.fail(f"every quiet run was marked: {reasons}")


# --- best-of and median-of: one operation's figures, on a fake clock -------------------------------------------
class FakeClock:
    """A clock that moves only when the timed function runs: call i takes ``costs[i]`` seconds."""

    def __init__(self, costs):
        self.now, self.costs, self.calls, self.log = 0.0, list(costs), 0, []

    def perf_counter(self):
        return self.now

    def fn(self):
        self.now += self.costs[self.calls % len(self.costs)]
        self.calls += 1
        self.log.append("call")

    def sync(self):
        self.log.append("sync")


def test_per_call_samples_warms_up_brackets_and_divides(monkeypatch):
    import types

    import dlperf.timing as timing

    clock = FakeClock([5.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0])
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    samples = per_call_samples(clock.fn, reps=3, warmup=1, calls=2, synchronize=clock.sync)
    assert samples == [1.5, 3.5, 7.0]  # the 5 s warm-up call is not timed; blocks of 2 calls, per call
    assert clock.log == ["call", "sync", "sync", "call", "call", "sync", "sync", "call", "call", "sync",
                         "sync", "call", "call", "sync"]


def test_best_and_median_of_against_their_samples(monkeypatch):
    import statistics
    import types

    import dlperf.timing as timing

    costs = [0.0, 3.0, 1.0, 2.0, 9.0]
    for pick, expected in ((best_of, min), (median_of, statistics.median)):
        clock = FakeClock(costs)
        monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
        assert pick(clock.fn, reps=4) == expected(costs[1:])


def test_min_seconds_keeps_taking_blocks(monkeypatch):
    import types

    import dlperf.timing as timing

    clock = FakeClock([1.0])
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    assert len(per_call_samples(clock.fn, reps=2, warmup=0, min_seconds=5.0)) == 5
    with pytest.raises(ValueError, match="reps >= 1"):
        per_call_samples(clock.fn, reps=0)
