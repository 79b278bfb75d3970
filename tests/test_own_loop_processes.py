"""The user's own loop, unchanged, as 2 real processes (dlperf launch, and plain torchrun): weights equal on every
rank, equal to PyTorch DDP's in the same processes and to the one-process loop on fresh random inputs (AdamW with
a cosine schedule and accumulation through no_backward_sync, a batch whose rows do not divide evenly, plan="auto"
deciding alike on every rank); the loss every rank reports is the global one; a plain loss.backward() is one
error. In one process: a rank's rows of a batch and the checks on them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from dlperf.cli import main
from dlperf.errors import UsageError
from dlperf.parallel.communication.process_group import ProcessAxis
from dlperf.parallel.training.own_loop_processes import RankRows

SRC = str(Path(__file__).resolve().parents[1] / "src")

SCRIPT = textwrap.dedent('''
    import copy
    import sys

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import dlperf

    out, seed = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    ACCUMULATE = 2


    def model_for(rank):
        torch.manual_seed(seed + rank)  # unlike on every rank: the loop starts all from the first rank's weights
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


    def global_batches(n, rows):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(n)]


    def adamw_loop(model, data, loop):
        """AdamW, a cosine schedule, accumulation over ACCUMULATE micro-batches: the user's loop, as written."""
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        model, opt = loop.setup(model, opt)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=len(data) // ACCUMULATE)
        losses = []
        for i, (x, y) in enumerate(loop.setup_data(data)):
            last = (i + 1) % ACCUMULATE == 0
            loss = nn.functional.cross_entropy(model(x), y) / ACCUMULATE
            with loop.no_backward_sync(enabled=not last):
                loop.backward(loss)
            losses.append(float(loop.all_mean(loss)))
            if last:
                opt.step()
                sched.step()
                opt.zero_grad()
        return losses


    loops = []
    result = {}

    # A: the loop under dlperf
    loop = dlperf.Loop()
    loops.append(loop)
    rank, world = loop.rank, loop.world
    model = model_for(rank)
    result["losses"] = adamw_loop(model, global_batches(8, 8), loop)
    result["loop"] = [p.detach().clone() for p in model.parameters()]

    # B: PyTorch DDP in the same processes, on the same rows, accumulating under no_sync
    ddp = DDP(model_for(0))
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.05, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8 // ACCUMULATE)
    for i, (x, y) in enumerate(global_batches(8, 8)):
        rows = slice(rank * 4, rank * 4 + 4)
        last = (i + 1) % ACCUMULATE == 0
        context = ddp.no_sync() if not last else torch.enable_grad()
        with context:
            (nn.functional.cross_entropy(ddp(x[rows]), y[rows]) / ACCUMULATE).backward()
        if last:
            opt.step()
            sched.step()
            opt.zero_grad()
    result["ddp"] = [p.detach().clone() for p in ddp.module.parameters()]

    # C: batches of 7 rows: 4 on rank 0, 3 on rank 1, each rank weighted by its share
    loop = dlperf.Loop(plan="1x1")
    loops.append(loop)
    model = model_for(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = loop.setup(model, opt)
    for x, y in loop.setup_data(global_batches(3, 7)):
        opt.zero_grad()
        loop.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
    result["uneven"] = [p.detach().clone() for p in model.parameters()]

    # D: plan="auto": every rank tunes on the same schedule and decides alike
    loop = dlperf.Loop(plan="auto", tuning=dlperf.LoopTuning(warmup=1, rounds=2, steps=1))
    loops.append(loop)
    model = model_for(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = loop.setup(model, opt)
    for x, y in loop.setup_data(global_batches(16, 8)):
        opt.zero_grad()
        loop.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
    result["auto"] = [p.detach().clone() for p in model.parameters()]
    result["auto_plan"] = loop.plan.name
    result["auto_tuned"] = not loop.tuning

    # E: loss.backward() instead of loop.backward(loss) does not train in silence
    try:
        x, y = next(iter(loop.setup_data(global_batches(1, 8))))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        result["error"] = None
    except dlperf.UsageError as exc:
        result["error"] = str(exc)

    result.update(rank=rank, world=world)
    torch.save(result, f"{out}.{rank}")
    for loop in reversed(loops):
        loop.close()
''')


def _plain(seed: int) -> dict[str, object]:
    """The one-process loops the processes must match (the same global batches, no dlperf)."""
    def model() -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def batches(n: int, rows: int):
        g = torch.Generator().manual_seed(seed)
        return [(torch.randn(rows, 6, generator=g), torch.randint(0, 3, (rows,), generator=g)) for _ in range(n)]

    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    losses = []
    for i, (x, y) in enumerate(batches(8, 8)):
        loss = nn.functional.cross_entropy(net(x), y) / 2
        loss.backward()
        losses.append(float(loss.detach()))
        if i % 2 == 1:
            opt.step()
            sched.step()
            opt.zero_grad()
    out: dict[str, object] = {"loop": list(net.parameters()), "losses": losses}
    for key, data, lr, momentum in (("uneven", batches(3, 7), 0.1, 0.9), ("auto", batches(16, 8), 0.1, 0.0)):
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
        for x, y in data:
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        out[key] = list(net.parameters())
    return out


def _close(got, want, atol: float = 1e-5) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-4, atol=atol)


def _check(out: Path, seed: int) -> None:
    plain = _plain(seed)
    ranks = [torch.load(f"{out}.{r}", weights_only=True) for r in (0, 1)]
    assert [(r["rank"], r["world"]) for r in ranks] == [(0, 2), (1, 2)]
    for key in ("loop", "uneven", "auto"):
        for a, b in zip(ranks[0][key], ranks[1][key], strict=True):
            assert torch.equal(a, b), key  # every rank applied the same averaged gradients
    first = ranks[0]
    _close(first["loop"], first["ddp"])
    _close(first["loop"], plain["loop"])
    _close(first["uneven"], plain["uneven"])
    _close(first["auto"], plain["auto"], atol=1e-4)
    assert first["losses"] == pytest.approx(plain["losses"], rel=1e-4, abs=1e-6)
    assert ranks[1]["losses"] == first["losses"]  # the global loss, the same on every rank
    assert first["auto_tuned"] and first["auto_plan"] == ranks[1]["auto_plan"]
    assert first["auto_plan"].endswith("processes") and first["auto_plan"].startswith("2x")
    for r in ranks:
        assert r["error"] is not None and "loop.backward(loss)" in r["error"] and "\n" not in r["error"]


def _seed() -> int:
    value = int.from_bytes(os.urandom(2), "little")
    print(f"seed {value}")
    return value


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_users_loop_under_dlperf_launch_matches_ddp_and_one_process(tmp_path):
    script = tmp_path / "own_loop_script.py"
    script.write_text(SCRIPT)
    seed = _seed()
    out = tmp_path / "result"
    assert main(["launch", "--nproc-per-node", "2", "--", str(script), str(out), str(seed)]) == 0
    _check(out, seed)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_users_loop_under_plain_torchrun(tmp_path):
    script = tmp_path / "own_loop_script.py"
    script.write_text(SCRIPT)
    seed = _seed()
    out = tmp_path / "result"
    env = {**os.environ, "PYTHONPATH": SRC}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(out), str(seed)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(out, seed)


class _TwoRanks:
    """An in-process stand-in for the sums of 2 processes: this rank's figures, and the other rank's copy of
    them (``other`` changes what it saw)."""

    def __init__(self, rank: int, other=lambda t: t) -> None:
        self.axis = ProcessAxis(rank, 2)
        self.share = 0.5
        self.other = other

    def sum_(self, flat: torch.Tensor) -> torch.Tensor:
        mine = flat.clone()
        theirs = self.other(mine.flip(0))  # the other rank filled the other slot
        flat.copy_(mine + theirs)
        return flat

    def weight(self) -> float:
        return self.share * 2


def test_each_rank_gets_its_rows_and_its_share():
    g = torch.Generator().manual_seed(_seed())
    batch = {"x": torch.randn(7, 3, generator=g), "t": torch.tensor(2.0), "lang": "en", "y": torch.arange(7)}
    for rank, rows in ((0, range(0, 4)), (1, range(4, 7))):
        sums = _TwoRanks(rank)
        (part,) = list(RankRows([batch], sums))
        assert torch.equal(part["x"], batch["x"][rows.start:rows.stop]) and part["y"].tolist() == list(rows)
        assert part["t"] is batch["t"] and part["lang"] == "en"
        assert sums.share == pytest.approx(len(rows) / 7) and sums.weight() == pytest.approx(2 * len(rows) / 7)
    assert len(RankRows([batch, batch], _TwoRanks(0))) == 2


def test_batches_the_ranks_cannot_share_are_one_line():
    with pytest.raises(UsageError, match="a batch of 1 example cannot be shared by 2 processes"):
        list(RankRows([(torch.zeros(1, 3), torch.zeros(1))], _TwoRanks(0)))
    unlike = _TwoRanks(1, other=lambda t: t * 2)  # the other rank read another batch
    with pytest.raises(UsageError, match="read different batches") as info:
        list(RankRows([(torch.ones(4, 3), torch.zeros(4))], unlike))
    assert "\n" not in str(info.value) and "torch.manual_seed" in str(info.value)
