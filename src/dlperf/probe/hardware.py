"""Measure this machine's rows of d2l Tables 12.4.1 and 12.4.2.

Latency, bandwidth, locking and socket figures come from the compiled kernels in ``kernels``;
matrix products and dispatch costs from torch; GPU rows only where a CUDA device is visible.
Every loop is bounded by a count, so a slow or contended machine gives slow figures, not a hang.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import tempfile
import time
import timeit
from collections.abc import Callable
from dataclasses import dataclass

from .._cliargs import available_memory_bytes, one_line
from .._threads import intra_op_threads
from ..errors import DlperfError
from ..timing import best_of
from .reference import GBPS, GFLOPS, NS, SEED, mm_seed
from .result import ProbeResult, ProbeRow, cores, machine

log = logging.getLogger(__name__)

_KIB = 1024
_MIB = 1024 * 1024
_HANDOFF_MAX_S = 1.0  # per call: on a busy machine each hand-off or echo can wait a whole time slice
_DEFAULT_CACHES = {"L1": 32 * _KIB, "L2": 1 * _MIB, "L3": 8 * _MIB}


@dataclass(frozen=True)
class ProbeEffort:
    """How much to measure: the full run, ``--quick`` (under a minute on two cores), or tiny (tests)."""

    reps: int
    chase_loads: int
    dram_sizes: tuple[int, ...]
    stream_reps: int
    stream_min_elems: int
    lock_iters: int
    handoff_rounds: int
    tcp_messages: int
    tcp_round_trips: int
    disk_file: int
    disk_random_reads: int
    mm_n: int
    mm_min_s: float
    all_thread_counts: bool
    py_calls: int
    tiny: bool = False


FULL = ProbeEffort(reps=5, chase_loads=4_000_000, dram_sizes=(64 * _MIB, 256 * _MIB), stream_reps=10,
            stream_min_elems=2_000_000, lock_iters=5_000_000, handoff_rounds=20_000, tcp_messages=50_000,
            tcp_round_trips=20_000, disk_file=256 * _MIB, disk_random_reads=50_000, mm_n=1024, mm_min_s=0.5,
            all_thread_counts=True, py_calls=1_000_000)
QUICK = ProbeEffort(reps=3, chase_loads=1_000_000, dram_sizes=(64 * _MIB,), stream_reps=3, stream_min_elems=2_000_000,
             lock_iters=1_000_000, handoff_rounds=3_000, tcp_messages=10_000, tcp_round_trips=2_000,
             disk_file=64 * _MIB, disk_random_reads=10_000, mm_n=512, mm_min_s=0.15, all_thread_counts=False,
             py_calls=200_000)
TINY = ProbeEffort(reps=1, chase_loads=100_000, dram_sizes=(64 * _MIB,), stream_reps=1, stream_min_elems=1_000_000,
            lock_iters=100_000, handoff_rounds=200, tcp_messages=500, tcp_round_trips=100, disk_file=4 * _MIB,
            disk_random_reads=500, mm_n=128, mm_min_s=0.01, all_thread_counts=False, py_calls=10_000, tiny=True)


# --- the machine -----------------------------------------------------------------------------------
def _parse_size(text: str) -> int | None:
    text = text.strip().upper()
    scale = {"K": _KIB, "M": _MIB, "G": 1024 * _MIB}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in "KMG" else text
    return int(digits) * scale if digits.isdigit() else None


def cache_sizes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> tuple[dict[str, int], str]:
    """Data/unified cache sizes by level ({"L1": bytes, ...}) and where they came from."""
    sizes: dict[str, int] = {}
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        entries = []
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            with open(os.path.join(root, entry, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(root, entry, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(root, entry, "size")) as f:
                size = _parse_size(f.read())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and size and level.isdigit():
            sizes[f"L{level}"] = size
    if "L1" in sizes and "L2" in sizes:
        return sizes, "sysfs"
    return dict(_DEFAULT_CACHES), "defaults: sysfs unreadable"


def _fmt_bytes(n: int) -> str:
    return f"{n // _MIB} MB" if n >= _MIB else f"{n // _KIB} KB"


# --- compiled rows -----------------------------------------------------------------------------------
def _row(key: str, what: str, value: float | None, note: str = "", seed_key: str | None = None,
         seed: float | None = None) -> ProbeRow:
    figure = SEED[seed_key or key]
    return ProbeRow(key, what, value, figure.unit, figure.value if seed is None else seed, figure.source, note)


def _checked(value: float, what: str) -> tuple[float | None, str]:
    """A kernel returns a negative code when it could not run; the row then says so instead of lying."""
    if not math.isfinite(value) or value < 0:
        return None, f"{what} failed (code {value:g})"
    return value, ""


def _latency_rows(lib, plan: ProbeEffort) -> list[ProbeRow]:
    caches, origin = cache_sizes()
    rows = []
    value, note = _checked(lib.dlp_fadd_latency(plan.chase_loads * 4, plan.reps), "the add chain")
    rows.append(_row("fadd", "Floating-point add (dependent chain)", value, note or "compiled C, -O3"))
    sets = [("l1", "L1", caches["L1"] // 2), ("l2", "L2", max(caches["L2"] // 2, caches["L1"] * 4))]
    if "L3" in caches:
        sets.append(("l3", "L3", max(caches["L3"] // 2, caches["L2"] * 2)))
    last = max(caches.values())
    for size in plan.dram_sizes:
        key = "dram64" if size == 64 * _MIB else "dram256"
        sets.append((key, "memory", max(size, 4 * last)))
    for key, level, size in sets:
        value, note = _checked(lib.dlp_chase(size, plan.chase_loads, plan.reps, 1), "the pointer chase")
        cache_note = f"{level} is {_fmt_bytes(caches[level])} ({origin})" if level in caches else \
            f"beyond the {_fmt_bytes(last)} last-level cache"
        if level == "memory" and size != (64 * _MIB if key == "dram64" else 256 * _MIB):
            cache_note += f"; the book's {key[4:]} MB row, enlarged to 4x the last-level cache"
        rows.append(_row(key, f"{level} reference: random chase over {_fmt_bytes(size)}", value,
                         note or f"per dependent load; {cache_note}"))
    return rows


def _best(fn: Callable[[], float], reps: int) -> float:
    values = [fn() for _ in range(max(reps, 1))]
    return -1.0 if any(v < 0 for v in values) else min(values)


def _thread_rows(lib, plan: ProbeEffort) -> list[ProbeRow]:
    value, note = _checked(lib.dlp_mutex(plan.lock_iters, plan.reps), "the mutex loop")
    rows = [_row("mutex", "Mutex lock/unlock (uncontended)", value, note or "pthread_mutex, one thread")]
    handoff = _best(lambda: lib.dlp_handoff(plan.handoff_rounds, _HANDOFF_MAX_S), plan.reps)
    value, note = _checked(handoff, "the ping-pong")
    rows.append(_row("handoff", "Thread hand-off (condition variable)", value,
                     note or "one way, two threads ping-pong; includes sleeping and waking"))
    if cores() > 1:
        spin = _best(lambda: lib.dlp_spin_handoff(plan.handoff_rounds * 10, _HANDOFF_MAX_S), plan.reps)
        value, note = _checked(spin, "the spinning ping-pong (another program may hold the other core)")
        rows.append(_row("spin_handoff", "Cache-line hand-off between cores (spinning)", value,
                         note or "one way: a modified line moves to the other core", seed_key="handoff"))
    return rows


def _stream_rows(lib, plan: ProbeEffort) -> list[ProbeRow]:
    caches, _ = cache_sizes()
    last = max(caches.values())
    n = plan.stream_min_elems if plan.tiny else max(plan.stream_min_elems, 4 * last // 8)
    available = available_memory_bytes()
    if available is not None and 3 * 8 * n > available // 2:  # never push the machine into swapping
        n = max(available // 2 // 24, plan.stream_min_elems // 8)
    rule = f"3 arrays of {_fmt_bytes(n * 8)}, each >= 4x the {_fmt_bytes(last)} LLC; best of {plan.stream_reps}"
    if n * 8 < 4 * last:
        rule = (f"arrays of {_fmt_bytes(n * 8)}: smaller than STREAM's 4x LLC rule "
                f"({'test size' if plan.tiny else 'limited by available memory'})")
    names = ("copy", "scale", "add", "triad")
    bytes_per_elem = (16, 16, 24, 24)  # STREAM's convention: reads plus writes, no write-allocate traffic
    rows = []
    for threads in sorted({cores(), 1}, reverse=True):
        best = (ctypes.c_double * 4)()
        rc = lib.dlp_stream(n, plan.stream_reps, threads, best)
        for i, name in enumerate(names):
            if threads == 1 and name != "triad":
                continue
            value = n * bytes_per_elem[i] / best[i] if rc == 0 and best[i] > 0 else None
            note = rule if rc == 0 else f"the STREAM kernel failed (code {rc})"
            rows.append(_row(f"stream_{name}_{threads}t", f"Memory bandwidth, STREAM {name}, {threads} thread"
                             f"{'s' if threads > 1 else ''}", value, note, seed_key="stream"))
    return rows


def _tcp_rows(lib, plan: ProbeEffort) -> list[ProbeRow]:
    send = _best(lambda: lib.dlp_tcp(0, plan.tcp_messages, 4096, _HANDOFF_MAX_S), plan.reps)
    value, note = _checked(send, "the loopback stream")
    rate = f"; {4096 / value:.2f} GB/s" if value else ""
    rows = [_row("tcp_send_4k", "Send 4KB over TCP (loopback 127.0.0.1)", value,
                 note or f"streamed, until received{rate}")]
    rtt = _best(lambda: lib.dlp_tcp(1, plan.tcp_round_trips, 64, _HANDOFF_MAX_S), plan.reps)
    value, note = _checked(rtt, "the loopback echo")
    rows.append(_row("tcp_rtt", "Round trip over TCP (loopback 127.0.0.1)", value,
                     note or "64 B request and echo, TCP_NODELAY; no network involved"))
    return rows


def _write_temp_file(nbytes: int) -> str:
    fd, path = tempfile.mkstemp(prefix="dlperf-probe-", suffix=".bin")
    try:
        chunk = os.urandom(_MIB)
        for _ in range(nbytes // _MIB):
            os.write(fd, chunk)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


def _disk_rows(lib, plan: ProbeEffort) -> list[ProbeRow]:
    size = plan.disk_file
    try:
        path = _write_temp_file(size)
    except OSError as exc:  # a full or read-only temporary directory costs these rows, not the others
        reason = f"cannot write a {_fmt_bytes(size)} file in {tempfile.gettempdir()} ({exc.strerror or exc})"
        return [_row(key, what, None, reason, seed_key=key) for key, what in (
            ("disk_seq_1m", "Read 1MB sequentially"), ("disk_rand_4k", "Read 4KB randomly"))]
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.pread(fd, size, 0)  # make sure every page is cached: these rows are the page cache
            seq = lib.dlp_pread(fd, size, _MIB, max(2 * size // _MIB, 8), 0, 0)
            rnd = lib.dlp_pread(fd, size, 4096, plan.disk_random_reads, 1, 7)
        finally:
            os.close(fd)
        rows = [_row("disk_seq_1m", "Read 1MB sequentially (page cache)", *_checked(seq, "pread")),
                _row("disk_rand_4k", "Read 4KB randomly (page cache)", *_checked(rnd, "pread"))]
        for row in rows:
            row.note = row.note or f"{_fmt_bytes(size)} temp file, cached in memory: no device read"
        rows.extend(_direct_rows(lib, path, size, plan))
    finally:
        os.unlink(path)
    return rows


def _direct_rows(lib, path: str, size: int, plan: ProbeEffort) -> list[ProbeRow]:
    what = ("Read 1MB sequentially (O_DIRECT)", "Read 4KB randomly (O_DIRECT)")
    direct = getattr(os, "O_DIRECT", None)
    try:
        if direct is None:
            raise OSError("this platform has no O_DIRECT")
        fd = os.open(path, os.O_RDONLY | direct)
    except OSError as exc:
        reason = f"O_DIRECT unavailable on {tempfile.gettempdir()} ({exc.strerror or exc}); only the page cache"
        return [_row("disk_seq_1m_direct", what[0], None, reason, seed_key="disk_seq_1m"),
                _row("disk_rand_4k_direct", what[1], None, reason, seed_key="disk_rand_4k")]
    try:
        seq = lib.dlp_pread(fd, size, _MIB, min(size // _MIB, 64), 0, 0)
        rnd = lib.dlp_pread(fd, size, 4096, max(plan.disk_random_reads // 20, 50), 1, 11)
    finally:
        os.close(fd)
    note = f"bypasses the page cache: the device behind {tempfile.gettempdir()}"
    rows = []
    for key, label, value in (("disk_seq_1m", what[0], seq), ("disk_rand_4k", what[1], rnd)):
        got, problem = _checked(value, "O_DIRECT pread")
        rows.append(_row(f"{key}_direct", label, got, problem or note, seed_key=key))
    return rows


# --- torch rows --------------------------------------------------------------------------------------
def _time_mm(torch, n: int, dtype, min_s: float, reps: int) -> float:
    """Peak GFLOP/s: the fastest of many short blocks of products, so a moment of contention costs one block."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    product = functools.partial(torch.mm, a, b)
    per_call = max(best_of(product, reps=1, warmup=0, calls=2), 1e-6)
    block = max(1, int(0.01 / per_call))  # blocks of about 10 ms
    best = best_of(product, reps=3, warmup=0, calls=block, min_seconds=min_s * max(reps, 1))
    return 2.0 * n ** 3 / best / 1e9


