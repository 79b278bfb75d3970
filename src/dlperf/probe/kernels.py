"""The probe's C kernels, compiled once per machine into the verified per-user cache and loaded with ctypes.

Latency is measured only in compiled code: an interpreter loop around each load would time the
interpreter. Without a C compiler the kernels are unavailable and ``kernels()`` says why; nothing
falls back to Python.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import threading

from .. import _buildcache
from .._buildcache import build_cache_base
from ..errors import DlperfError
from . import _csource

CC_FLAGS = ("-O3", "-fPIC", "-shared", "-pthread")
_SUBDIRS = ("dlperf", "probe-kernels")
_COMPILE_TIMEOUT_S = 300

_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None
_error: str | None = None


class KernelsUnavailable(DlperfError, RuntimeError):
    """The C kernels cannot be built or loaded here; the message says why and how to fix it."""


def find_compiler() -> str | None:
    """The C compiler to use: $CC if set, else gcc, else cc; None when none is on PATH."""
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name:
            path = shutil.which(name)
            if path:
                return path
    return None


def build_key(compiler: str) -> str:
    """Everything the library depends on; a change in any of it means a separate build."""
    env = {"source": _csource.SOURCE, "flags": list(CC_FLAGS), "compiler": _buildcache.compiler_identity(compiler),
           "machine": platform.machine(), "system": platform.system()}
    return hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    u64, i32, u32, dbl = ctypes.c_uint64, ctypes.c_int, ctypes.c_uint32, ctypes.c_double
    signatures = {
        "dlp_chase": ([u64, u64, i32, u64], dbl),
        "dlp_fadd_latency": ([u64, i32], dbl),
        "dlp_mutex": ([u64, i32], dbl),
        "dlp_handoff": ([u64, dbl], dbl),
        "dlp_spin_handoff": ([u64, dbl], dbl),
        "dlp_stream": ([u64, i32, i32, ctypes.POINTER(dbl)], i32),
        "dlp_pread": ([i32, u64, u32, u64, i32, u64], dbl),
        "dlp_tcp": ([i32, u64, u32, dbl], dbl),
    }
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name)  # AttributeError (a stale or foreign library) is reported by the caller
        fn.argtypes, fn.restype = args, res
    return lib


def _load(path: str) -> ctypes.CDLL:
    try:
        return _declare(ctypes.CDLL(path))
    except AttributeError as exc:
        raise ImportError(f"{path} lacks a probe kernel ({exc})") from exc


def _compile(compiler: str, workdir: str) -> tuple[str, ctypes.CDLL]:
    source = os.path.join(workdir, "probe_kernels.c")
    library = os.path.join(workdir, "probe_kernels.so")
    with open(source, "w") as f:
        f.write(_csource.SOURCE)
    try:
        out = subprocess.run([compiler, *CC_FLAGS, "-o", library, source], capture_output=True, text=True,
                             timeout=_COMPILE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise KernelsUnavailable(f"{compiler} took longer than {_COMPILE_TIMEOUT_S} s to compile the probe "
                                 f"kernels; run again when the machine is less busy") from exc
    if out.returncode != 0:
        first = (out.stderr.strip().splitlines() or ["no message"])[0]
        raise KernelsUnavailable(f"{compiler} could not compile the probe kernels ({first[:200]}); "
                                 f"check the compiler and its C library headers")
    return library, _load(library)


def kernels() -> ctypes.CDLL:
    """The loaded kernels library, compiling it on first use; raise KernelsUnavailable saying why not."""
    global _loaded, _error
    with _lock:
        if _loaded is not None:
            return _loaded
        if _error is not None:
            raise KernelsUnavailable(_error)
        compiler = find_compiler()
        if compiler is None:
            _error = ("no C compiler found ($CC, gcc or cc on PATH), so the compiled latency, bandwidth and "
                      "threading rows are unavailable; install gcc (apt-get install gcc) and run again")
            raise KernelsUnavailable(_error)
        try:
            _loaded = _buildcache.load_or_build(
                base=build_cache_base(), subdirs=[*_SUBDIRS, build_key(compiler)], filename="probe_kernels.so",
                what="the probe's C kernels", expected_time="a few seconds",
                build=functools.partial(_compile, compiler), load=_load)
        except KernelsUnavailable as exc:
            _error = str(exc)
            raise
        except Exception as exc:  # a broken toolchain or cache lands here; the rows say why
            _error = f"cannot build the probe's C kernels: {type(exc).__name__}: {exc}"
            raise KernelsUnavailable(_error) from exc
        return _loaded


def _reset_for_tests() -> None:
    global _loaded, _error
    with _lock:
        _loaded, _error = None, None
