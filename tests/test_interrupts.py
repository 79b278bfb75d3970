"""Ctrl-C and SIGKILL against real ``dlperf`` processes: finished work is kept, nothing hangs."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))
TRAIN_SMALL = ["--train-size", "1200", "--test-size", "200", "--batch-size", "64", "--no-progress"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


class _Process:
    """A dlperf subprocess whose stdout and stderr are read by threads (a full pipe must not block it)."""

    def __init__(self, argv: list[str], module: str = "dlperf.cli", env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", module, *argv], env={**_env(), **(env or {})},
                                     stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     # Ctrl-C must reach the child as it would from a terminal
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._drain, args=(s, buf), daemon=True)
                         for s, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()

    @staticmethod
    def _drain(stream, buf: list[str]) -> None:
        for line in stream:
            buf.append(line)

    def wait_for(self, buf: list[str], text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in list(buf)):
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the readers catch the last lines
                if any(text in line for line in list(buf)):
                    return
                raise AssertionError(f"exited {self.proc.returncode} before {text!r}: {''.join(self.err)[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {text!r} within {timeout} s: {''.join(self.err)[-2000:]}")
            time.sleep(0.02)

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout=timeout)
        for t in self._readers:
            t.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        for t in self._readers:
            t.join(5)
        for s in (self.proc.stdout, self.proc.stderr):
            s.close()


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_ctrl_c_in_bench_keeps_finished_cells_in_every_output(tmp_path):
    js, csv_file, md = tmp_path / "t.json", tmp_path / "t.csv", tmp_path / "t.md"
    p = _Process(["bench", "--networks", "mlp", "--threads", "1,2", "--batch-size", "64", "--warmup", "1",
                  "--steps", "3000", "--json", str(js), "--csv", str(csv_file), "--markdown", str(md)])
    try:
        p.wait_for(p.err, "cell 2/2", timeout=90)  # the first cell finished
        p.proc.send_signal(signal.SIGINT)
        rc = p.wait(timeout=30)
    finally:
        p.kill()
    err = "".join(p.err)
    assert rc == 130, err
    assert "interrupted after 1 of 2 cells" in err and "Traceback" not in err
    doc = json.loads(js.read_text())
    assert doc["interrupted"] is True and doc["cells_planned"] == 2
    assert [(c["network"], c["threads"]) for c in doc["cells"]] == [("mlp", 1)]
    assert doc["cells"][0]["median_s"] > 0 and len(doc["cells"][0]["samples"]) == 3000
    rows = csv_file.read_text().splitlines()
    assert len(rows) == 2 and rows[1].startswith("mlp,cpu(0),1,64,")
    assert "INTERRUPTED: 1 of 2 cells finished" in md.read_text()
    assert "INTERRUPTED: 1 of 2 cells finished" in "".join(p.out)  # the terminal table's note
    assert _temporaries(tmp_path) == []


def _interrupt_training(tmp_path: Path, rng: random.Random) -> None:
    ck = tmp_path / "run.pt"
    p = _Process(["train", "--devices", "cpu:0,cpu:1", "--checkpoint", str(ck), "--epochs", "1000",
                  *TRAIN_SMALL])
    try:
        p.wait_for(p.out, "epoch 1:", timeout=90)
        time.sleep(rng.uniform(0.0, 1.0))  # anywhere in a later epoch: a step, evaluation, a checkpoint
        sent = time.monotonic()
        p.proc.send_signal(signal.SIGINT)
        rc = p.wait(timeout=30)
        took = time.monotonic() - sent
    finally:
        p.kill()
    err = "".join(p.err)
    assert rc == 130, err
    assert took < 5.0, f"took {took:.1f} s to stop"
    assert "dlperf train: interrupted; " in err and "Traceback" not in err
    from dlperf.parallel.training.checkpoint import load_checkpoint

    state = load_checkpoint(ck)
    assert len(state["history"]) >= 1
    assert _temporaries(tmp_path) == []


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_ctrl_c_in_two_device_training_exits_promptly_with_a_loadable_checkpoint(tmp_path):
    _interrupt_training(tmp_path, random.Random(0))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_in_two_device_training_repeatedly(tmp_path):
    rng = random.Random(1)
    for i in range(5):
        run = tmp_path / str(i)
        run.mkdir()
        _interrupt_training(run, rng)


_SAVER = """
import sys, torch
from dlperf.parallel.training.checkpoint import save_checkpoint
path, n = sys.argv[1], 0
big = torch.randn(4_000_000)  # 16 MB: a write takes long enough to be hit
print("ready", flush=True)
while True:
    n += 1
    save_checkpoint(path, {"n": n, "w": big})
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigkill_during_checkpoint_writes_keeps_the_previous_one_and_the_next_write_cleans_up(tmp_path):
    from dlperf._io import safe_torch_load
    from dlperf.parallel.training.checkpoint import save_checkpoint

    ck = tmp_path / "run.pt"
    rng = random.Random(2)
    orphans = 0
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(ck)], env=_env(), stdout=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            deadline = time.monotonic() + 60
            while not ck.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.05, 0.5))
            proc.kill()
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            proc.stdout.close()
        state = safe_torch_load(ck)  # whole: the old file or the new one
        assert state["n"] >= 1 and state["w"].shape == (4_000_000,)
        orphans = max(orphans, len(_temporaries(tmp_path)))
    assert orphans >= 1, "no kill landed inside a write; the test did not test anything"
    save_checkpoint(ck, {"n": 0, "w": torch.zeros(1)})
    assert _temporaries(tmp_path) == []
    assert safe_torch_load(ck)["n"] == 0


def _processes_with(marker: str) -> list[int]:
    """Processes whose environment holds ``marker`` (the test's own temporary directory): what a run left."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _terminate_once_launching(tmp_path: Path, argv: list[str], said: str) -> None:
    """Run ``dlperf ARGV`` with its own TMPDIR; SIGTERM it once it has a launch directory there (processes are
    starting or running); it must say ``said`` in one line, exit 143 and leave nothing behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = _Process(argv, env={"TMPDIR": str(tmp), "DLPERF_PLAN_CACHE": str(tmp_path / "plans.json")})
    try:
        deadline = time.monotonic() + 150
        while not any(n.startswith("dlperf-launch-") for n in os.listdir(tmp)):
            assert p.proc.poll() is None and time.monotonic() < deadline, "".join(p.err)[-2000:]
            time.sleep(0.05)
        time.sleep(0.5)
        p.proc.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=90)
    finally:
        p.kill()
    err = "".join(p.err)
    assert rc == 143, err
    assert said in err and "Traceback" not in err and "leaked semaphore" not in err, err
    left = [n for n in os.listdir(tmp) if n.startswith(("dlperf-launch-", "pytorch-errorfile-"))]
    assert left == [], left
    deadline = time.monotonic() + 10  # killed process groups take a moment to be reaped
    while _processes_with(str(tmp)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(str(tmp)) == []


PLAN_SMALL = ["--train-size", "200", "--test-size", "50", "--batch-size", "20", "--no-progress", "--epochs", "1"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sigterm_while_planning_measures_process_candidates_is_one_line_and_leaves_nothing(tmp_path):
    _terminate_once_launching(tmp_path, ["train", "--plan", "auto", *PLAN_SMALL], "dlperf train: stopped by SIGTERM")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sigterm_while_a_process_plan_trains_is_one_line_and_leaves_nothing(tmp_path):
    argv = ["train", "--plan", "2x1,processes", *PLAN_SMALL[:-1], "1000"]
    _terminate_once_launching(tmp_path, argv, "stopped by SIGTERM")
