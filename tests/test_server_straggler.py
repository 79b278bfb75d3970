"""The straggler of a parameter-server run, named by the run itself.

Two gloo workers train a small model through two parameter servers (four processes on 127.0.0.1). In
one run a worker's forward sleeps: its peer's pushes and pulls wait on it at the servers, and it is
named as sums across processes name theirs. In the other, one server sleeps in every request it
answers: every worker waits alike, so the servers' own time handling requests names it.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from dlperf.devices import cpu
from dlperf.parallel import Trainer
from dlperf.parallel.communication.process_group import ExchangeRow, last_exchange_report
from dlperf.parallel.communication.servers import ServerExchangeReport, ServerRow, serve_kvstore
from dlperf.parallel.launchers import ProcessLauncher, rank_info

pytestmark = pytest.mark.distributed
STEPS = 8
SLEEP_S = 0.05
# longer than a loaded machine's own handling of a request (up to ~30 ms seen with 4 processes on 2 busy cores)
SERVER_SLEEP_S = 0.2
ROLES = {2: "server", 3: "server"}


class Sleepy(nn.Module):
    def __init__(self, pause: float) -> None:
        super().__init__()
        self.pause = pause
        # four keys: placed by their hash, they spread over both servers
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pause:
            time.sleep(self.pause)
        return self.body(x)


def _run(slow_worker: int | None, slow_server: int | None, trace: str | None) -> dict | None:
    rank = rank_info().rank
    if rank in ROLES:
        if rank == slow_server:
            from dlperf.kvstore import server

            answer = server.Server.on_pushpull

            def slowly(self, *args):  # a server on a busy host: every request it answers takes longer
                time.sleep(SERVER_SLEEP_S)
                return answer(self, *args)

            server.Server.on_pushpull = slowly
        serve_kvstore("dist_sync", "sgd", {"lr": 0.1})
        return None
    torch.manual_seed(0)
    net = Sleepy(SLEEP_S if rank == slow_worker else 0.0)
    g = torch.Generator().manual_seed(1)
    with Trainer(net, [cpu(0)], "sgd", {"lr": 0.1}, kvstore="dist_sync",
                 trace=trace if rank == 0 else None) as trainer:
        for _ in range(STEPS + 1):
            trainer.train_step(torch.randn(12, 8, generator=g), torch.randint(0, 2, (12,), generator=g))
        weights = [p.detach().clone() for p in trainer.module.parameters()]
    report = last_exchange_report()
    return {"weights": weights, "report": (report.describe(), report.as_dict()) if report and rank == 0 else None}


def _launch(monkeypatch, *args) -> list:
    monkeypatch.setenv("DLPERF_NUM_SERVERS", "2")  # the spawned processes inherit it; restored after
    return ProcessLauncher(4, backend="gloo", join_timeout_s=150, roles=ROLES).launch(_run, *args)


@pytest.mark.timeout(300)
def test_a_slow_worker_is_named_by_its_peers_wait_at_the_servers(monkeypatch, tmp_path):
    trace = tmp_path / "run.json"
    results = _launch(monkeypatch, 1, None, str(trace))
    line, figures = results[0]["report"]
    assert line.startswith("straggler: rank 1 on "), line
    assert figures["straggler"]["rank"] == 1 and figures["straggler"]["cause"] == "waited on"
    waits = {r["rank"]: r["wait_s"] for r in figures["ranks"]}
    assert set(waits) == {0, 1} and waits[1] == 0.0 and waits[0] > 0.5 * SLEEP_S * STEPS, figures
    assert all(r["exchanges"] >= STEPS for r in figures["ranks"])
    assert sorted(s["rank"] for s in figures["servers"]) == [2, 3]
    assert all(s["requests"] >= 2 * STEPS for s in figures["servers"]), figures
    assert torch.equal(results[0]["weights"][0], results[1]["weights"][0])
    # the trace of the run carries the same report
    doc = json.loads(trace.read_text())
    assert doc["metadata"]["straggler"] == line and doc["metadata"]["exchanges"]["servers"] == figures["servers"]


@pytest.mark.timeout(300)
def test_a_slow_server_is_named_by_its_own_time_answering(monkeypatch):
    results = _launch(monkeypatch, None, 3, None)
    line, figures = results[0]["report"]
    assert line.startswith("straggler: server rank 3 on "), (line, figures)
    assert figures["straggler"]["rank"] == 3 and figures["straggler"]["cause"] == "slow server"
    busy = {s["rank"]: s["busy_s"] for s in figures["servers"]}
    assert busy[3] > SERVER_SLEEP_S * STEPS and busy[3] > 2 * busy[2], figures


def test_no_server_is_named_when_they_take_about_the_same():
    workers = (ExchangeRow(0, "a", 0.5, 10), ExchangeRow(1, "b", 0.45, 10))
    even = ServerExchangeReport(workers, (ServerRow(2, "c", 0.10, 20), ServerRow(3, "d", 0.12, 20)))
    assert even.slow_server() is None and even.straggler() is None
    assert even.describe().startswith("straggler: none (every rank spent 0.45-0.50 s in 10 pushes and pulls")
    assert even.as_dict()["straggler"] is None and len(even.as_dict()["servers"]) == 2
    # one server cannot be compared with another; below a millisecond a request the difference is noise
    assert ServerExchangeReport(workers, (ServerRow(2, "c", 9.0, 20),)).slow_server() is None
    assert ServerExchangeReport(workers, (ServerRow(2, "c", 9.0, 20), ServerRow(3, "d", 0.0, 0))).slow_server() is None
    assert ServerExchangeReport(workers, (ServerRow(2, "c", 0.001, 20), ServerRow(3, "d", 0.01, 20))
                                ).slow_server() is None
