"""``dlperf plans``: the planner's cached decisions, and clearing them.

    dlperf plans             # model, batch, plan, ms/step, when, contended or stale
    dlperf plans --clear     # forget them all: the next run plans again
"""

from __future__ import annotations

import argparse
import json
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plans", help="list the planner's cached decisions (model, batch, plan, figures, when), or "
                                     "clear them", description=__doc__.splitlines()[0])
    p.add_argument("--clear", action="store_true", help="forget every cached decision (the next run plans again)")
    p.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..parallel.planning.plan_cache import cached_decisions, clear_cache, default_cache_path

    path = default_cache_path()
    if args.clear:
        count = clear_cache(path)
        print(f"cleared {count} cached decision{'s' * (count != 1)} from {path}")
        return 0
    decisions = cached_decisions(path)
    if args.json:
        print(json.dumps({"cache": path, "decisions": decisions}))
        return 0
    if not decisions:
        print(f"no cached decision in {path}")
        return 0
    print(f"{'when':<16}  {'ms/step':>8}  {'use':<9}  plan  (for)")
    for d in decisions:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(d["saved"])) if d["saved"] else "-"
        ms = f"{d['measured_ms']:.2f}" if d["measured_ms"] is not None else "-"
        use = "used" if d["used"] else ("contended" if d["contended"] else "stale")
        print(f"{when:<16}  {ms:>8}  {use:<9}  {d['plan']}  ({d['label'] or d['key'][:12]})")
    print(f"{len(decisions)} in {path}; contended or stale ones are measured again by the next run "
          "(dlperf train --replan measures again any)")
    return 0
