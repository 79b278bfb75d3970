"""``dlperf launch``: run a dlperf verb or a Python script as several processes, on one host or many.

    dlperf launch --nproc-per-node 2 -- train --devices cpu:0 --epochs 2
    dlperf launch --nproc-per-node 2 -- my_script.py --lr 0.1
    dlperf launch --nproc-per-node 2 -- python my_script.py --lr 0.1     # horovodrun's and mpirun's habit
    dlperf launch --nproc-per-node 2 -- python -m mypkg.train --lr 0.1
    dlperf launch --nproc-per-node 2 --nnodes 2 --node-rank 0 --master 10.0.0.1:29500 -- train ...

PyTorch's elastic agent (the machinery of ``torchrun``) starts the processes, through
:class:`~dlperf.parallel.launchers.ProcessLauncher`; each gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``. A dlperf verb runs inside a gloo process group the launcher opens,
so ``train`` trains one model across every process; a script opens its own, as it would under
``torchrun`` (a dlperf ``Trainer`` or distributed KVStore in it joins the processes by itself). ``--num-servers
S`` is passed to every process as ``DLPERF_NUM_SERVERS`` for a distributed KVStore's parameter servers: the
last ``S`` ranks are servers (role ``"server"`` in :func:`~dlperf.parallel.launchers.rank_role` and in failure
messages). Under ``train --kvstore dist_sync`` they serve the weights instead of training; a script decides with
``rank_role()``. With ``--max-restarts K`` a failed process group is started again, up to ``K`` times;
``train --checkpoint FILE`` then continues from the last epoch FILE holds.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import signal
import sys
from collections.abc import Callable
from typing import Any

from ..errors import UsageError
from ..kvstore.dist import NUM_SERVERS_ENV
from .options import one_line

__all__ = ["register", "run", "start", "parse_master", "NUM_SERVERS_ENV", "DEFAULT_TIMEOUT_S"]

from ..parallel.launchers.launch_config import RUN_TIMEOUT_S as DEFAULT_TIMEOUT_S  # noqa: E402

MIN_LAUNCH_TIMEOUT_S = 1.0
"""The shortest ``--timeout``: a whole launch, and processes take about that long to start. The library's
:data:`~dlperf.parallel.launchers.launch_config.MIN_TIMEOUT_S` is lower: it bounds single waits too (a fault
timeout of half a second is a real setting)."""
MAX_PROCESSES = 1024
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")
_PYTHON = re.compile(r"^python(3(\.[0-9]{1,2})?)?$")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def parse_master(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> ``(host, port)``.

    >>> parse_master("10.0.0.1:29500")
    ('10.0.0.1', 29500)
    """
    m = _HOST_PORT.match(text.strip()) if len(text) < 300 else None
    port = int(m.group(2)) if m else 0
    if not m or not 0 < port < 65536:
        raise argparse.ArgumentTypeError(one_line(
            f"{text[:80]!r} is not HOST:PORT; give --master the first node's address and a free TCP port "
            "1..65535, e.g. 10.0.0.1:29500"))
    return m.group(1).strip("[]"), port


def _timeout(text: str) -> float:
    from ..parallel.launchers.launch_config import MAX_TIMEOUT_S
    from . import options as va

    value = va.positive_float("--timeout", max_value=MAX_TIMEOUT_S)(text)
    if value < MIN_LAUNCH_TIMEOUT_S:
        raise argparse.ArgumentTypeError(one_line(
            f"{text[:40]!r} is too short; give --timeout at least {MIN_LAUNCH_TIMEOUT_S:g} seconds (processes take "
            "that long to start)"))
    return value


