"""``dlperf devices``: every device this process can use, in the spirit of nvidia-smi."""

from __future__ import annotations

import argparse
import json

import torch

from ..devices import num_gpus
from ..inventory import inventory


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def run(args: argparse.Namespace) -> int:
    inv = inventory()
    if args.json:
        print(json.dumps({"devices": inv, "torch": torch.__version__, "cuda": torch.version.cuda}))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"dlperf devices (torch {torch.__version__}, CUDA {torch.version.cuda or 'none'})")
    for col in ("device", "name", "compute", "memory used / total"):
        table.add_column(col)
    for d in inv:
        if d["kind"] == "cpu":
            compute = f"{d['cores']} cores, {d['logical_cpus']} logical CPUs, torch threads {d['torch_threads']}"
        else:
            compute = f"sm_{d['compute_capability'].replace('.', '')}, {d['multiprocessors']} SMs"
        table.add_row(d["device"], d["name"], compute,
                      f"{_gib(d['memory_used_bytes'])} / {_gib(d['memory_total_bytes'])}")
    Console().print(table)
    if num_gpus() == 0:
        print("No CUDA GPU is visible: try_gpu() returns cpu(0); logical CPU devices cpu(0), cpu(1), ... "
              "stand in for several devices.")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("devices", help="list every device: kind, name, memory, cores", description=__doc__)
    p.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    p.set_defaults(func=run)
