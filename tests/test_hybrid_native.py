"""The native backend: a C++ plan (or its Python fallback) checked against eager on random inputs."""

from __future__ import annotations

import copy
import ctypes
import hashlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from _toolchain import built_or_skip, cxx_toolchain
from dlperf import _buildcache as native_cache
from dlperf.hybrid import HybridizeWarning, hybridize
from dlperf.hybrid.backends import BackendUnsupported, native
from dlperf.hybrid.capture import capture


def _compiled_or_skip():
    return built_or_skip(native.load_extension, cxx_toolchain())


def _net(model: nn.Module):
    return hybridize(model, backend="native")


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64])  # kernel path up to 8 rows, BLAS above
@pytest.mark.parametrize("act", [nn.ReLU, nn.Sigmoid, nn.Tanh])
def test_plan_matches_eager_on_fresh_inputs(rows, act):
    _compiled_or_skip()
    torch.manual_seed(rows)
    model = nn.Sequential(nn.Linear(37, 19), act(), nn.Linear(19, 5, bias=False), act(), nn.Linear(5, 3))
    net = _net(model)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(rows, 37)
            torch.testing.assert_close(net(x), model(x), rtol=1e-5, atol=1e-6)
    (choice,) = net.choices.values()
    assert choice.backend == "native" and "C++ plan" in choice.reason


def test_plan_handles_flatten_add_and_unfused_activation():
    _compiled_or_skip()

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.flat = nn.Flatten()
            self.a = nn.Linear(12, 6)
            self.b = nn.Linear(12, 6)

        def forward(self, x):
            h = self.flat(x)
            u = self.a(h)
            return torch.relu(u) + u * self.b(h)  # u has two users: relu is not fused

    model = Branchy()
    net = _net(model)
    with torch.no_grad():
        for rows in (1, 2, 20):
            x = torch.randn(rows, 3, 4)
            torch.testing.assert_close(net(x), model(x), rtol=1e-5, atol=1e-6)


def test_outputs_kept_by_the_caller_are_never_overwritten():
    _compiled_or_skip()
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 4), nn.Flatten())
    net = _net(model)
    with torch.no_grad():
        xs = [torch.randn(1, 8) for _ in range(4)]
        outs = [net(x) for x in xs]
        for x, out in zip(xs, outs):
            torch.testing.assert_close(out, model(x))


def test_parameter_updates_are_visible_to_the_plan():
    _compiled_or_skip()
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    net = _net(model)
    x = torch.randn(1, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with torch.no_grad():
        net(x)
    model(x).sum().backward()
    opt.step()
    with torch.no_grad():
        torch.testing.assert_close(net(x), model(x))


def test_grad_mode_runs_the_plans_backward_as_one_autograd_node():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3))
    ref = copy.deepcopy(model)
    net = hybridize(model, backend="native")
    xs = [torch.randn(2, 8), torch.randn(2, 8)]
    outs = [net(x) for x in xs]  # two forwards, then two backwards: the first one recomputes its forward
    assert all("PlanFunction" in type(o.grad_fn).__name__ for o in outs), outs[0].grad_fn
    for out, x, w in zip(reversed(outs), reversed(xs), (1.0, 2.0)):
        (out * w).sum().backward()
        (ref(x) * w).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    (choice,) = net.choices.values()
    assert choice.backend == "native" and "backward" in choice.reason, choice.reason
    with pytest.warns(HybridizeWarning, match="no gradient for the input"):
        net(torch.randn(2, 8, requires_grad=True))


class _FrozenFirstLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 6), nn.Linear(6, 3)

    def forward(self, x):
        with torch.no_grad():
            h = self.a(x)
        return self.b(torch.relu(h))


