"""The straggler of a multi-process training run, named by the run itself.

Three gloo processes on 127.0.0.1 train a small model with the ``processes`` strategy; in one run the
model of one rank sleeps in every forward. Each rank adds up its time in sums across processes, and
as the trainer closes the first rank gathers them: the slept-in rank is the one its peers waited on.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn

from dlperf.devices import cpu
from dlperf.engine.trace import load_trace
from dlperf.parallel import Trainer
from dlperf.parallel.communication.process_group import ExchangeReport, ExchangeRow, last_exchange_report
from dlperf.parallel.launchers import ProcessLauncher, rank_info
from dlperf.parallel.training.timeline import EXCHANGES_PROCESS

pytestmark = pytest.mark.distributed
STEPS = 8
SLEEP_S = 0.05


class Sleepy(nn.Module):
    """A linear model whose forward sleeps ``pause`` seconds first: a slow rank, in the test's hands."""

    def __init__(self, pause: float) -> None:
        super().__init__()
        self.pause = pause
        self.body = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pause:
            time.sleep(self.pause)
        return self.body(x)


def _train(slow_rank: int | None, trace: str | None = None) -> dict | None:
    rank = rank_info().rank
    torch.manual_seed(0)
    net = Sleepy(SLEEP_S if rank == slow_rank else 0.0)
    g = torch.Generator().manual_seed(1)
    # one timeline per run, as dlperf train writes it: the first process's
    with Trainer(net, [cpu(0)], "sgd", {"lr": 0.1}, trace=trace if rank == 0 else None) as trainer:
        for _ in range(STEPS + 1):
            trainer.train_step(torch.randn(12, 8, generator=g), torch.randint(0, 2, (12,), generator=g))
        weights = [p.detach().clone() for p in trainer.module.parameters()]
    report = last_exchange_report()
    return {"rank": rank, "weights": weights,
            "report": None if report is None or rank != 0 else (report.describe(), report.as_dict())}


@pytest.mark.timeout(240)
def test_a_rank_slowed_in_its_step_is_named_the_straggler_with_its_peers_wait(tmp_path):
    launcher = ProcessLauncher(3, backend="gloo", join_timeout_s=120)
    trace = tmp_path / "run.json"
    slowed = launcher.launch(_train, 1, str(trace))
    line, figures = slowed[0]["report"]
    assert line.startswith("straggler: rank 1 on "), line
    assert figures["straggler"]["rank"] == 1
    waits = {r["rank"]: r["wait_s"] for r in figures["ranks"]}
    # the others waited on it about the sleep, every step; it waited on no one
    assert waits[1] == 0.0
    assert all(waits[r] > 0.5 * SLEEP_S * STEPS for r in (0, 2)), figures
    assert all(r["exchanges"] >= STEPS for r in figures["ranks"])
    # the slowed rank trains to the same weights as its peers
    assert all(torch.equal(a, b) for r in slowed[1:] for a, b in zip(r["weights"], slowed[0]["weights"], strict=True))
    assert [r["report"] for r in slowed[1:]] == [None, None]  # only the first rank holds the report
    # the trace file carries the same report: as the document's metadata and as events on a track of its own
    doc = json.loads(trace.read_text())
    assert doc["metadata"]["exchanges"] == json.loads(json.dumps(figures))
    assert doc["metadata"]["straggler"] == line
    marks = [e for e in doc["traceEvents"] if e.get("cat") == "exchanges"]
    assert [e["name"] for e in marks if e["s"] == "g"] == [line]
    assert sorted(e["args"]["rank"] for e in marks if e["s"] == "t") == [0, 1, 2]
    assert {e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"} >= {EXCHANGES_PROCESS}
    # and it is still a timeline of the run: the report's events are not operations
    ops = load_trace(trace).events
    assert ops and all(e.worker != EXCHANGES_PROCESS and not e.name.startswith("straggler") for e in ops)


def test_no_straggler_when_the_ranks_spend_about_the_same_in_the_sums():
    even = ExchangeReport((ExchangeRow(0, "a", 0.50, 10), ExchangeRow(1, "a", 0.42, 10), ExchangeRow(2, "b", 0.47, 10)))
    assert even.straggler() is None
    assert even.describe().startswith("straggler: none (every rank spent 0.42-0.50 s in 10 sums")
    one = ExchangeReport((ExchangeRow(0, "a", 0.9, 10), ExchangeRow(1, "b (10.0.0.2)", 0.05, 10)))
    assert one.straggler() == one.rows[1]
    assert "rank 1 on b (10.0.0.2) (its peers waited 0.85-0.85 s" in one.describe()
    # a difference below a millisecond a sum is noise, however large the ratio
    tiny = ExchangeReport((ExchangeRow(0, "a", 0.004, 10), ExchangeRow(1, "a", 0.0001, 10)))
    assert tiny.straggler() is None


def test_the_interface_that_reaches_the_master_is_given_to_gloo_and_to_tensorpipe(monkeypatch):
    from dlperf.parallel.launchers import processes

    monkeypatch.setattr(processes, "local_address", lambda master: "10.9.0.2" if master == "10.9.0.1" else None)
    monkeypatch.setattr(processes, "interface_with_address", lambda a: {"10.9.0.2": "veth-h1"}.get(a))
    env = {"MASTER_ADDR": "10.9.0.1"}
    processes.choose_socket_interface(env)
    assert env == {"MASTER_ADDR": "10.9.0.1", "GLOO_SOCKET_IFNAME": "veth-h1", "TP_SOCKET_IFNAME": "veth-h1"}
    # what the user chose stays
    mine = {"MASTER_ADDR": "10.9.0.1", "TP_SOCKET_IFNAME": "eth7"}
    processes.choose_socket_interface(mine)
    assert mine["TP_SOCKET_IFNAME"] == "eth7" and mine["GLOO_SOCKET_IFNAME"] == "veth-h1"
    chosen = {"MASTER_ADDR": "10.9.0.1", "GLOO_SOCKET_IFNAME": "eth3"}
    processes.choose_socket_interface(chosen)
    assert "TP_SOCKET_IFNAME" not in chosen
    nowhere = {"MASTER_ADDR": "192.0.2.1"}
    processes.choose_socket_interface(nowhere)
    assert nowhere == {"MASTER_ADDR": "192.0.2.1"}


def test_a_host_whose_writes_to_the_store_are_slow_is_named_on_a_slow_link():
    def rows(*link_ms: float) -> ExchangeReport:
        return ExchangeReport(tuple(ExchangeRow(r, f"h{r}", 1.5, 20, ms / 1e3) for r, ms in enumerate(link_ms)))

    slow = rows(0.9, 1.8, 21.7)
    assert slow.straggler() is None and slow.slow_link() == "h2"
    assert slow.describe().startswith("straggler: h2, on a slow link (every rank spent 1.50-1.50 s in 20 sums")
    assert slow.as_dict()["straggler"] == {"rank": None, "host": "h2", "cause": "slow link"}
    assert rows(0.9, 1.8, 2.1).slow_link() is None
    # the first host's writes cross no link; with one other host no side of the link can be blamed
    assert rows(30.0, 1.8, 2.0).slow_link() is None
    assert rows(0.9, 21.7).slow_link() is None