def _mm_rows(plan: ProbeEffort) -> list[ProbeRow]:
    import torch

    total = cores()
    counts = list(range(1, total + 1)) if plan.all_thread_counts else sorted({1, total})
    rows = []
    for dtype_name in ("float32", "bfloat16", "float64"):
        for threads in counts:
            with intra_op_threads(threads):
                cpu_before, wall_before = time.process_time(), time.perf_counter()
                value = _time_mm(torch, plan.mm_n, getattr(torch, dtype_name), plan.mm_min_s, plan.reps)
                busy = (time.process_time() - cpu_before) / max(time.perf_counter() - wall_before, 1e-9)
                note = f"{plan.mm_n}x{plan.mm_n}, fastest ~10 ms block"
                if threads > 1 and busy < 0.8 * threads:  # other programs held some of the cores
                    note += f"; contended: this process kept only {busy:.1f} of {threads} cores busy"
                rows.append(_row(f"mm_{dtype_name}_{threads}t", f"torch.mm {dtype_name}, {threads} thread"
                                 f"{'s' if threads > 1 else ''}", value, note, seed_key="mm",
                                 seed=mm_seed(dtype_name, threads)))
    return rows


def _per_call_ns(stmt: str, number: int, reps: int, env: dict) -> float:
    timer = timeit.Timer(stmt, globals=env)
    return min(timer.repeat(repeat=max(reps, 1), number=number)) / number * 1e9


