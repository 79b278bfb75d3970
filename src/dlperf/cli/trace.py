"""``dlperf trace FILE``: summarise an engine timeline or a torch.profiler trace (Chrome trace JSON).

Example:
    dlperf trace run.json          # busy % per worker, overlap, mean parallelism; for a training run,
                                   # how much of the gradient communication overlapped backward
    dlperf trace run.json --json   # the same as one JSON object
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from .._cliargs import one_line
from ..engine.trace import format_summary, load_trace
from ..parallel.training.timeline import comm_overlap

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
    trace = load_trace(args.file)
    summary = trace.summary()
    # a training run's timeline names its communication and its forward/backward: say how much hid
    overlap = comm_overlap(trace)
    if args.json:
        doc = summary.to_dict()
        if overlap["comm_us"] > 0:
            doc["communication"] = overlap
        print(json.dumps(doc))
    else:
        # worker names come from the file: an escape sequence or a newline in one must not reach the terminal
        shown = dataclasses.replace(summary, workers=[dataclasses.replace(w, worker=one_line(w.worker))
                                                      for w in summary.workers])
        print(format_summary(shown))
        if overlap["comm_us"] > 0:
            print(f"communication {overlap['comm_us'] / 1e3:.3f} ms, of which {overlap['overlap_fraction']:.0%} "
                  f"overlapped forward/backward ({overlap['overlap_us'] / 1e3:.3f} ms)")
    return 0
