"""``dlperf <verb>``: a thin shell over the library.

Each verb lives in its own module of this package that exposes ``register(subparsers)``; the parser it
adds sets ``func`` to a callable taking the parsed arguments and returning an exit status. A verb only
turns options into the library's configs and prints; the library never imports this package.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from .._hostmem import keep_freed_host_memory
from ..errors import DlperfError, Terminated, user_code_line
from .options import flag_words, one_line

# Verb modules, imported lazily so that `dlperf devices` does not pay for the engine or compiler.
VERB_MODULES: tuple[str, ...] = (
    "dlperf.cli.bench",
    "dlperf.cli.devices",
    "dlperf.cli.train",
    "dlperf.cli.launch",
    "dlperf.cli.export",
    "dlperf.cli.trace",
    "dlperf.cli.probe",
    "dlperf.cli.profile",
    "dlperf.cli.scale",
    "dlperf.cli.plans",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, no usage dump
        # argparse quotes some values verbatim (unrecognized arguments): keep a newline in one from
        # splitting the error over several lines
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dlperf", description="Fast deep-learning training on the hardware you have, "
                                                "and where the time goes.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    # Not required here: main() reports a missing verb itself, so that `dlperf --bogus` names --bogus
    # rather than the missing verb.
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    for name in VERB_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _version() -> str:
    from .. import __version__

    return __version__


def _verb_names(parser: argparse.ArgumentParser) -> list[str]:
    return [name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name in action.choices]


class _Notes(logging.Handler):
    """The library's notes as the lines a verb prints: what it decided (INFO, such as the plan it chose) on
    stdout with its other results while a verb runs, warnings on stderr (also outside a verb: a script's)."""

    verb_running = False

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.WARNING and not _Notes.verb_running:
            return
        try:
            if record.name == "dlperf.progress":  # what a long measurement is doing: on a terminal only
                if sys.stderr.isatty():
                    print(one_line(record.getMessage()), file=sys.stderr, flush=True)
                return
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            print(one_line(record.getMessage()), file=stream, flush=True)
        except Exception:  # noqa: BLE001 - a note that cannot be shown must not end the run
            self.handleError(record)


def show_notes(verb: bool = True) -> None:
    """Print the library's notes, one line each (the handler is installed once per process); ``verb``: this process
    runs a verb (a launched worker of one, too), whose decisions (INFO notes) are printed as its output."""
    logger = logging.getLogger("dlperf")
    if not any(isinstance(h, _Notes) for h in logger.handlers):
        logger.addHandler(_Notes())
    logger.setLevel(logging.INFO)
    if verb:
        _Notes.verb_running = True


def main(argv: list[str] | None = None) -> int:
    """Run one verb; return its exit status (2 for bad input, with one line on stderr)."""
    show_notes(verb=False)
    try:
        # the verbs import torch: a Ctrl-C while it loads is an interruption like any other
        parser = build_parser()
    except KeyboardInterrupt:
        print("dlperf: interrupted", file=sys.stderr)
        return 130
    try:
        args = parser.parse_args(argv)
        if args.verb is None:
            verbs = ", ".join(_verb_names(parser))
            parser.error(f"the following arguments are required: VERB (one of {verbs})")
    except SystemExit as exc:  # a usage error, --help or --version: the status, not an exception
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 2
    try:
        # every step's activations reuse the last step's freed memory instead of page-faulting it
        # in again (up to 1.6x per CPU training step; see dlperf._hostmem)
        keep_freed_host_memory()
        with stopped_by_signals():
            _Notes.verb_running = True
            try:
                return int(args.func(args) or 0)
            finally:
                _Notes.verb_running = False
    except Terminated as exc:  # (what a verb did not report itself)
        print(f"dlperf {args.verb}: {exc}", file=sys.stderr)
        return exc.status
    except DlperfError as exc:  # the library names its parameters; the CLI's line names the flags
        print(f"dlperf {args.verb}: error: {one_line(flag_words(str(exc)))}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user gave cannot be read or written
        print(f"dlperf {args.verb}: error: {one_line(user_code_line(exc) or str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dlperf: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the user's model, loss or data raised: one line naming the call; else a bug
        line = user_code_line(exc)
        if line is None:
            raise
        print(f"dlperf {args.verb}: error: {one_line(line)}", file=sys.stderr)
        return 2


_STOPPING = (signal.SIGTERM, signal.SIGHUP)


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`~dlperf.errors.Terminated` in the main thread while a verb runs: it
    unwinds as Ctrl-C does, so the processes and temporary directories the verb made are removed (without a
    handler, the default action ends the process at once). The previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        raise Terminated(signum)

    previous = {}
    for sig in _STOPPING:
        try:
            previous[sig] = signal.signal(sig, stop)
        except (OSError, ValueError):  # pragma: no cover - a platform without the signal
            continue
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
