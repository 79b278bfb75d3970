"""Table 12.4.2 on this machine's CUDA GPUs: kernel launch, host<->device copies, device and peer copies.

Every function here returns nothing on a machine without a visible CUDA device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..timing import best_of
from .cost import Link
from .reference import SEED
from .result import ProbeRow

_MIB = 1024 * 1024


def _row(key: str, what: str, value: float | None, note: str, seed_key: str):
    figure = SEED[seed_key]
    return ProbeRow(key, what, value, figure.unit, figure.value, figure.source, note)


def _sync_timed(torch, fn: Callable[[], object], count: int) -> float:
    """Seconds per call of ``fn`` over ``count`` calls, including the final synchronize."""
    return best_of(fn, reps=1, warmup=0, calls=count, synchronize=torch.cuda.synchronize)


def launch_rows(torch, device: int, count: int) -> list:
    x = torch.zeros(1, device=f"cuda:{device}")
    x.add_(1)
    torch.cuda.synchronize(device)
    # no synchronize inside the block: the host returns before the kernel runs, and that return is the figure
    issue = best_of(functools.partial(x.add_, 1), reps=1, warmup=0, calls=count)
    torch.cuda.synchronize(device)

    def round_trip():
        x.add_(1)
        torch.cuda.synchronize(device)

    trip = _sync_timed(torch, round_trip, max(count // 4, 10))
    per_graph = 32
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):  # warm up on a side stream, as capture requires
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            x.add_(1)
    replay = _sync_timed(torch, graph.replay, max(count // per_graph, 10)) / per_graph
    name = f"gpu{device}"
    return [
        _row(f"{name}_launch_issue", f"Launch CUDA kernel, issue only (GPU {device})", issue * 1e9,
             "host time to enqueue one tiny kernel", "gpu_launch"),
        _row(f"{name}_launch_round_trip", f"Launch CUDA kernel + synchronize (GPU {device})", trip * 1e9,
             "enqueue, run, wait for completion", "gpu_launch"),
        _row(f"{name}_graph_replay", f"Kernel in a CUDA graph replay (GPU {device})", replay * 1e9,
             f"per kernel, {per_graph} kernels per graph", "gpu_launch"),
    ]


def _copy_time(torch, dst, src, reps: int) -> float:
    return best_of(functools.partial(dst.copy_, src), reps=reps, synchronize=torch.cuda.synchronize)


def transfer_rows(torch, device: int, sizes: list[int], reps: int) -> list:
    rows = []
    dev = f"cuda:{device}"
    for pinned in (True, False):
        for direction in ("host->device", "device->host"):
            times = []
            for n in sizes:
                host = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
                gpu = torch.empty(n, dtype=torch.uint8, device=dev)
                dst, src = (gpu, host) if direction == "host->device" else (host, gpu)
                times.append(_copy_time(torch, dst, src, reps))
            link = Link.fit(sizes, times)
            alpha, bandwidth = link.alpha_s, link.bandwidth
            at_1m = times[sizes.index(_MIB)] if _MIB in sizes else link.time(_MIB)
            kind = "pinned" if pinned else "pageable"
            key = f"gpu{device}_{'h2d' if direction == 'host->device' else 'd2h'}_{kind}_1m"
            rows.append(_row(key, f"Transfer 1MB {direction}, {kind} (GPU {device})", at_1m * 1e9,
                             f"fit t = alpha + n/B over {len(sizes)} sizes: alpha {alpha * 1e6:.1f} us, "
                             f"B {bandwidth / 1e9:.1f} GB/s", "gpu_copy_1m"))
    return rows


def device_copy_rows(torch, device: int, nbytes: int, reps: int) -> list:
    dev = f"cuda:{device}"
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    seconds = _copy_time(torch, dst, src, reps)
    return [_row(f"gpu{device}_d2d", f"Device-to-device copy (GPU {device})", 2 * nbytes / seconds / 1e9,
                 f"{nbytes // _MIB} MB copy; bytes read plus written per second", "gpu_d2d")]


def peer_rows(torch, reps: int) -> list:
    rows = []
    count = torch.cuda.device_count()
    for i in range(count):
        for j in range(count):
            if i == j:
                continue
            peer = torch.cuda.can_device_access_peer(i, j)
            src = torch.empty(_MIB, dtype=torch.uint8, device=f"cuda:{i}")
            dst = torch.empty(_MIB, dtype=torch.uint8, device=f"cuda:{j}")
            seconds = _copy_time(torch, dst, src, reps)
            note = "direct peer access" if peer else "no peer access: staged through the host"
            rows.append(_row(f"gpu{i}_to_gpu{j}_1m", f"Transfer 1MB GPU {i} -> GPU {j}", seconds * 1e9,
                             f"{note}; {_MIB / seconds / 1e9:.1f} GB/s", "gpu_peer_1m"))
    return rows


def gpu_rows(plan) -> list:
    """Every GPU row, or none when no CUDA device is visible."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return []
    quick = plan.reps < 5
    sizes = [4096 * 4 ** k for k in range(7 if quick else 9)]  # 4 KB .. 16 MB (quick) or 256 MB
    if _MIB not in sizes:
        sizes.append(_MIB)
    sizes.sort()
    rows = []
    for device in range(torch.cuda.device_count()):
        with torch.cuda.device(device):  # every synchronize() and stream here is this device's
            rows += launch_rows(torch, device, 2000 if quick else 20000)
            rows += transfer_rows(torch, device, sizes, plan.reps)
            rows += device_copy_rows(torch, device, (64 if quick else 256) * _MIB, plan.reps)
    rows += peer_rows(torch, plan.reps)
    return rows
