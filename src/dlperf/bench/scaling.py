"""Table 8 of Shi et al. (2016): time per mini-batch on 1, 2, 4 devices, global batch fixed.

The global mini-batch stays the same however many devices share it (4096 for FCN-R, 1024 for
AlexNet-R, 128 for ResNet-56), so perfect scaling halves the time per mini-batch with each doubling of
devices. dlperf's :class:`~dlperf.parallel.Trainer` is timed on 1..k devices with the shared timing
protocol, and the paper's figures (Tesla K80 GK210 GPUs) are printed beside it.

>>> sorted(PAPER_TABLE8) == sorted(GLOBAL_BATCH)
True
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from ..devices import Device, cpu, cpu_count, gpu, num_gpus
from .timing import doubling_up_to, time_steps

__all__ = ["PAPER_TABLE8", "GLOBAL_BATCH", "PAPER_DEVICE_COUNTS", "main_scaling", "measure_scaling",
           "device_counts"]

PAPER_DEVICE_COUNTS = (1, 2, 4)
# Seconds per mini-batch on 1, 2 and 4 GK210 GPUs (Table 8).
PAPER_TABLE8: dict[str, dict[str, tuple[float, float, float]]] = {
    "fcn-r": {"Caffe": (0.239, 0.131, 0.094), "CNTK": (0.181, 0.111, 0.072), "TF": (0.208, 0.144, 0.121),
              "MXNet": (0.184, 0.104, 0.086), "Torch": (0.165, 0.110, 0.112)},
    "alexnet-r": {"Caffe": (0.137, 0.085, 0.047), "CNTK": (0.108, 0.062, 0.037), "TF": (0.385, 0.332, 0.321),
                  "MXNet": (0.122, 0.070, 0.041), "Torch": (0.141, 0.077, 0.046)},
    "resnet-56": {"Caffe": (0.378, 0.254, 0.177), "CNTK": (0.562, 0.351, 0.170), "TF": (0.523, 0.291, 0.197),
                  "MXNet": (0.270, 0.167, 0.101), "Torch": (0.301, 0.182, 0.096)},
}
GLOBAL_BATCH = {"fcn-r": 4096, "alexnet-r": 1024, "resnet-56": 128}
_FRAMEWORKS = ("Caffe", "CNTK", "TF", "MXNet", "Torch")


def default_devices() -> list[Device]:
    """All GPUs when there are at least two, else one logical CPU device per core."""
    n = num_gpus()
    if n >= 2:
        return [gpu(i) for i in range(n)]
    return [cpu(i) for i in range(max(1, cpu_count()))]


def device_counts(k: int) -> list[int]:
    """1, 2, 4, ... up to ``k``, and ``k`` itself.

    >>> device_counts(6)
    [1, 2, 4, 6]
    """
    return doubling_up_to(k)


def _paper(network: str, n: int) -> dict[str, float]:
    if n not in PAPER_DEVICE_COUNTS:
        return {}
    i = PAPER_DEVICE_COUNTS.index(n)
    return {fw: times[i] for fw, times in PAPER_TABLE8[network].items()}


def measure_scaling(network: str, devices: Sequence[Device], *, steps: int, warmup: int,
                    global_batch: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Time one training step of ``network`` on the first 1, 2, 4, ... of ``devices``."""
    from ..models import get_spec
    from ..parallel import Trainer

    spec = get_spec(network)
    batch = global_batch or GLOBAL_BATCH[network]
    torch.manual_seed(seed)
    model = spec.build()
    X, y = spec.input.make_batch(batch, generator=torch.Generator().manual_seed(seed))
    if any(d.is_gpu for d in devices) and torch.cuda.is_available():
        X, y = X.pin_memory(), y.pin_memory()  # lets the per-device copies run asynchronously
    rows, base = [], None
    for n in device_counts(len(devices)):
        devs = list(devices[:n])
        with Trainer(model, devs, "sgd", {"lr": 0.01, "momentum": 0.9}, loss=spec.loss) as trainer:
            def sync(devs=devs) -> None:
                for d in devs:
                    d.synchronize()

            timing = time_steps(lambda: trainer.train_step(X, y), warmup=warmup, steps=steps, synchronize=sync)
        base = base or timing.median_s
        rows.append({"network": network, "devices": n, "device_list": [str(d) for d in devs],
                     "global_batch": batch, "median_s": timing.median_s, "q1_s": timing.q1_s,
                     "q3_s": timing.q3_s, "noisy": timing.noisy, "speedup": base / timing.median_s,
                     "paper_s": _paper(network, n)})
    return rows