def register(sub) -> None:
    from . import options as va

    p = sub.add_parser("launch", help="run a dlperf verb or a Python script as several processes",
                       description=__doc__.splitlines()[0])
    p.add_argument("--nproc-per-node", required=True, type=va.int_in(1, MAX_PROCESSES, "--nproc-per-node"),
                   help="processes on this host")
    p.add_argument("--nnodes", default=1, type=va.int_in(1, MAX_PROCESSES, "--nnodes"),
                   help="hosts taking part; each runs the same command with its own --node-rank")
    p.add_argument("--node-rank", default=0, type=va.int_in(0, MAX_PROCESSES - 1, "--node-rank"),
                   help="0 on the host named by --master")
    p.add_argument("--master", metavar="HOST:PORT", type=parse_master,
                   help="where node 0 meets the others (needed with --nnodes > 1; default: this host, a free port)")
    p.add_argument("--num-servers", default=0, type=va.int_in(0, MAX_PROCESSES, "--num-servers"),
                   help=f"parameter servers for a distributed KVStore (passed on as {NUM_SERVERS_ENV})")
    p.add_argument("--max-restarts", default=0, type=va.int_in(0, 1000, "--max-restarts"),
                   help="restart every process this often after a failure before giving up")
    p.add_argument("--timeout", default=DEFAULT_TIMEOUT_S, type=_timeout, metavar="SECONDS",
                   help=f"stop the launch after this long, rendezvous included ({MIN_LAUNCH_TIMEOUT_S:g} s to a year; "
                        "default: a week)")
    p.add_argument("--verbose", action="store_true",
                   help="on a failure, also print the failed rank's full traceback and torch's log on stderr "
                        "(they are kept in the log file the error line names)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   metavar="-- VERB ARGS... | SCRIPT.py ARGS... | python SCRIPT.py ARGS... | python -m MODULE ARGS...")
    p.set_defaults(func=run)


def _verbs() -> list[str]:
    from . import VERB_MODULES

    return [m.rsplit(".", 1)[1] for m in VERB_MODULES if not m.endswith(".launch")]


def _check_layout(args: argparse.Namespace) -> None:
    if args.node_rank >= args.nnodes:
        raise UsageError(f"--node-rank {args.node_rank} with --nnodes {args.nnodes}: expected a node rank from 0 "
                         f"to {args.nnodes - 1}")
    world = args.nproc_per_node * args.nnodes
    if args.num_servers >= world:
        raise UsageError(f"--num-servers {args.num_servers} with {world} processes: expected fewer servers than "
                         "processes, so at least one trains; raise --nproc-per-node or lower --num-servers")
    if args.nnodes > 1 and args.master is None:
        raise UsageError(f"--nnodes {args.nnodes} needs --master HOST:PORT, the same on every node (node 0's "
                         "address and a free port), so the nodes can find each other")


def start(args: argparse.Namespace, fn: Callable[..., Any], *fn_args: Any, backend: str | None = "gloo") -> int:
    """Run ``fn(*fn_args)`` in every process the launch options describe; the largest exit status wins.

    ``fn`` returns an exit status (``None`` is 0). A process that fails is one line on stderr and status 1.
    A launch stopped by a signal exits 128 + its number (Ctrl-C: 130, SIGTERM: 143) after telling the other
    nodes; what the processes finished (their checkpoints) is kept.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ..parallel.launchers import LaunchError, ProcessLauncher

    _check_layout(args)
    addr, port = args.master if args.master is not None else ("127.0.0.1", None)
    world = args.nproc_per_node * args.nnodes
    launcher = ProcessLauncher(args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank, master_addr=addr,
                               master_port=port, backend=backend, join_timeout_s=args.timeout,
                               max_restarts=args.max_restarts,
                               roles={rank: "server" for rank in range(world - args.num_servers, world)})
    try:
        codes = launcher.launch(_in_worker, args.num_servers, fn, fn_args)
    except (LaunchError, SignalException) as exc:
        return report_launch_error("launch", exc, verbose=getattr(args, "verbose", False))
    return max((int(c or 0) for c in codes), default=0)


def report_launch_error(verb: str, exc: BaseException, *, verbose: bool) -> int:
    """One line for a launch that failed or was stopped by a signal; the exit status it means."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if isinstance(exc, SignalException):  # SIGTERM, SIGHUP (SIGINT arrives as KeyboardInterrupt: status 130)
        print(f"dlperf {verb}: stopped by {signal.Signals(exc.sigval).name}", file=sys.stderr)
        return 128 + int(exc.sigval)
    path = getattr(exc, "log_path", None)
    if path and verbose:
        _print_log(path)
    log = f" (full traceback and torch's log: {path})" if path else ""
    print(f"dlperf {verb}: error: {one_line(str(exc))}{log}", file=sys.stderr)
    return 1


def _print_log(path: str) -> None:
    """The kept log on stderr, as text: what ``--verbose`` shows before the one error line."""
    try:
        with open(path, "rb") as f:
            text = f.read(4 << 20).decode("utf-8", "replace")
    except OSError as exc:
        print(f"dlperf launch: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return
    sys.stderr.write(text if text.endswith("\n") else text + "\n")


def _in_worker(num_servers: int, fn: Callable[..., Any], fn_args: tuple) -> int:
    if num_servers:
        os.environ[NUM_SERVERS_ENV] = str(num_servers)
    return int(fn(*fn_args) or 0)


def run_verb(argv: list[str]) -> int:
    """A worker: one dlperf verb, as ``dlperf ARGV`` would run it."""
    from . import main

    return main(argv)


def run_script(path: str, argv: list[str]) -> int:
    """A worker: a Python script as ``python PATH ARGV`` would run it."""
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:  # the script's own exit status
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0


def run_module(module: str, argv: list[str]) -> int:
    """A worker: ``python -m MODULE ARGV``, the current directory first on the path as ``-m`` puts it."""
    sys.argv = [module, *argv]
    sys.path.insert(0, os.getcwd())
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    return 0


def _is_python(head: str) -> bool:
    if _PYTHON.match(os.path.basename(head)):
        return True
    try:
        return os.path.realpath(head) == os.path.realpath(sys.executable)
    except (OSError, ValueError):
        return False


def _python_command(command: list[str]) -> tuple[Callable[..., int], str, list[str]]:
    """``python [-u] SCRIPT ARGS`` or ``python [-u] -m MODULE ARGS`` -> the worker that runs it in each process.

    The processes already run this Python; ``-u`` (unbuffered output) reaches them as ``PYTHONUNBUFFERED``
    (each starts a fresh interpreter); other interpreter options are refused rather than silently dropped.
    """
    rest = command[1:]
    while rest[:1] == ["-u"]:
        os.environ["PYTHONUNBUFFERED"] = "1"
        rest = rest[1:]
    usage = "give python SCRIPT.py ARGS or python -m MODULE ARGS, e.g. dlperf launch --nproc-per-node 2 -- python " \
            "train.py --lr 0.1"
    if rest[:1] == ["-m"]:
        module = rest[1] if len(rest) > 1 else ""
        if not _MODULE.match(module) or len(module) > 300:
            raise UsageError(f"python -m {module[:80]!r}: expected a module name; {usage}")
        if not _module_exists(module.split(".")[0]):
            raise UsageError(f"python -m {module}: no module named {module.split('.')[0]!r} here; run from the "
                             "directory that holds it or add it to PYTHONPATH")
        return run_module, module, rest[2:]
    if not rest:
        raise UsageError(f"{command[0]} with no script; {usage}")
    if rest[0].startswith("-"):
        raise UsageError(f"python option {rest[0][:40]!r} is not supported under dlperf launch (the processes run "
                         f"this Python already); {usage}")
    if not os.path.isfile(rest[0]):
        raise UsageError(f"script {rest[0][:200]!r} does not exist or is not a file; give the path of a Python "
                         "script")
    return run_script, rest[0], rest[1:]


def _module_exists(top: str) -> bool:
    import importlib.util

    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(top) is not None  # a top-level name: found without running its code
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.remove(os.getcwd())


def _precheck_verb(argv: list[str], world: int, num_servers: int) -> int:
    """Parse (and for ``train`` check) the verb's options here, once, before any process starts."""
    from . import build_parser

    try:
        parsed = build_parser().parse_args(argv)
    except SystemExit as exc:  # the verb's parser printed its one line (or --help)
        return 2 if exc.code not in (0, None) else -1
    if num_servers and parsed.verb != "train":
        raise UsageError(f"--num-servers {num_servers} with {parsed.verb}: only train has parameter servers (with "
                         "--kvstore dist_sync); drop --num-servers")
    if parsed.verb == "train":
        if parsed.nproc_per_node is not None:
            raise UsageError(f"train --nproc-per-node {parsed.nproc_per_node} under dlperf launch: give the process "
                             "count once, to dlperf launch (--nproc-per-node) or to dlperf train")
        parsed.check_in_parent(parsed, world, num_servers)
    return 0


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    verbs = _verbs()
    if not command:
        raise UsageError(f"no command to launch; give one after --: a dlperf verb ({', '.join(verbs)}) or a "
                         "Python script, e.g. dlperf launch --nproc-per-node 2 -- train --epochs 1")
    _check_layout(args)
    world = args.nproc_per_node * args.nnodes
    head = command[0]
    if head in verbs:
        status = _precheck_verb(command, world, args.num_servers)
        if status:
            return max(status, 0)
        return start(args, run_verb, command)
    if _is_python(head):
        worker, target, argv = _python_command(command)
        return start(args, worker, target, argv, backend=None)
    if head.endswith(".py"):
        if not os.path.isfile(head):
            raise UsageError(f"script {head!r} does not exist or is not a file; give the path of a Python script")
        return start(args, run_script, head, command[1:], backend=None)
    raise UsageError(f"{head[:80]!r} is neither a dlperf verb ({', '.join(verbs)}) nor a Python script (.py, "
                     "python SCRIPT.py, python -m MODULE); give one after --")