def test_a_forward_that_changes_the_autograd_mode_is_refused_naming_the_line():
    """The graph records no ``no_grad``: the plan's backward would differentiate the frozen layer."""
    torch.manual_seed(1)
    model = _FrozenFirstLayer()
    captured = capture(model, (torch.randn(2, 8),))
    (line,) = captured.grad_mode_changes()
    assert line.startswith(f"{__file__}:") and line.endswith("h = self.a(x)"), line
    with pytest.raises(BackendUnsupported, match="changes the autograd mode"):
        native.refuse_grad_mode_changes(captured)
    ref = copy.deepcopy(model)
    with pytest.warns(HybridizeWarning, match="changes the autograd mode"):
        out = hybridize(model, backend="native")(torch.ones(2, 8))
    out.sum().backward()
    ref(torch.ones(2, 8)).sum().backward()
    assert model.a.weight.grad is None and ref.a.weight.grad is None
    torch.testing.assert_close(model.b.weight.grad, ref.b.weight.grad)


def test_unsupported_graph_is_refused_and_auto_moves_on():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten())
    with pytest.raises(BackendUnsupported, match="conv2d"):
        native.build_code(capture(model, (torch.randn(1, 1, 5, 5),)).graph_module)
    net = hybridize(model, candidates=["native", "graph"])
    with torch.no_grad():
        x = torch.randn(1, 1, 5, 5)
        torch.testing.assert_close(net(x), model(x))
    (choice,) = net.choices.values()
    assert choice.backend == "graph" and "native: conv2d is not supported" in choice.reason


def test_python_fallback_without_a_compiler(monkeypatch):
    def no_compiler():
        raise RuntimeError("cannot build the native plan interpreter: no g++")

    monkeypatch.setattr(native, "load_extension", no_compiler)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    net = _net(model)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(3, 8)
            torch.testing.assert_close(net(x), model(x))
    (choice,) = net.choices.values()
    assert "Python graph replay" in choice.reason and "no g++" in choice.reason


# --- the compiled-library cache: tested on a tiny C library that compiles in a fraction of a second ---
_TINY_C = "int answer(void) { return 42; }\n"
_EVIL_C = """#include <stdio.h>
__attribute__((constructor)) static void plant(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("constructor ran", f); fclose(f); }
}
int answer(void) { return 666; }
"""


def _gcc_or_skip() -> str:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler on PATH")
    return gcc


def _compile_c(source: str, directory: Path, name: str = "lib.so") -> Path:
    c_file, library = directory / f"{name}.c", directory / name
    c_file.write_text(source)
    subprocess.run([_gcc_or_skip(), "-shared", "-fPIC", "-o", str(library), str(c_file)], check=True, timeout=60)
    return library


class TinyLibrary:
    """build/load callbacks for native_cache.load_or_build that count how often each runs."""

    def __init__(self):
        self.builds = 0
        self.loads: list[str] = []

    def build(self, workdir: str):
        self.builds += 1
        library = _compile_c(_TINY_C, Path(workdir))
        return str(library), ctypes.CDLL(str(library))

    def load(self, path: str):
        self.loads.append(path)
        return ctypes.CDLL(path)

    def get(self, base: Path, wait_s: float = 30.0):
        return native_cache.load_or_build(base=str(base), subdirs=["dlperf", "tiny"], filename="tiny.so",
                                          what="the tiny test library", expected_time="under a second",
                                          build=self.build, load=self.load, wait_s=wait_s)


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    home = tmp_path / "cache"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    monkeypatch.setenv(native_cache.BUILD_CACHE_ENV, str(home))  # the compiled libraries' cache moves with it
    monkeypatch.setattr(native_cache, "_warned", set())
    return home


