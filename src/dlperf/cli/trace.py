"""``dlperf trace FILE``: summarise an engine timeline or a torch.profiler trace (Chrome trace JSON).

Example:
    dlperf trace run.json          # busy % per worker, overlap, mean parallelism
    dlperf trace run.json --json   # the same as one JSON object
"""

from __future__ import annotations

import argparse
import json

from ..engine.trace import format_summary, load_trace

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="summarise an engine or torch.profiler timeline: busy %% per worker, overlap",
                       description="Summarise a Chrome trace JSON written by Engine.stop_trace().save() or by "
                                   "torch.profiler's export_chrome_trace (workers: threads that ran operators, "
                                   "GPU streams).")
    from .options import existing_file

    p.add_argument("file", metavar="FILE", type=existing_file("FILE"), help="Chrome trace JSON file")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    summary = load_trace(args.file).summary()
    if args.json:
        print(json.dumps(summary.to_dict()))
    else:
        print(format_summary(summary))
    return 0
