"""The process-wide state a launch changes (descriptor 2, the environment, torch's loggers) comes back whole,
also when launches overlap and end in another order than they started (the planner's process candidates)."""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest

from dlperf.parallel.launchers.parent import ParentState, _raise_signal


def _stderr_target() -> tuple[int, int]:
    st = os.fstat(2)
    return st.st_dev, st.st_ino


def test_overlapping_launches_ending_out_of_order_give_everything_back(tmp_path):
    before_fd2, before_env = _stderr_target(), dict(os.environ)
    before_handlers = list(logging.getLogger("torch.distributed").handlers)
    first = ParentState(tmp_path / "first.log")
    second = ParentState(tmp_path / "second.log")
    first.__enter__()
    os.environ["DLPERF_TEST_AGENT_VAR"] = "set by the first launch's agent"
    second.__enter__()
    assert second.log_path == first.log_path  # torch's lines of both go to one file
    first.__exit__(None, None, None)  # the first ends first: nothing may be undone under the second
    assert _stderr_target() != before_fd2
    os.write(2, b"")  # descriptor 2 still writes while the second runs (a closed pipe would raise)
    second.__exit__(None, None, None)
    assert _stderr_target() == before_fd2
    assert dict(os.environ) == before_env
    assert logging.getLogger("torch.distributed").handlers == before_handlers
    assert not (tmp_path / "first.log").exists() and not (tmp_path / "second.log").exists()


def test_a_kept_log_outlives_the_launches(tmp_path):
    state = ParentState(tmp_path / "agent.log")
    with state:
        logging.getLogger("torch.distributed").warning("a line torch logged")
        state.keep = state.logged()
    assert state.keep and "a line torch logged" in (tmp_path / "agent.log").read_text()


def _handlers() -> dict:
    return {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}


def test_a_failed_stderr_filter_gives_the_signal_handlers_back_and_never_hides_an_error(tmp_path, monkeypatch,
                                                                                       capsys):
    from dlperf.parallel.launchers import parent

    def broken(self, read_end):
        raise OSError("the log's disk is full")

    monkeypatch.setattr(parent._StderrFilter, "_filter", broken)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # (its death is reported as it happens)
    saved = _handlers()
    for sig in saved:
        signal.signal(sig, signal.SIG_DFL)
    before = _handlers()
    try:
        with pytest.raises(OSError, match="disk is full"), ParentState(tmp_path / "agent.log"):
            assert _handlers() != before
        assert _handlers() == before
        with pytest.raises(ValueError, match="the launch failed"), ParentState(tmp_path / "agent.log"):
            raise ValueError("the launch failed")  # what leaves the block wins over the filter's error
        assert _handlers() == before
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert "the launch's stderr filter failed too (OSError: the log's disk is full)" in capsys.readouterr().err



def _all_handlers() -> dict:
    return {s: signal.getsignal(s) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
            if (s := getattr(signal, name, None)) is not None}


def _agent_handler(signum, frame):  # what torch's process context installs in the main thread and leaves there
    raise AssertionError("never called")


@pytest.fixture
def own_handlers():
    """The handlers from before the test, put back after it; during it, handlers of its own in their place."""
    saved = _all_handlers()

    def original(signum, frame):
        raise AssertionError("never called")

    for sig in saved:
        signal.signal(sig, original)
    try:
        yield _all_handlers()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.fixture
def launches(tmp_path, own_handlers):
    """``begin(name, agent=False)`` and ``end(name)`` a ParentState on the main thread (``agent``: then replace
    every handler as torch's agent does); any that a failed test left running ends after it, before the handlers
    of the test go."""
    running: dict[str, ParentState] = {}

    def begin(name: str, agent: bool = False) -> None:
        running[name] = ParentState(tmp_path / f"{name}.log").__enter__()
        if agent:
            for sig in _all_handlers():
                signal.signal(sig, _agent_handler)

    def end(name: str) -> None:
        running.pop(name).__exit__(None, None, None)

    try:
        yield begin, end
    finally:
        for name in reversed(list(running)):
            end(name)


@pytest.mark.parametrize("order", ["first ends first", "second ends first"])
def test_overlapping_launches_on_the_main_thread_put_the_original_signal_handlers_back(launches, own_handlers,
                                                                                        order):
    begin, end = launches
    begin("first", agent=True)
    begin("second", agent=True)
    if order == "first ends first":
        end("first")
        # the second still runs: its handlers (its agent's) stay until it ends
        assert set(_all_handlers().values()) == {_agent_handler}
        end("second")
    else:
        end("second")
        # the first still runs: what it had when the second began is back (its agent's handlers)
        assert set(_all_handlers().values()) == {_agent_handler}
        end("first")
    assert _all_handlers() == own_handlers


def test_three_overlapping_launches_ending_in_any_order_put_the_original_signal_handlers_back(launches,
                                                                                             own_handlers):
    begin, end = launches
    for name in ("a", "b", "c"):
        begin(name)
    end("b")  # the middle one, then the first, then the last
    end("a")
    now = _all_handlers()  # the last still runs: its handlers stay
    assert now[signal.SIGTERM] is _raise_signal and now[signal.SIGHUP] is _raise_signal
    end("c")
    assert _all_handlers() == own_handlers
