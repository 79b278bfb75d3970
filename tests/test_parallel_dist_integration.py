"""The launcher, the process-spanning Trainer and the distributed KVStore together, in real processes.

``dlperf launch --num-servers S`` makes the last S ranks servers (a lost one is named by its role), a
Trainer with a ``dist_*`` store trains as the allreduce Trainer and one process do, and a process group
restarted after a failure resumes from the checkpoint bit-identically, with or without a dist store.
"""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dlperf.cli import main
from dlperf.parallel.training.checkpoint import load_checkpoint

SMALL = ["--train-size", "512", "--test-size", "64", "--batch-size", "64", "--lr", "0.1", "--no-progress"]

# A server that dies while the workers wait for it: each rank notes its pid; the server notes when it dies.
SERVER_DIES = textwrap.dedent('''
    import os
    import signal
    import sys
    import time
    import torch
    from dlperf.kvstore import create_kvstore
    from dlperf.parallel.launchers import rank_info, rank_role
    from dlperf.parallel.communication.process_group import join_processes

    out = sys.argv[1]
    axis = join_processes()
    kv = create_kvstore("dist_sync")
    with open(f"{out}/pid.{rank_info().rank}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{out}/pid.{rank_info().rank}.tmp", f"{out}/pid.{rank_info().rank}")
    if rank_role() == "server":
        # every worker has noted its pid before the server dies (a worker a loaded machine held back would be
        # stopped unnoted), and is then waiting in init for serve()
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{out}/pid.{r}") for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.0)
        with open(f"{out}/killed", "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    kv.init(0, torch.zeros(4))
    time.sleep(600)  # not reached: init waits for the server
''')

# ``dlperf train`` whose rank 1 kills itself once, before the step ``argv[1]`` of the first attempt, after
# writing the file ``argv[2]``.
DIES_ONCE = textwrap.dedent('''
    import os
    import signal
    import sys
    from dlperf.cli import main
    from dlperf.parallel.launchers import restart_count
    from dlperf.parallel.training.trainer import Trainer

    kill_at, marker = int(sys.argv[1]), sys.argv[2]
    original = Trainer.train_step

    def train_step(self, X, y):
        if restart_count() == 0 and self.rank == 1 and self.steps == kill_at:
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, X, y)

    Trainer.train_step = train_step
    sys.exit(main(sys.argv[3:]))
''')


def _params(path: Path) -> list[torch.Tensor]:
    return list(load_checkpoint(path)["trainer"]["model"].values())


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0); it has exited all the same
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_killed_server_is_named_by_rank_role_and_host_and_every_process_exits(tmp_path, capfd):
    import socket

    script = tmp_path / "server_dies.py"
    script.write_text(SERVER_DIES)
    fault_timeout_s = 30.0  # ProcessLauncher's default
    assert main(["launch", "--nproc-per-node", "3", "--num-servers", "1", "--timeout", "100", "--", str(script),
                 str(tmp_path)]) == 1
    returned = time.time()
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("dlperf launch: error:")]
    assert len(lines) == 1, err[-3000:]
    assert "rank 2 failed: killed by SIGKILL" in lines[0]
    assert "role server" in lines[0] and f"host {socket.gethostname()}" in lines[0]
    assert returned - float((tmp_path / "killed").read_text()) < fault_timeout_s
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(3)]
    assert all(_gone(pid) for pid in pids)