def test_compiled_libraries_are_cached_where_their_own_variable_says_else_with_the_users_caches(tmp_path,
                                                                                              monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(native_cache.BUILD_CACHE_ENV)
    assert native.cache_dir() == str(tmp_path / "xdg" / "dlperf" / "native")
    monkeypatch.setenv(native_cache.BUILD_CACHE_ENV, str(tmp_path / "builds"))
    assert native.cache_dir() == str(tmp_path / "builds" / "dlperf" / "native")
    assert native_cache.cache_base() == str(tmp_path / "xdg")  # figures and plans stay where XDG_CACHE_HOME says


@pytest.mark.timeout(60)
def test_cache_builds_once_then_loads_a_verified_private_copy(cache_home, capfd):
    tiny = TinyLibrary()
    assert tiny.get(cache_home).answer() == 42
    err = capfd.readouterr().err
    assert "compiling the tiny test library once" in err and "compiled the tiny test library in" in err
    directory = cache_home / "dlperf" / "tiny"
    for level in (cache_home / "dlperf", directory):
        assert stat.S_IMODE(level.stat().st_mode) == 0o700 and level.stat().st_uid == os.geteuid()
    manifest = json.loads((directory / native_cache.MANIFEST).read_text())
    assert manifest["sha256"] == hashlib.sha256((directory / "tiny.so").read_bytes()).hexdigest()

    assert tiny.get(cache_home).answer() == 42
    assert tiny.builds == 1 and len(tiny.loads) == 1
    # What was loaded is a copy in a scratch directory, gone once the library is mapped.
    assert not tiny.loads[0].startswith(str(directory / "tiny.so")) and not os.path.exists(tiny.loads[0])
    assert "compiling" not in capfd.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("manifest", ["kept", "missing"])
def test_planted_constructor_library_never_runs_in_process(cache_home, tmp_path, capfd, manifest):
    tiny = TinyLibrary()
    tiny.get(cache_home)
    directory = cache_home / "dlperf" / "tiny"
    canary = tmp_path / "canary"
    evil = _compile_c(_EVIL_C % canary, tmp_path, "evil.so")
    shutil.copyfile(evil, directory / "tiny.so")
    if manifest == "missing":
        (directory / native_cache.MANIFEST).unlink()
    with pytest.warns(native_cache.NativeCacheWarning) as caught:
        assert tiny.get(cache_home).answer() == 42
    assert not canary.exists()
    assert tiny.builds == 2
    reason = "does not match the one recorded in" if manifest == "kept" else "no manifest.json records its hash"
    (warning,) = caught
    assert f"not loading {directory / 'tiny.so'}: " in str(warning.message)
    assert f"{reason}" in str(warning.message) and str(warning.message).endswith("; rebuilding it")
    assert tiny.get(cache_home).answer() == 42 and tiny.builds == 2  # the rebuild was published
    assert sorted(p.name for p in directory.iterdir()) == [native_cache.LOCK, native_cache.MANIFEST, "tiny.so"]


@pytest.mark.timeout(60)
def test_scratch_left_by_a_killed_process_is_removed_on_the_next_build(cache_home):
    directory = Path(native_cache.private_dir(str(cache_home), ["dlperf", "tiny"]))
    old, recent = directory / ".build-old", directory / ".load-recent"
    for scratch in (old, recent):
        scratch.mkdir()
        (scratch / "tiny.so").write_bytes(b"partial")
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(old, (day_ago, day_ago))
    TinyLibrary().get(cache_home)
    assert not old.exists() and recent.exists()  # a recent one may belong to a live process


@pytest.mark.subprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("manifest", ["missing", "forged"])
def test_planted_constructor_library_never_runs_in_a_fresh_process(cache_home, tmp_path, manifest):
    directory = Path(native.cache_dir()) / native.build_key()
    directory.mkdir(parents=True, mode=0o700)
    canary = tmp_path / "canary"
    evil = _compile_c(_EVIL_C % canary, tmp_path, "evil.so")
    library = directory / f"dlperf_plan_{native.build_key()}.so"
    shutil.copyfile(evil, library)
    if manifest == "forged":
        (directory / native_cache.MANIFEST).write_text(json.dumps(
            {"format": 1, "file": library.name, "size": library.stat().st_size, "sha256": "0" * 64}))
    # The child cannot compile (that would take minutes here): it must refuse the planted library
    # and fall back to the Python replay, which still gives the right answer.
    script = textwrap.dedent("""
        import sys, torch
        from torch import nn
        from dlperf.hybrid import hybridize
        from dlperf.hybrid.backends import native

        def no_compiler(name, workdir):
            raise RuntimeError("compiler disabled in this test")

        native._compile = no_compiler
        print(native.build_key())
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))
        net = hybridize(model, backend="native")
        with torch.no_grad():
            x = torch.randn(3, 6)
            torch.testing.assert_close(net(x), model(x))
        (choice,) = net.choices.values()
        print(choice.reason)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(native.__file__).parents[3])] + sys.path)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr
    key, reason = proc.stdout.splitlines()[:2]
    assert key == native.build_key()  # the child looked at the very file that was planted
    assert not canary.exists()
    assert "Python graph replay" in reason and "compiler disabled in this test" in reason
    assert f"NativeCacheWarning: dlperf: not loading {library}" in proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flaw", ["group-writable", "foreign-owned", "symlink"])
def test_cache_directory_others_could_write_is_refused(cache_home, tmp_path, capfd, monkeypatch, flaw):
    target = cache_home / "dlperf"
    if flaw == "symlink":
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir(mode=0o700)
        target.symlink_to(elsewhere)
    else:
        target.mkdir(mode=0o700)
    if flaw == "group-writable":
        target.chmod(0o770)
    if flaw == "foreign-owned":
        if os.geteuid() == 0:
            os.chown(target, 54321, -1)
        else:  # without the right to give a directory away, make every existing one look foreign
            real = os.geteuid()
            monkeypatch.setattr(os, "geteuid", lambda: real + 1)
    with pytest.raises(native_cache.CacheUnsafe, match="expected a directory owned by uid"):
        native_cache.private_dir(str(cache_home), ["dlperf", "tiny"])
    tiny = TinyLibrary()
    with pytest.warns(native_cache.NativeCacheWarning) as caught:
        assert tiny.get(cache_home).answer() == 42
        tiny.get(cache_home)
    (warning,) = caught  # one warning per process, however often the cache is refused
    message = str(warning.message)
    assert message.startswith(f"dlperf: not using the cache for the tiny test library: {target} is ")
    assert "expected a directory owned by uid" in message and "building in a private temporary directory" in message
    assert not (target / "tiny").exists() and not (tmp_path / "elsewhere" / "tiny").exists()
    assert tiny.builds == 2 and tiny.loads == []
    assert "not cached" in capfd.readouterr().err


@pytest.mark.subprocess
@pytest.mark.timeout(60)
def test_lock_of_a_killed_builder_does_not_block(cache_home, tmp_path):
    directory = native_cache.private_dir(str(cache_home), ["dlperf", "tiny"])
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            sys.path[:0] = {sys.path!r}
            from dlperf import _buildcache as native_cache
            with native_cache.build_lock({directory!r}, 5, "x"):
                print("locked", flush=True)
                time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
    finally:
        holder.kill()  # SIGKILL mid-"compile": no chance to clean up
        holder.wait(timeout=30)
        holder.stdout.close()
    lock = Path(directory) / native_cache.LOCK
    assert str(holder.pid) in lock.read_text()  # the dead holder's record is still there
    (Path(directory) / "lock").write_text("")  # and torch's FileBaton file from an old-style build
    child = textwrap.dedent(f"""
        import sys
        sys.path[:0] = {sys.path!r}
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from test_hybrid_native import TinyLibrary
        print(TinyLibrary().get(Path({str(cache_home)!r}), wait_s=5).answer())
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=45)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "42"


@pytest.mark.timeout(60)
def test_live_builder_is_waited_for_with_a_bound(cache_home, capfd):
    directory = native_cache.private_dir(str(cache_home), ["dlperf", "tiny"])
    with native_cache.build_lock(directory, 1, "x"):
        start = time.monotonic()
        with pytest.raises(native_cache.BuildWaitTimeout, match=f"process {os.getpid()} .* longer than 0 s"):
            TinyLibrary().get(cache_home, wait_s=0.5)
        assert time.monotonic() - start < 10
    assert f"waiting up to 0 s for process {os.getpid()}" in capfd.readouterr().err
    assert TinyLibrary().get(cache_home, wait_s=0.5).answer() == 42  # released: the next one builds


@pytest.mark.timeout(60)
def test_native_backend_falls_back_while_another_process_compiles(cache_home, monkeypatch):
    monkeypatch.setattr(native, "_extension", None)
    monkeypatch.setattr(native, "_extension_error", None)
    monkeypatch.setattr(native, "BUILD_WAIT_S", 0.5)
    directory = native_cache.private_dir(native.cache_base(), ["dlperf", "native", native.build_key()])
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    with native_cache.build_lock(directory, 1, "x"):
        net = _net(model)
        with torch.no_grad():
            x = torch.randn(3, 8)
            torch.testing.assert_close(net(x), model(x))
    (choice,) = net.choices.values()
    assert "Python graph replay" in choice.reason and "longer than 0 s" in choice.reason


def test_build_key_covers_the_environment(monkeypatch):
    from torch.utils import cpp_extension

    base = native.build_key()
    assert native.build_key() == base
    with monkeypatch.context() as m:
        m.setattr(sys, "prefix", "/elsewhere/venv")
        assert native.build_key() != base
    with monkeypatch.context() as m:
        m.setattr(sys, "executable", "/elsewhere/venv/bin/python")
        assert native.build_key() != base
    with monkeypatch.context() as m:
        m.setattr(cpp_extension, "include_paths", lambda *a, **k: ["/other/torch/include"])
        assert native.build_key() != base
    with monkeypatch.context() as m:
        m.setattr(native, "_compiler_identity", lambda compiler: "clang version 99")
        assert native.build_key() != base
    environment = native.build_environment()
    assert native.build_key(environment) == base
    assert native.build_key({**environment, "flags": "-O0"}) != base


@pytest.mark.timeout(60)
def test_compiling_is_announced_before_it_starts(cache_home, monkeypatch, capfd):
    monkeypatch.setattr(native, "_extension", None)
    monkeypatch.setattr(native, "_extension_error", None)
    seen_before_compile = []

    def fake_compile(name, workdir):
        seen_before_compile.append(capfd.readouterr().err)
        raise RuntimeError("stopped before compiling")

    monkeypatch.setattr(native, "_compile", fake_compile)
    with pytest.raises(RuntimeError, match="stopped before compiling"):
        native.load_extension()
    (err,) = seen_before_compile
    assert "dlperf: compiling the native plan interpreter once for this machine and environment " \
           "(about a minute; cached in" in err
    assert err.count("\n") == 1


# --- files of the cache opened safely -----------------------------------------------------------------
def _replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path, 0o600)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", [native_cache.MANIFEST, "tiny.so"])
def test_a_fifo_in_place_of_a_cached_file_is_rebuilt_not_waited_on_and_left_alone(cache_home, name):
    tiny = TinyLibrary()
    tiny.get(cache_home)
    directory = cache_home / "dlperf" / "tiny"
    _replace_with_fifo(directory / name)
    start = time.monotonic()
    with pytest.warns(native_cache.NativeCacheWarning) as caught:
        assert tiny.get(cache_home).answer() == 42
    assert time.monotonic() - start < 30 and tiny.builds == 2
    messages = " ".join(str(w.message) for w in caught)
    assert "expected a regular file owned by uid" in messages
    # the fresh build is used but not kept: what stands at the path is not a file dlperf wrote
    assert "could not keep it in the cache" in messages and "it is a FIFO" in messages
    assert stat.S_ISFIFO((directory / name).lstat().st_mode)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", [native_cache.MANIFEST, "tiny.so"])
