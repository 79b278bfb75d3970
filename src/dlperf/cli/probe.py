"""``dlperf probe``: this machine's latency, bandwidth and FLOP/s beside d2l Tables 12.4.1 and 12.4.2.

    dlperf probe --quick            # under a minute; saved to the per-machine cache
    dlperf probe --cached           # the saved figures, measuring only when there are none
    dlperf probe --json out.json    # the table, and the figures as one JSON document in out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..errors import DlperfError
from . import options as va


def format_value(value: float | None, unit: str) -> str:
    """A figure in its most readable unit: ns, us or ms for times, as-is for rates."""
    if value is None:
        return "unavailable"
    if unit == "ns":
        if value < 1e3:
            return f"{value:.1f} ns" if value < 100 else f"{value:.0f} ns"
        if value < 1e6:
            return f"{value / 1e3:.1f} us"
        return f"{value / 1e6:.2f} ms"
    return f"{value:.1f} {unit}"


def format_ratio(row) -> str:
    ratio = row.ratio
    if ratio is None:
        return "-"
    return f"{ratio:.3g}x"


def render(result, cache_file: str | None, console=None) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console(width=None if sys.stdout.isatty() else 200)
    info = result.machine
    load = info.get("loadavg")
    title = (f"dlperf probe: {info.get('cpu')}, {info.get('cores')} cores, torch {info.get('torch')}"
             f"{' (quick)' if result.quick else ''}")
    # Every string may come from a cache file: Text keeps square brackets from being read as markup.
    table = Table(title=Text(title), header_style="bold")
    table.add_column("what", no_wrap=True)
    table.add_column("this machine", justify="right", no_wrap=True)
    table.add_column("d2l 12.4", justify="right", no_wrap=True)
    table.add_column("ratio", justify="right", no_wrap=True)
    table.add_column("note")
    for row in result.rows:
        table.add_row(Text(row.what), format_value(row.value, row.unit), format_value(row.seed, row.unit),
                      format_ratio(row), Text(f"{row.note} (d2l: {row.seed_source})"))
    console.print(table, highlight=False)
    footer = ["ratio = this machine / d2l: above 1 is slower for times, faster for GB/s and GFLOP/s."]
    if load:
        busy = max(load) > (info.get("cores") or 1)
        footer.append(f"load average {load[0]} before, {load[1]} after, on {info.get('cores')} cores"
                      f"{': other work shared the cores, so the figures are pessimistic' if busy else '.'}")
    if result.interrupted:
        footer.append("interrupted: the rows above are the ones finished; nothing was saved.")
    elif cache_file:
        footer.append(f"figures from {cache_file} (measured {time.ctime(result.created)})")
    for line in footer:
        console.print(line, style="dim", highlight=False, markup=False)


def run(args: argparse.Namespace) -> int:
    from ..probe.cache import cache_path, load_probe
    from ..probe.hardware import QUICK, TINY, run_probe

    if args.json not in (None, "-"):
        from .._io import check_writable

        check_writable(args.json)  # now, not after a minute of measuring
    result = load_probe() if args.cached else None
    source = cache_path(result.machine) if result is not None else None
    if result is None:
        progress = (lambda name: print(f"dlperf probe: measuring {name}...", file=sys.stderr, flush=True))
        plan = TINY if args.tiny else QUICK if args.quick else None
        result = run_probe(quick=args.quick, progress=progress, _plan=plan, save=False)
        source = None if args.tiny or result.interrupted else _save(result)
    render(result, source)
    document = json.dumps(result.to_dict(), allow_nan=False)
    if args.json:
        from .._io import atomic_write_text

        atomic_write_text(args.json, document + "\n")  # "-" and /dev/stdout: the last stdout line
    return 130 if result.interrupted else 0


def _save(result) -> str | None:
    """Where the figures were saved, or None (with a warning saying why) when they could not be."""
    from ..probe.cache import save_probe

    try:
        return save_probe(result)
    except (DlperfError, OSError, RuntimeError) as exc:  # the figures are still shown
        va.warn("probe", f"{exc}; the figures were not saved")
        return None


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="this machine's latency numbers beside d2l Tables 12.4.1 and 12.4.2",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="fewer repetitions and smaller sweeps (under a minute on two cores)")
    p.add_argument("--cached", action="store_true",
                   help="show this machine's saved figures; measure only when there are none (or they are unusable)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   type=va.output_path("--json", allow_stdout=True, in_place=True),
                   help="also print one JSON document as the last stdout line (or write it to FILE)")
    # Test-sized measurements: seconds instead of a minute, never saved to the cache.
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=run)
