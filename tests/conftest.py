"""Shared fixtures: markers that skip with a reason, and guards that fail a test which leaks."""

from __future__ import annotations

import os
import sys
import textwrap
import threading
import time

# OpenMP's threads spin while they wait for work. The tests run threads of their own (engine workers, launched
# processes) on a few cores shared with other work, where a spinning thread holds the core its partner needs
# and each parallel region then waits for a preempted thread: 3-4x slower under load. Waiting passively
# changes no result. It must be set before torch (and with it OpenMP) loads; launched interpreters inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

from dlperf._buildcache import BUILD_CACHE_ENV, cache_base  # noqa: E402
from dlperf._threads import fresh_thread_default  # noqa: E402

# Compiled libraries (the native plan interpreter: a minute of compiling) stay in the user's cache even where a
# test moves XDG_CACHE_HOME to keep its figures and plans private, as they would for two runs of the user's own.
os.environ.setdefault(BUILD_CACHE_ENV, cache_base())

# Variables that pytest or torch itself set on first use (torch's inductor cache dir is set lazily
# by some ops and by torch.compile); a test that sets them has not leaked anything of its own.
_IGNORED_ENV = ("PYTEST_", "TORCHINDUCTOR_", "_TORCHINDUCTOR_")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to PyTorch")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _torch_compile_pool_threads() -> set[threading.Thread]:
    """Threads of torch.compile's own process-wide compile pool: torch starts them on the first compile that
    misses its kernel cache and keeps them for the process, so whichever test compiles first would look
    as if it leaked them."""
    import sys

    module = sys.modules.get("torch._inductor.async_compile")
    pool_fn = getattr(getattr(module, "AsyncCompile", None), "pool", None)
    info = getattr(pool_fn, "cache_info", None)
    if pool_fn is None or info is None or info().currsize == 0:
        return set()
    pool = pool_fn()  # cached: returns the pool torch made, never a new one
    return {t for t in threading.enumerate()
            if t.name.startswith("ThreadPoolExecutor") and getattr(t, "_args", None)
            and callable(t._args[0]) and t._args[0]() is pool}


@pytest.fixture(autouse=True)
def no_leaked_threads_or_env():
    """Fail a test that leaves threads running, changes the environment or torch's thread count."""
    before_threads = set(threading.enumerate())
    before_env = dict(os.environ)
    before_torch_threads = torch.get_num_threads()
    yield
    deadline = time.monotonic() + 5.0
    leaked = []
    while time.monotonic() < deadline:
        leaked = [t for t in threading.enumerate() if t not in before_threads and t.is_alive()]
        if leaked:
            leaked = [t for t in leaked if t not in _torch_compile_pool_threads()]
        if not leaked:
            break
        time.sleep(0.05)
    torch_threads = torch.get_num_threads()
    new_thread_default = fresh_thread_default()
    torch.set_num_threads(before_torch_threads)
    changed = {k for k in set(before_env) | set(os.environ)
               if before_env.get(k) != os.environ.get(k) and not k.startswith(_IGNORED_ENV)}
    for k in changed:
        if k in before_env:
            os.environ[k] = before_env[k]
        else:
            os.environ.pop(k, None)
    assert not leaked, f"test leaked threads: {[t.name for t in leaked]}"
    assert not changed, f"test changed environment variables: {sorted(changed)}"
    assert torch_threads == before_torch_threads, (
        f"test changed torch's intra-op threads from {before_torch_threads} to {torch_threads}")
    assert new_thread_default == before_torch_threads, (
        f"test changed the intra-op threads that new threads start with, from {before_torch_threads} "
        f"to {new_thread_default}")


@pytest.fixture(autouse=True, scope="session")
def notes_shown_as_the_cli_shows_them():
    """dlperf's notes (logging records) printed as ``dlperf`` prints them (warnings on stderr; a verb's decisions on
    stdout while it runs), in every test alike: otherwise whether a test sees a note would depend on whether an
    earlier test in the same process ran the CLI, which installs that handler once."""
    from dlperf.cli import show_notes

    show_notes(verb=False)


@pytest.fixture(autouse=True)
def private_plan_cache(no_leaked_threads_or_env, tmp_path_factory, monkeypatch):
    """Each test plans against its own empty plan cache: a decision cached by one test (or by the user's own
    runs) must not answer another's question."""
    monkeypatch.setenv("DLPERF_PLAN_CACHE", str(tmp_path_factory.mktemp("plans") / "plans.json"))


@pytest.fixture
def plans_in_one_process(monkeypatch):
    """The planner without its plans of several processes, which it measures by starting them: a test of what a
    plan auto decides and prints among the plans of one process, beside its twin marked distributed."""
    from dlperf.parallel.planning import planner

    monkeypatch.setattr(planner, "process_plans", lambda *args, **kwargs: [])


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """A module ``plan_factories`` in the test's working directory, for ``MODULE:FACTORY`` arguments: a small
    model (16 features, 3 classes), its data as (train, test) batches of 32, and a factory that returns no
    batches."""
    (tmp_path / "plan_factories.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def make_model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))

        def make_data():
            g = torch.Generator().manual_seed(0)
            X = torch.randn(192, 16, generator=g)
            y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()
            train = [(X[i:i + 32], y[i:i + 32]) for i in range(0, 192, 32)]
            return train, train[:2]

        def not_batches():
            return [1, 2, 3]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield
    sys.modules.pop("plan_factories", None)


# Collecting doctests imports every module under tests/; this one registers a strategy when imported, which its
# own tests do for themselves and forget after (tests/test_strategy_by_name.py).
collect_ignore = ["support/sum_on_first.py"]