def test_a_cached_file_others_could_write_is_not_loaded(cache_home, name):
    tiny = TinyLibrary()
    tiny.get(cache_home)
    directory = cache_home / "dlperf" / "tiny"
    os.chmod(directory / name, 0o666)
    with pytest.warns(native_cache.NativeCacheWarning, match="mode 0666; expected a regular file"):
        assert tiny.get(cache_home).answer() == 42
    assert tiny.builds == 2 and tiny.loads == []
    assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600


@pytest.mark.timeout(60)
def test_published_files_are_private_whatever_the_umask(cache_home):
    old = os.umask(0o002)
    try:
        tiny = TinyLibrary()
        tiny.get(cache_home)
    finally:
        os.umask(old)
    directory = cache_home / "dlperf" / "tiny"
    for name in ("tiny.so", native_cache.MANIFEST):
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600
    assert tiny.get(cache_home).answer() == 42 and tiny.builds == 1 and len(tiny.loads) == 1


@pytest.mark.timeout(60)
def test_a_fifo_as_the_lock_file_is_refused_not_waited_on(cache_home):
    directory = Path(native_cache.private_dir(str(cache_home), ["dlperf", "tiny"]))
    os.mkfifo(directory / native_cache.LOCK, 0o600)
    with pytest.raises(native_cache.CacheUnsafe, match="not a regular file"):
        with native_cache.build_lock(str(directory), 1, "x"):
            pass


