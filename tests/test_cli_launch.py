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
from dlperf.parallel.checkpoint import load_checkpoint

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