def _print_table(rows: list[dict[str, Any]], devices: Sequence[Device]) -> None:
    kind = "GPU" if devices[0].is_gpu else "logical CPU device"
    print(f"Table 8: time per mini-batch (s), global batch fixed and split across {kind}s; "
          f"paper: Tesla K80 (GK210) GPUs")
    head = f"{'network':<10} {'dev':>3} {'batch':>5} {'dlperf s':>9} {'IQR s':>7} {'speedup':>7}"
    head += "".join(f" {fw:>6}" for fw in _FRAMEWORKS)
    print(head)
    print("-" * len(head))
    for r in rows:
        line = (f"{r['network']:<10} {r['devices']:>3} {r['global_batch']:>5} {r['median_s']:>9.3f} "
                f"{r['q3_s'] - r['q1_s']:>7.3f} {r['speedup']:>6.2f}x")
        line += "".join(f" {r['paper_s'][fw]:>6.3f}" if r["paper_s"] else f" {'-':>6}" for fw in _FRAMEWORKS)
        print(line + ("  (noisy)" if r["noisy"] else ""))


def _check_scaling_args(args, n_devices: int) -> None:
    """Refuse what Table 8 cannot honour before any model is built or timed."""
    from ..errors import UsageError

    ignored = [f"--mode {args.mode}" if getattr(args, "mode", "eager") != "eager" else None,
               "--threads" if getattr(args, "threads", None) is not None else None,
               *(f"--{o}" for o in ("csv", "markdown", "plot") if getattr(args, o, None) is not None)]
    ignored = [o for o in ignored if o]
    if ignored:
        raise UsageError(f"--scaling does not take {', '.join(ignored)}: it times eager steps with one worker "
                         f"thread per device and writes its table and --json only")
    for name, low in (("steps", 1), ("warmup", 0)):
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise UsageError(f"--{name} must be >= {low}, got {value}")
    batch = getattr(args, "batch_size", None)
    if batch is not None and batch < max(1, n_devices):
        raise UsageError(f"--batch-size must be >= 1 and at least the {n_devices} devices (each device needs one "
                         f"example per step), got {batch}")


def main_scaling(args) -> int:
    """Run Table 8 (``dlperf bench --scaling``); see the module docstring for the protocol."""
    from .._io import atomic_write_text, check_writable
    from ..errors import UsageError
    from ..parallel import check_devices

    networks = list(args.networks or GLOBAL_BATCH)
    for n in networks:
        if n not in GLOBAL_BATCH:
            raise UsageError(f"Table 8 has no network {n!r}; valid choices: {', '.join(GLOBAL_BATCH)}")
    devices = check_devices(args.devices or default_devices())
    _check_scaling_args(args, len(devices))
    from .cli import check_batch_memory

    check_batch_memory(networks, getattr(args, "batch_size", None))
    json_file = args.json if isinstance(args.json, str) and args.json != "-" else None
    if json_file:
        try:
            check_writable(json_file)  # fail now, not after minutes of timing
        except OSError as exc:
            raise UsageError(f"cannot write --json {json_file}: {exc.strerror or exc}") from None
    quick = bool(getattr(args, "quick", False))
    steps = args.steps if args.steps is not None else (3 if quick else 10)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    batches = dict(getattr(args, "global_batch", None) or {})
    if getattr(args, "batch_size", None) is not None:  # one global batch for every network (quick checks)
        batches = {net: args.batch_size for net in networks}
    rows: list[dict[str, Any]] = []
    for net in networks:
        rows += measure_scaling(net, devices, steps=steps, warmup=warmup, global_batch=batches.get(net))
    _print_table(rows, devices)
    if args.json:
        doc = json.dumps({"table": 8, "devices": [str(d) for d in devices], "steps": steps, "warmup": warmup,
                          "rows": rows})
        if json_file:
            atomic_write_text(json_file, doc + "\n")  # a reader never sees half a document
        else:
            print(doc)
    return 0