def test_the_build_wait_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(native_cache.WAIT_ENV, raising=False)
    assert native_cache.build_wait_s() == native_cache.DEFAULT_WAIT_S
    monkeypatch.setenv(native_cache.WAIT_ENV, "2.5")
    assert native_cache.build_wait_s() == 2.5
    for bad in ("soon", "-1", "nan", "inf", "1e300"):
        monkeypatch.setenv(native_cache.WAIT_ENV, bad)
        with pytest.raises(native_cache.UsageError, match=f"DLPERF_BUILD_WAIT_S='{bad}' is not a number of seconds"):
            native_cache.build_wait_s()


@pytest.mark.timeout(60)
def test_the_wait_names_the_holder_from_its_record_and_the_option(cache_home, capfd, monkeypatch):
    monkeypatch.setenv(native_cache.WAIT_ENV, "0.3")
    directory = native_cache.private_dir(str(cache_home), ["dlperf", "tiny"])
    with native_cache.build_lock(directory, 1, "x"):
        with pytest.raises(native_cache.BuildWaitTimeout) as info:
            TinyLibrary().get(cache_home, wait_s=None)
    host = socket.gethostname()[:64]
    assert f"process {os.getpid()} on {host} has been compiling" in str(info.value)
    assert "DLPERF_BUILD_WAIT_S" in str(info.value)
    err = capfd.readouterr().err
    assert f"waiting up to 0 s for process {os.getpid()} on {host}" in err and "$DLPERF_BUILD_WAIT_S" in err


