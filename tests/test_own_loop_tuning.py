"""plan="auto"'s schedule on steps it does not drive: candidates in alternating rounds, a slow one leaves after its
first round, the fastest is kept only beyond noise, else the reference; the candidates a model gets."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from dlperf.devices import cpu
from dlperf.parallel.planning.plan import Plan
from dlperf.parallel.planning.planner import Measurement
from dlperf.parallel.training.own_loop_tuning import LoopTuning, OnlineTuner, loop_candidates

REFERENCE = Plan(threads=2, step_thread="caller")
FAST = Plan(threads=1, step_thread="caller")
SLOW = Plan(threads=2, memory_format="channels_last", step_thread="caller")


def run(step_s: dict[Plan, float], options: LoopTuning, declined=lambda plan: None, max_steps: int = 200):
    """Drive a tuner as a loop would: each step sleeps as long as the plan in force says."""
    current = [REFERENCE]
    switches: list[Plan] = []

    def switch(plan: Plan) -> None:
        current[0] = plan
        switches.append(plan)

    tuner = OnlineTuner(list(step_s), options, switch, declined)
    steps = 0
    while tuner.tuning and steps < max_steps:
        time.sleep(step_s[current[0]])
        tuner.step_ended()
        steps += 1
    return tuner, current[0], switches, steps


def test_the_fastest_candidate_wins_and_a_slow_one_leaves_after_one_round():
    options = LoopTuning(warmup=1, rounds=3, steps=2, settle=1, min_window_s=0)
    tuner, final, switches, steps = run({REFERENCE: 0.02, FAST: 0.01, SLOW: 0.04}, options)
    assert tuner.plan == FAST and final == FAST
    slow = next(m for m in tuner.found if m.plan == SLOW)
    assert slow.note.startswith("dropped after round 1") and list(slow.by_round) == [0]
    fast = next(m for m in tuner.found if m.plan == FAST)
    assert sorted(fast.by_round) == [0, 1, 2] and tuner.found[0].ms == pytest.approx(20, rel=0.5)
    # warm-up, then per round each live candidate settles one step and times two
    assert steps == 1 + 3 * 3 + 2 * 3 * 2
    assert "*" in tuner.table().splitlines()[2]


def test_nothing_faster_beyond_noise_keeps_the_loop_as_written():
    options = LoopTuning(warmup=0, rounds=3, steps=3, settle=1, min_window_s=0)
    # as fast, give or take a sleep's jitter on a busy machine (a shade slower, so jitter cannot make it 3% faster)
    tuner, final, _, _ = run({REFERENCE: 0.015, FAST: 0.0155}, options)
    assert tuner.plan == REFERENCE and final == REFERENCE


def test_a_capture_is_kept_only_where_it_beats_its_eager_twin():
    captured = Plan(threads=1, step_thread="caller", execution="captured")
    options = LoopTuning(warmup=0, rounds=3, steps=2, settle=1, min_window_s=0)
    tuner, final, _, _ = run({REFERENCE: 0.03, FAST: 0.01, captured: 0.01}, options)  # no faster than FAST
    assert final == FAST
    tuner, final, _, _ = run({REFERENCE: 0.03, FAST: 0.02, captured: 0.01}, options)
    assert final == captured
    # both far ahead of the reference, the capture a hair ahead of its twin: the twin stays, and the plan says why
    twin, cap = Measurement(FAST), Measurement(captured)
    for i, (a, b) in enumerate([(10.0, 9.8), (10.0, 9.9), (10.0, 9.7)]):
        twin.record(i, a, False)
        cap.record(i, b, False)
    reasons: list[str] = []
    assert OnlineTuner._plainer_twin(cap, [Measurement(REFERENCE), twin, cap], 3, reasons) is twin
    assert "eager kept" in reasons[0]


def test_a_declined_candidate_is_dropped_and_never_chosen():
    options = LoopTuning(warmup=0, rounds=2, steps=1, settle=1, min_window_s=0)
    tuner, final, _, _ = run({REFERENCE: 0.02, FAST: 0.005}, options,
                             declined=lambda plan: "its forward runs eagerly" if plan == FAST else None)
    assert final == REFERENCE
    assert next(m for m in tuner.found if m.plan == FAST).note == "dropped: its forward runs eagerly"


def test_the_budget_ends_the_rounds_early():
    options = LoopTuning(warmup=0, rounds=50, steps=1, settle=1, budget_s=0.05, min_window_s=0)
    tuner, _, _, steps = run({REFERENCE: 0.02, FAST: 0.01}, options)
    assert not tuner.tuning and steps < 20 and any(n.startswith("budget:") for n in tuner.notes)


def test_across_processes_every_rank_decides_on_the_summed_figures():
    shared = []

    def share(t: torch.Tensor) -> torch.Tensor:  # this rank's figures plus another rank's, which found FAST slow
        shared.append(t.clone())
        other = t.clone()
        if len(t) > 2:  # a round's figures, not the window's length
            other[1] = other[0] * 3
        return t + other

    current = [REFERENCE]
    tuner = OnlineTuner([REFERENCE, FAST], LoopTuning(warmup=2, rounds=2, steps=1, min_window_s=0.05),
                        lambda p: current.__setitem__(0, p),
                        lambda p: None, share=share)
    while tuner.tuning:
        time.sleep(0.02 if current[0] == REFERENCE else 0.005)
        tuner.step_ended()
    proposed, ranks = shared[0].tolist()  # the window agreed on: 0.05 s of 20 ms steps, every rank alike
    assert ranks == 1.0 and 2 <= proposed <= 3 and tuner.window_steps == proposed
    shared.pop(0)
    assert tuner.plan == REFERENCE and len(shared) == 1  # FAST left after round 1 on the ranks' mean
    fast = tuner.found[1]
    assert fast.by_round[0] == pytest.approx((shared[0][1] + 3 * shared[0][0]).item() / 2)
    assert shared[0].shape == (6,)  # per candidate its figure and contention; the budget's verdict; a rank


def test_in_one_process_a_timing_lasts_long_enough_to_mean_something():
    options = LoopTuning(warmup=0, rounds=1, steps=2, settle=1, min_window_s=0.1)
    tuner, _, _, steps = run({REFERENCE: 0.02, FAST: 0.01}, options)
    # about 0.1 s of steps each: 5 of the reference's, 10 of the other's (sleep only ever oversleeps)
    assert 2 <= steps - 2 - 10 <= 10


def test_candidates_follow_the_model():
    conv = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten())
    plans, notes = loop_candidates(conv, REFERENCE, [cpu(0)], 4, LoopTuning())
    assert plans[0] == REFERENCE
    assert {(p.threads, p.memory_format) for p in plans} == {(t, f) for t in (1, 2, 4)
                                                             for f in ("contiguous", "channels_last")}
    assert all(p.execution == "eager" for p in plans) and any("captured" in n for n in notes)
    linear = nn.Linear(3, 3)
    plans, _ = loop_candidates(linear, REFERENCE, [cpu(0)], 2, LoopTuning())
    assert {(p.threads, p.execution) for p in plans} == {(1, "eager"), (2, "eager"), (1, "captured"),
                                                         (2, "captured")}
    processes = Plan(replicas=2, threads=1, launcher="processes")
    plans, notes = loop_candidates(linear, processes, [cpu(0)], 2, LoopTuning())
    assert all(p.execution == "eager" and p.launcher == "processes" for p in plans)
    assert any("across processes" in n for n in notes)
    plans, notes = loop_candidates(linear, REFERENCE, [cpu(0)], 2, LoopTuning(executions=["eager", "compile"]))
    assert all(p.execution == "eager" for p in plans) and any("compile" in n for n in notes)