def _one_process_reference(tmp_path: Path, epochs: int) -> list[torch.Tensor]:
    ck = tmp_path / "one.pt"
    assert main(["train", "--devices", "cpu:0", "--epochs", str(epochs), "--checkpoint", str(ck), *SMALL]) == 0
    return _params(ck)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_train_with_dist_sync_across_processes_equals_one_process(tmp_path, capfd):
    ck = tmp_path / "dist.pt"
    # co-located servers: two processes, each a worker with a server for its share of the weights
    assert main(["train", "--nproc-per-node", "2", "--kvstore", "dist_sync", "--epochs", "1", "--checkpoint",
                 str(ck), *SMALL]) == 0
    saved = load_checkpoint(ck)
    assert saved["config"]["kvstore"] == "dist_sync" and "kvstore" in saved["trainer"]
    ref = _one_process_reference(tmp_path, 1)
    got = _params(ck)
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("kvstore", ["dist_sync", "dist_device_sync"])
def test_launch_with_a_server_equals_allreduce_and_one_process(kvstore, tmp_path, capfd):
    ck, allreduce = tmp_path / "server.pt", tmp_path / "allreduce.pt"
    assert main(["launch", "--nproc-per-node", "3", "--num-servers", "1", "--", "train", "--kvstore", kvstore,
                 "--epochs", "1", "--checkpoint", str(ck), *SMALL]) == 0
    assert capfd.readouterr().out.splitlines()[-1].endswith("on [cpu(0)] x 2 processes + 1 server")
    assert main(["train", "--nproc-per-node", "2", "--epochs", "1", "--checkpoint", str(allreduce), *SMALL]) == 0
    ref = _one_process_reference(tmp_path, 1)
    for a, b, c in zip(_params(ck), _params(allreduce), ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def _restart_run(tmp_path: Path, name: str, kill_at: int, extra: list[str], nproc: int = 2) -> Path:
    script = tmp_path / "dies_once.py"
    script.write_text(DIES_ONCE)
    ck = tmp_path / f"{name}.pt"
    servers = ["--num-servers", str(nproc - 2)] if nproc > 2 else []
    status = main(["launch", "--nproc-per-node", str(nproc), *servers, "--max-restarts", "1", "--timeout", "300",
                   "--", str(script), str(kill_at), str(tmp_path / f"{name}.died"),
                   "train", "--epochs", "2", "--checkpoint", str(ck), *extra, *SMALL])
    assert status == 0
    return ck


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("extra,nproc", [([], 2), (["--kvstore", "dist_sync"], 3)], ids=["allreduce", "dist_sync"])
def test_a_rank_that_dies_once_is_restarted_and_resumes_bit_identically(extra, nproc, tmp_path, capfd):
    # 512 examples in batches of 64: 8 steps an epoch; rank 1 dies in the second epoch, after the checkpoint
    # of the first, and the restarted group continues from it
    ck = _restart_run(tmp_path, "restarted", 12, extra, nproc)
    assert (tmp_path / "restarted.died").exists()
    # the restarted group started at epoch 2: epoch 1 was trained (and printed) once
    assert capfd.readouterr().out.count("epoch 1:") == 1
    clean = _restart_run(tmp_path, "clean", -1, extra, nproc)
    assert not (tmp_path / "clean.died").exists()
    saved = load_checkpoint(ck)
    assert [e["epoch"] for e in saved["history"]] == [1, 2]
    assert saved["trainer"]["steps"] == 16
    for a, b in zip(_params(ck), _params(clean), strict=True):
        assert torch.equal(a, b)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,needles", [
    (["launch", "--nproc-per-node", "2", "--num-servers", "2", "--", "train", "--kvstore", "dist_sync"],
     ["--num-servers 2 with 2 processes", "fewer servers than processes"]),
    (["launch", "--nproc-per-node", "3", "--num-servers", "1", "--", "train"],
     ["--num-servers 1 with no --kvstore", "give --kvstore dist_sync"]),
    (["launch", "--nproc-per-node", "3", "--num-servers", "1", "--", "train", "--kvstore", "local"],
     ["--kvstore local"]),
    (["train", "--kvstore", "dist_sync"], ["--kvstore dist_sync in one process", "--nproc-per-node 2"]),
    (["launch", "--nproc-per-node", "3", "--num-servers", "1", "--", "devices"],
     ["--num-servers 1 with devices", "only train"]),
])
def test_bad_server_layouts_are_one_line_and_status_2_before_any_process(argv, needles, capfd):
    assert main(argv) == 2
    captured = capfd.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert all(n in lines[0] for n in needles), lines[0]
    assert captured.out == ""


def _trainer_with_a_server(steps: int) -> list[torch.Tensor] | None:
    """Ranks 0 and 1 train on two devices each through a dist_device_sync store; rank 2 serves it."""
    from dlperf.devices import cpu
    from dlperf.models import get_spec
    from dlperf.parallel import Trainer
    from dlperf.parallel.communication.servers import serve_kvstore
    from dlperf.parallel.launchers import rank_role

    if rank_role() == "server":
        serve_kvstore("dist_device_sync", "sgd", {"lr": 0.1})
        return None
    spec = get_spec("lenet")
    torch.manual_seed(0)
    net = spec.build()
    X, y = spec.input.make_batch(16, generator=torch.Generator().manual_seed(1))
    with Trainer(net, [cpu(0), cpu(1)], "sgd", {"lr": 0.1}, loss=spec.loss, kvstore="dist_device_sync",
                 threads=[1, 1]) as trainer:
        assert (trainer.world, trainer.total_devices) == (2, 4)
        for _ in range(steps):
            trainer.train_step(X, y)
        return [p.detach().clone() for p in trainer.module.parameters()]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_trainer_api_with_a_server_and_two_devices_per_process_equals_four_devices(monkeypatch):
    from dlperf.devices import cpu
    from dlperf.models import get_spec
    from dlperf.parallel import Trainer
    from dlperf.parallel.launchers import ProcessLauncher

    monkeypatch.setenv("DLPERF_NUM_SERVERS", "1")  # the spawned processes inherit it; restored after
    results = ProcessLauncher(3, join_timeout_s=200, roles={2: "server"}).launch(_trainer_with_a_server, 3)
    assert results[2] is None
    spec = get_spec("lenet")
    torch.manual_seed(0)
    net = spec.build()
    X, y = spec.input.make_batch(16, generator=torch.Generator().manual_seed(1))
    with Trainer(net, [cpu(0), cpu(1), cpu(2), cpu(3)], "sgd", {"lr": 0.1}, loss=spec.loss) as trainer:
        for _ in range(3):
            trainer.train_step(X, y)
        ref = [p.detach().clone() for p in trainer.module.parameters()]
    for rank in (0, 1):
        for a, b in zip(results[rank], ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