@pytest.mark.timeout(60)
def test_a_link_in_place_of_a_cached_file_is_neither_followed_nor_replaced(cache_home, tmp_path):
    tiny = TinyLibrary()
    tiny.get(cache_home)
    directory = cache_home / "dlperf" / "tiny"
    victim = tmp_path / "victim"
    victim.write_text("mine")
    (directory / native_cache.MANIFEST).unlink()
    os.symlink(victim, directory / native_cache.MANIFEST)
    with pytest.warns(native_cache.NativeCacheWarning, match="it is a symbolic link"):
        assert tiny.get(cache_home).answer() == 42
    assert victim.read_text() == "mine" and os.readlink(directory / native_cache.MANIFEST) == str(victim)


@pytest.mark.timeout(60)
def test_a_full_cache_disk_keeps_the_fresh_build_and_leaves_no_temporary(cache_home, monkeypatch):
    import dlperf._io

    def full(*_args):
        raise OSError(28, "No space left on device")

    tiny = TinyLibrary()
    monkeypatch.setattr(dlperf._io.os, "fsync", full)
    with pytest.warns(native_cache.NativeCacheWarning,
                      match="could not keep it in the cache: cannot write .*tiny.so: no space left on the device "
                            "for [0-9]+ bytes"):
        assert tiny.get(cache_home).answer() == 42  # built and loaded, only not kept
    monkeypatch.undo()
    directory = cache_home / "dlperf" / "tiny"
    assert sorted(p.name for p in directory.iterdir()) == [native_cache.LOCK]