def _dispatch_rows(plan: ProbeEffort) -> list[ProbeRow]:
    import torch

    def nothing():
        return None

    env: dict[str, object] = {"f": nothing}
    call = _per_call_ns("f()", plan.py_calls, plan.reps, env)
    empty = _per_call_ns("pass", plan.py_calls, plan.reps, env)
    rows = [_row("py_call", "Python function call", max(call - empty, 0.0),
                 f"empty function, timeit loop overhead ({empty:.1f} ns) taken off")]
    tensor = torch.ones(1)
    env = {"a": tensor, "torch": torch}
    add = _per_call_ns("torch.add(a, a)", max(plan.py_calls // 20, 100), plan.reps, env)
    rows.append(_row("torch_dispatch", "torch op dispatch (1-element add)", add,
                     "eager CPU op: Python binding, dispatcher, allocation"))
    return rows


# --- the whole probe ---------------------------------------------------------------------------------
def _compiled_sections() -> list[tuple[str, Callable]]:
    return [("cache latency", _latency_rows), ("memory bandwidth", _stream_rows), ("locks and threads", _thread_rows),
            ("loopback TCP", _tcp_rows), ("disk reads", _disk_rows)]


UNAVAILABLE_KEYS = ("fadd", "l1", "l2", "l3", "dram64", "mutex", "handoff", "stream", "tcp_send_4k", "tcp_rtt",
                    "disk_seq_1m", "disk_rand_4k")


def _unavailable_rows(reason: str) -> list[ProbeRow]:
    return [_row(key, SEED[key].source.split(":")[0], None, reason) for key in UNAVAILABLE_KEYS]


def _sections(plan: ProbeEffort) -> list[tuple[str, Callable[[], list[ProbeRow]]]]:
    from .gpu import gpu_rows
    from .kernels import KernelsUnavailable, kernels

    try:
        lib = kernels()
    except KernelsUnavailable as exc:
        reason = str(exc)
        sections = [("compiled kernels", lambda: _unavailable_rows(reason))]
    else:
        sections = [(name, functools.partial(fn, lib, plan)) for name, fn in _compiled_sections()]
    sections.append(("matrix products", lambda: _mm_rows(plan)))
    sections.append(("call and dispatch costs", lambda: _dispatch_rows(plan)))
    sections.append(("CUDA GPUs, if any", lambda: gpu_rows(plan)))
    return sections


def measure(plan: ProbeEffort = QUICK, progress: Callable[[str], None] | None = None) -> ProbeResult:
    """Measure every row under ``plan``; rows a machine cannot measure carry None and the reason.

    Ctrl-C stops after the rows measured so far: they are returned with ``interrupted`` set.
    """
    tell = progress or (lambda _msg: None)
    load_before = os.getloadavg()[0]
    result = ProbeResult(machine=machine(), quick=plan is not FULL, created=time.time())
    try:
        for name, section in _sections(plan):
            tell(name)
            result.rows.extend(section())
    except KeyboardInterrupt:
        result.interrupted = True
    result.machine["loadavg"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return result


def run_probe(quick: bool = False, *, progress: Callable[[str], None] | None = None, save: bool = True,
              _plan: ProbeEffort | None = None) -> ProbeResult:
    """Measure this machine (``quick``: fewer repetitions, smaller sweeps) and save the figures to its cache."""
    plan = _plan or (QUICK if quick else FULL)
    result = measure(plan, progress)
    if save and not result.interrupted:
        from .cache import save_probe

        try:
            save_probe(result)
        except (DlperfError, OSError, RuntimeError) as exc:  # the figures still reach the caller
            log.warning("dlperf probe: warning: %s; the figures were not saved", one_line(str(exc)))
    return result


__all__ = ["ProbeRow", "ProbeResult", "ProbeEffort", "FULL", "QUICK", "TINY", "run_probe", "measure", "machine",
           "cache_sizes", "GBPS", "GFLOPS", "NS"]
