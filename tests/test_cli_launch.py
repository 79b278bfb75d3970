"""``dlperf launch`` and ``dlperf train --nproc-per-node``: real processes train like one process with as
many devices, the first process prints and checkpoints, a script runs under dlperf launch and under plain
torchrun, and bad input is one line and status 2 before any process starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dlperf.cli import main
from dlperf.parallel.training.checkpoint import load_checkpoint

SRC = str(Path(__file__).resolve().parents[1] / "src")
SMALL = ["--train-size", "512", "--test-size", "128", "--batch-size", "64", "--lr", "0.1", "--no-progress"]

SCRIPT = textwrap.dedent('''
    import os
    import sys
    import torch
    from dlperf.devices import cpu
    from dlperf.models import get_spec
    from dlperf.parallel import Trainer

    spec = get_spec("lenet")
    torch.manual_seed(0)
    net = spec.build()
    X, y = spec.input.make_batch(16, generator=torch.Generator().manual_seed(1))
    torch.set_num_threads(1)
    with Trainer(net, [cpu(0)], "sgd", {"lr": 0.1}, loss=spec.loss) as trainer:
        for _ in range(2):
            trainer.train_step(X, y)
        params = [p.detach().contiguous() for p in trainer.module.parameters()]
        torch.save({"rank": trainer.rank, "world": trainer.world, "params": params,
                    "num_servers": os.environ.get("DLPERF_NUM_SERVERS")},
                   f"{sys.argv[1]}.{trainer.rank}")
''')


def _reference_params() -> list[torch.Tensor]:
    from dlperf.devices import cpu
    from dlperf.models import get_spec
    from dlperf.parallel import Trainer

    spec = get_spec("lenet")
    torch.manual_seed(0)
    net = spec.build()
    X, y = spec.input.make_batch(16, generator=torch.Generator().manual_seed(1))
    with Trainer(net, [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, loss=spec.loss) as trainer:
        for _ in range(2):
            trainer.train_step(X, y)
        return [p.detach().contiguous() for p in trainer.module.parameters()]


def _check_script_outputs(out: Path, num_servers: str | None = None) -> None:
    ref = _reference_params()
    for rank in (0, 1):
        got = torch.load(f"{out}.{rank}", weights_only=True)
        assert (got["rank"], got["world"], got["num_servers"]) == (rank, 2, num_servers)
        for a, b in zip(got["params"], ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _one_error_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_train_as_two_processes_equals_two_devices_and_checkpoints_resume(tmp_path, capfd):
    ck = tmp_path / "ck.pt"
    # 513 examples in batches of 64: each epoch ends with a batch of 1, fewer than the 2 devices of the two
    # processes together; both skip it, as one process with two devices does
    assert main(["train", "--nproc-per-node", "2", "--epochs", "1", "--checkpoint", str(ck), *SMALL,
                 "--train-size", "513"]) == 0
    out = capfd.readouterr().out.splitlines()
    # one process prints: one epoch line, one summary
    assert sum(line.startswith("epoch 1:") for line in out) == 1
    assert out[-1].endswith("on [cpu(0)] x 2 processes")
    assert out[-2].startswith("straggler: ") and sum(line.startswith("straggler: ") for line in out) == 1
    saved = load_checkpoint(ck)
    assert saved["config"]["processes"] == 2 and len(saved["history"]) == 1

    assert main(["launch", "--nproc-per-node", "2", "--", "train", "--epochs", "2", "--resume", str(ck), "--json",
                 *SMALL, "--train-size", "513"]) == 0
    doc = json.loads(capfd.readouterr().out.splitlines()[-1])
    assert doc["processes"] == 2 and [e["epoch"] for e in doc["epochs"]] == [1, 2]

    # the same two epochs in one process on two devices: the same losses and accuracies
    assert main(["train", "--devices", "cpu:0,cpu:1", "--epochs", "2", "--json", *SMALL, "--train-size", "513"]) == 0
    ref = json.loads(capfd.readouterr().out.splitlines()[-1])
    for ours, theirs in zip(doc["epochs"], ref["epochs"]):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4)
        assert ours["test_acc"] == pytest.approx(theirs["test_acc"], abs=1 / 128 + 1e-9)

    # resuming with another process count is refused before any process starts
    assert main(["train", "--nproc-per-node", "3", "--epochs", "2", "--resume", str(ck), *SMALL,
                 "--train-size", "513"]) == 2
    _one_error_line(capfd.readouterr().err, "settings differ", "'processes': (2, 3)")


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_script_under_dlperf_launch(tmp_path, capfd):
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "params"
    assert main(["launch", "--nproc-per-node", "2", "--num-servers", "1", "--", str(script), str(out)]) == 0
    _check_script_outputs(out, num_servers="1")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_script_under_plain_torchrun(tmp_path):
    script = tmp_path / "train_script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "params"
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(out)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_script_outputs(out)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_nodes_on_one_host_as_in_the_readme(tmp_path):
    from dlperf.parallel.launchers import free_port
    from dlperf.parallel.launchers.faults import session_members

    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC}
    # each node in a session of its own: whatever it leaves running is found there afterwards
    nodes = [subprocess.Popen([sys.executable, "-m", "dlperf.cli", "launch", "--nproc-per-node", "1", "--nnodes", "2",
                               "--node-rank", str(r), "--master", f"127.0.0.1:{port}", "--", "train", "--devices",
                               "cpu:0", "--epochs", "1", "--json", *SMALL],
                              env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
             for r in (0, 1)]
    outs = []
    try:
        for node in nodes:
            out, err = node.communicate(timeout=200)
            assert node.returncode == 0, err[-3000:]
            outs.append(out)
        deadline = time.monotonic() + 5  # multiprocessing's resource tracker leaves as its launcher's pipe closes
        while any(session_members(n.pid) for n in nodes) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [session_members(n.pid) for n in nodes] == [[], []]
    finally:
        for node in nodes:
            for pid in [node.pid] * (node.poll() is None) + session_members(node.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            node.wait()
    docs = [json.loads(o.splitlines()[-1]) for o in outs if o.strip()]
    assert len(docs) == 1 and docs[0]["processes"] == 2  # one process of the two nodes reports


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_failing_script_is_one_line_and_status_1(tmp_path, capfd):
    script = tmp_path / "fails.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('rank one is broken')\n")
    assert main(["launch", "--nproc-per-node", "2", "--", str(script)]) == 1
    err = capfd.readouterr().err
    assert "dlperf launch: error: rank 1 failed: ValueError: rank one is broken" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,needles", [
    (["launch", "--nproc-per-node", "2"], ["no command to launch"]),
    (["launch", "--nproc-per-node", "2", "--"], ["no command to launch"]),
    (["launch", "--nproc-per-node", "0", "--", "train"], ["--nproc-per-node", "'0' is out of range"]),
    (["launch", "--nproc-per-node", "2", "--nnodes", "2", "--", "train"], ["needs --master HOST:PORT"]),
    (["launch", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", "--master", "h:1", "--", "train"],
     ["--node-rank 2 with --nnodes 2"]),
    (["launch", "--nproc-per-node", "2", "--master", "nohost", "--", "train"], ["is not HOST:PORT"]),
    (["launch", "--nproc-per-node", "2", "--master", "h:70000", "--", "train"], ["is not HOST:PORT"]),
    (["launch", "--nproc-per-node", "2", "--num-servers", "-1", "--", "train"], ["--num-servers"]),
    (["launch", "--nproc-per-node", "2", "--", "nosuch"], ["neither a dlperf verb", "nor a Python script"]),
    (["launch", "--nproc-per-node", "2", "--", "missing_script.py"], ["'missing_script.py' does not exist"]),
    (["launch", "--nproc-per-node", "2", "--", "train", "--batch-size", "1"],
     ["--batch-size 1 is smaller than the 2 devices (2 processes x 1)"]),
    (["launch", "--nproc-per-node", "2", "--", "train", "--bogus"], ["unrecognized arguments: --bogus"]),
    (["launch", "--nproc-per-node", "2", "--", "train", "--nproc-per-node", "2"], ["give the process count once"]),
    (["train", "--nproc-per-node", "0"], ["--nproc-per-node", "out of range"]),
    (["train", "--nproc-per-node", "2", "--kvstore", "local"], ["--kvstore local with 2 processes"]),
    (["train", "--nproc-per-node", "3", "--devices", "cpu:0,cpu:1", "--batch-size", "5"],
     ["smaller than the 6 devices (3 processes x 2)"]),
])
def test_bad_input_is_one_line_and_status_2_before_any_process(argv, needles, capfd):
    assert main(argv) == 2
    captured = capfd.readouterr()
    _one_error_line(captured.err, *needles)
    assert captured.out == ""


@pytest.mark.parametrize("value,needle", [
    ("1e300", "out of range"), ("1e-9", "too short"), ("0.5", "too short"), ("nan", "not a finite number"),
    ("inf", "not a finite number"), ("-3", "out of range"), ("soon", "not a number"),
])
def test_timeouts_out_of_range_are_one_line_and_status_2(value, needle, capfd):
    assert main(["launch", "--nproc-per-node", "1", "--timeout", value, "--", "train"]) == 2
    captured = capfd.readouterr()
    _one_error_line(captured.err, "--timeout", needle)


def _launch_cli(args: list[str], tmp_path: Path, **popen: object) -> subprocess.Popen:
    """``dlperf launch ARGS`` in a child process whose temporary files go under ``tmp_path``."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": SRC}
    return subprocess.Popen([sys.executable, "-c", "import sys; from dlperf.cli import main; "
                             "sys.exit(main(sys.argv[1:]))", "launch", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **popen)


def _closed_port() -> int:
    from dlperf.parallel.launchers import free_port

    return free_port()  # free a moment ago: nothing listens there


def _no_launch_dirs_left(tmp_path: Path) -> None:
    assert not list(tmp_path.glob("dlperf-launch-*")), list(tmp_path.iterdir())


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_an_unreachable_master_fails_within_the_timeout_in_one_line(tmp_path):
    start = time.monotonic()
    proc = _launch_cli(["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1", "--master",
                        f"127.0.0.1:{_closed_port()}", "--timeout", "4", "--", "train", "--epochs", "1"], tmp_path)
    _, err = proc.communicate(timeout=90)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, err
    _one_error_line(err, "could not be reached")
    assert "frame #" not in err
    assert elapsed < 60  # start-up on a loaded machine, then the rendezvous bounded by --timeout 4
    _no_launch_dirs_left(tmp_path)
    logs = list(tmp_path.glob("dlperf-logs-*/dlperf-agent-*.log"))
    assert all(str(log) in err for log in logs)  # a log that is kept is named by the line


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_node_missing_at_rendezvous_is_one_line_within_the_timeout(tmp_path):
    proc = _launch_cli(["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "0", "--master",
                        f"127.0.0.1:{_closed_port()}", "--timeout", "4", "--", "train", "--epochs", "1"], tmp_path)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 1, err
    _one_error_line(err, "rendezvous", "did not complete within join_timeout_s=4 s", "start all 2 nodes")
    assert "RendezvousTimeoutError" in err and "Traceback" not in err
    _no_launch_dirs_left(tmp_path)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_sigterm_while_waiting_in_rendezvous_cleans_up_and_says_so(tmp_path):
    proc = _launch_cli(["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "0", "--master",
                        f"127.0.0.1:{_closed_port()}", "--timeout", "60", "--", "train", "--epochs", "1"], tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("dlperf-launch-*")):  # the launch has begun its rendezvous
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    _one_error_line(err, "stopped by SIGTERM")
    _no_launch_dirs_left(tmp_path)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_run_that_restarts_and_succeeds_shows_no_agent_output(tmp_path, capfd):
    script = tmp_path / "flaky.py"
    script.write_text("import os\nif os.environ['RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
                      "    raise ValueError('first attempt fails')\n")
    assert main(["launch", "--nproc-per-node", "2", "--max-restarts", "1", "--", str(script)]) == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "frame #" not in err and "first attempt fails" not in err, err


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_failed_rank_keeps_the_agent_output_in_the_named_log(tmp_path, capfd):
    script = tmp_path / "fails.py"
    script.write_text("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('rank one is broken')\n")
    assert main(["launch", "--nproc-per-node", "2", "--", str(script)]) == 1
    err = capfd.readouterr().err
    _one_error_line(err, "rank 1 failed: ValueError: rank one is broken")
    assert "Traceback" not in err
    if "torch's log: " in err:
        log = Path(err.split("torch's log: ")[1].split(")")[0])
        assert log.is_file()
        log.unlink()
