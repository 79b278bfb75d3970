"""Validated option types for every ``dlperf`` verb: one place decides what a good number, list or path is.

Each factory returns an argparse ``type=`` callable. A bad value raises ``argparse.ArgumentTypeError``
whose message names the value (as ``repr``, so a control character cannot break the line), what was
expected and how to fix it; argparse prefixes the option and turns it into one line on stderr and
exit status 2, before any model is built or file is read. Work that could not fit in memory is refused
by the library's configs (:mod:`dlperf._cliargs`), which the verbs build from these values.

>>> int_in(1, 8, "--threads")("4")
4
>>> positive_float("--lr", max_value=10)("0.5")
0.5
>>> csv_list("--networks")("lenet, mlp")
['lenet', 'mlp']
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from .._cliargs import one_line
from ..errors import UsageError, unknown_choice

__all__ = ["FLAGS", "flag_words", "loss_value", "LOSS_HELP", "int_in", "fraction", "positive_float", "csv_list",
           "int_list", "device_list", "choice", "existing_file", "existing_dir", "output_path", "warn", "one_line",
           "SEED_MAX", "MAX_DEVICE_INDEX"]

SEED_MAX = 2**32 - 1
"""Largest accepted ``--seed``: derived seeds (seed * k + epoch) must stay inside torch's 64-bit range."""
MAX_DEVICE_INDEX = 1023
"""Largest device index a list may name (GPUs beyond the visible ones are refused later, by name)."""
_MAX_TEXT = 4096  # longer paths are refused: no file system takes them
_PATH_SHOWN = 400
_INTEGER = re.compile(r"[+-]?[0-9]+")


def _show(value: str, limit: int = 60) -> str:
    shown = repr(value if len(value) <= limit else value[:limit - 3] + "...")
    return one_line(shown)


def _fail(message: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(one_line(message))


def _parse_int(text: str, name: str, lo: int, hi: int) -> int:
    stripped = text.strip()
    if len(stripped) > 40 or not _INTEGER.fullmatch(stripped):
        raise _fail(f"{_show(text)} is not an integer; give {name} a whole number from {lo} to {hi}")
    value = int(stripped)
    if not lo <= value <= hi:
        raise _fail(f"{_show(text)} is out of range; give {name} a whole number from {lo} to {hi}")
    return value


def int_in(lo: int, hi: int, name: str) -> Callable[[str], int]:
    """An integer in ``[lo, hi]``; no fractions, exponents or 5000-digit numbers."""

    def parse(text: str) -> int:
        return _parse_int(text, name, lo, hi)

    parse.__name__ = f"integer from {lo} to {hi}"
    return parse


def positive_float(name: str, *, max_value: float = math.inf, finite: bool = True,
                   min_value: float = 0.0) -> Callable[[str], float]:
    """A float ``> 0`` (``>= min_value`` when that is given) and ``<= max_value``; NaN and, when ``finite``,
    infinity are refused."""

    def parse(text: str) -> float:
        try:
            if len(text) > 64:  # no float needs more digits; a 5000-digit "number" is a mistake
                raise ValueError(text)
            value = float(text)
        except ValueError:
            raise _fail(f"{_show(text)} is not a number; give {name} a positive number such as 0.1") from None
        if math.isnan(value) or (finite and math.isinf(value)):
            raise _fail(f"{_show(text)} is not a finite number; give {name} a positive number such as 0.1")
        if not 0 < value <= max_value or value < min_value:
            low = f">= {min_value:g}" if min_value > 0 else "> 0"
            raise _fail(f"{_show(text)} is out of range; give {name} a number {low} and <= {max_value:g}")
        return value

    parse.__name__ = "positive number"
    return parse


def fraction(name: str) -> Callable[[str], float]:
    """A number in ``[0, 1)`` (momentum, weight decay); NaN and infinity are refused."""

    def parse(text: str) -> float:
        try:
            value = float(text) if len(text) <= 64 else math.nan
        except ValueError:
            value = math.nan
        if not 0 <= value < 1:
            raise _fail(f"{_show(text)} is not a number from 0 to below 1; give {name} such a number, e.g. 0.9")
        return value

    parse.__name__ = "number from 0 to below 1"
    return parse


def csv_list(name: str, choices: Sequence[str] | None = None, what: str = "name",
             other: Callable[[str], str] | None = None) -> Callable[[str], list[str]]:
    """A comma-separated list: no empty entries, no duplicates, each one of ``choices`` (a ``what``) when given;
    with ``other``, an item holding a colon is checked by it instead (``module:factory``)."""

    def parse(text: str) -> list[str]:
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or any(not p for p in parts):
            raise _fail(f"{_show(text)} has an empty entry; give {name} comma-separated items with no "
                        f"empty ones, e.g. {','.join((choices or ['a', 'b'])[:2])}")
        for p in parts:
            if other is not None and ":" in p:
                other(p)
            elif choices is not None and p.lower() not in choices:
                raise _fail(str(unknown_choice(what, p, choices)))
        lowered = [p.lower() for p in parts]
        dup = next((p for i, p in enumerate(lowered) if p in lowered[:i]), None)
        if dup is not None:
            raise _fail(f"{_show(text)} lists {_show(dup)} twice; give {name} each item once")
        return parts if other is None else [other(p) if ":" in p else p for p in parts]

    parse.__name__ = "comma-separated list"
    return parse


def int_list(lo: int, hi: int, name: str) -> Callable[[str], list[int]]:
    """Comma-separated integers, each in ``[lo, hi]``, no empties or duplicates."""
    names = csv_list(name)

    def parse(text: str) -> list[int]:
        try:
            return [_parse_int(p, name, lo, hi) for p in names(text)]
        except argparse.ArgumentTypeError as exc:
            raise _fail(f"{exc}; expected comma-separated integers such as 1,2,4") from None

    parse.__name__ = "comma-separated integers"
    return parse


def device_list(name: str) -> Callable[[str], list]:
    """Comma-separated devices (``cpu:0,gpu(1)``), parsed, each once, indices up to MAX_DEVICE_INDEX."""
    names = csv_list(name)

    def parse(text: str) -> list:
        from ..devices import to_device

        devices = []
        for part in names(text):
            try:
                dev = to_device(part)
            except UsageError as exc:
                raise _fail(str(exc)) from None
            if dev.index > MAX_DEVICE_INDEX:
                raise _fail(f"device index in {_show(part)} is out of range; give {name} indices from 0 "
                            f"to {MAX_DEVICE_INDEX}")
            if dev in devices:
                raise _fail(f"{_show(text)} lists {dev} twice; give {name} each device once")
            devices.append(dev)
        return devices

    parse.__name__ = "device list"
    return parse


def choice(what: str, choices: Iterable[str]) -> Callable[[str], str]:
    """One of ``choices`` (case-insensitive), returned lower-case; a miss names the ``what`` and lists them."""
    valid = list(choices)

    def parse(text: str) -> str:
        if text.strip().lower() not in valid:
            raise _fail(str(unknown_choice(what, text, valid)))
        return text.strip().lower()

    parse.__name__ = "choice"
    return parse


def _path_text(text: str, name: str) -> Path:
    if not text or not text.strip():
        raise _fail(f"{_show(text)} is an empty path; give {name} a file name")
    if "\0" in text or len(text) > _MAX_TEXT:
        raise _fail(f"{_show(text)} is not a usable path (NUL byte or too long); give {name} a file name")
    return Path(text)


def _path_type(name: str, kind: str) -> Callable[[Callable[[str], str]], Callable[[str], str]]:
    """Decorate a path check: an OSError from looking at the path (name too long, no permission) is a
    usage error too."""

    def wrap(check: Callable[[str], str]) -> Callable[[str], str]:
        def parse(text: str) -> str:
            try:
                return check(text)
            except OSError as exc:
                raise _fail(f"{_show(text, _PATH_SHOWN)} cannot be used: {exc.strerror or exc}; give {name} "
                            "another path") from None

        parse.__name__ = kind
        return parse

    return wrap


def existing_file(name: str) -> Callable[[str], str]:
    """A path to an existing regular file (a directory, FIFO or device is refused by name)."""

    @_path_type(name, "existing file")
    def parse(text: str) -> str:
        path = _path_text(text, name)
        if path.is_dir():
            raise _fail(f"{_show(text, _PATH_SHOWN)} is a directory, not a file; give {name} a file's path")
        if not path.exists():
            raise _fail(f"{_show(text, _PATH_SHOWN)} does not exist; give {name} an existing file")
        if not path.is_file():
            raise _fail(f"{_show(text, _PATH_SHOWN)} is not a regular file; give {name} a file's path")
        return text

    return parse


def existing_dir(name: str) -> Callable[[str], str]:
    """A path that, if it exists, is a directory (whether it must exist is the caller's call)."""

    @_path_type(name, "directory")
    def parse(text: str) -> str:
        path = _path_text(text, name)
        if path.exists() and not path.is_dir():
            raise _fail(f"{_show(text, _PATH_SHOWN)} is a file, not a directory; give {name} a directory")
        _check_parents(path, name, text)
        return text

    return parse


def _check_parents(path: Path, name: str, text: str) -> None:
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise _fail(f"cannot write {name} {_show(text, _PATH_SHOWN)}: {parent} is a file, not a directory; "
                            f"give {name} a path in a directory")
            return


def output_path(name: str, *, allow_stdout: bool = False, in_place: bool = False) -> Callable[[str], str]:
    """A file to write: not a directory, and no parent of it is a file (``-`` is stdout when allowed).

    With ``in_place``, ``/dev/stdout``, ``/dev/stderr``, a character device or a FIFO is accepted too
    and later written in place (:func:`dlperf._io.atomic_open`); a block device or socket never is.
    Without it (a file that is read back, such as a checkpoint) only a regular file will do.
    """

    @_path_type(name, "output file")
    def parse(text: str) -> str:
        from .._io import FileAccessError, output_stream, refuse_output_kind

        if allow_stdout and text == "-":
            return text
        path = _path_text(text, name)
        if output_stream(text) is not None:
            if in_place:
                return text
            raise _fail(f"{_show(text, _PATH_SHOWN)} is this process's stdout or stderr; give {name} a file of its "
                        "own")
        if text.endswith(os.sep) or path.is_dir():
            raise _fail(f"{_show(text, _PATH_SHOWN)} is a directory; give {name} a file name inside it")
        _check_parents(path, name, text)
        if path.exists():
            try:
                refuse_output_kind(text, path.stat())
            except FileAccessError as exc:
                raise _fail(f"{_show(text, _PATH_SHOWN)}: {exc.strerror}; give {name} a file name") from None
            if not in_place and not path.is_file():
                raise _fail(f"{_show(text, _PATH_SHOWN)} is not a regular file; give {name} a file name")
        return text

    return parse


FLAGS: dict[str, str] = {
    "model": "--model", "data": "--data", "devices": "--devices", "batch_size": "--batch-size", "epochs": "--epochs",
    "seed": "--seed", "train_size": "--train-size", "test_size": "--test-size", "download": "--download",
    "checkpoint": "--checkpoint", "resume": "--resume",
    "resume_hparams_from_checkpoint": "--resume-hparams-from-checkpoint", "lr": "--lr", "loss": "--loss",
    "algorithm": "--algorithm", "kvstore": "--kvstore", "strategy": "--strategy", "bucket_bytes": "--bucket-bytes",
    "check_finite": "--check-finite", "trace": "--trace", "plan": "--plan", "nproc_per_node": "--nproc-per-node",
    "threads": "--threads", "steps": "--steps", "warmup": "--warmup", "optimizer": "--optimizer",
    "momentum": "--momentum", "weight_decay": "--weight-decay", "lr_schedule": "--lr-schedule",
    "accumulate": "--accumulate", "clip_grad_norm": "--clip-grad-norm", "num_servers": "--num-servers",
    "inputs": "--input", "networks": "--networks", "plot": "--plot", "batch": "--batch", "weights": "--weights",
    "hardware": "--hardware", "master_port": "--master", "nnodes": "--nnodes", "replan": "--replan",
}
"""The library's parameters -> the flags that set them: every verb's error lines say the flag (:func:`flag_words`)."""

_PARAMETER = re.compile(r"\b([a-z_]+)=('[^']*'|\"[^\"]*\"|[^\s,;:()]*)")


def flag_words(message: str) -> str:
    """A library error line in the CLI's words: ``batch_size=1`` -> ``--batch-size 1`` (:data:`FLAGS`).

    >>> flag_words("batch_size=1 is smaller than the 2 devices; give batch_size=2 or more, or loss='mse'")
    '--batch-size 1 is smaller than the 2 devices; give --batch-size 2 or more, or --loss mse'
    """
    def swap(m: re.Match) -> str:
        flag = FLAGS.get(m.group(1))
        if flag is None:
            return m.group(0)
        value = m.group(2).strip("'\"")
        if value in ("None", "0") and m.group(1) in ("kvstore", "data", "num_servers"):
            return f"no {flag}"  # the parameter's default: the flag left out
        return flag if value in ("True", "", "...") else f"{flag} {value}"

    return _PARAMETER.sub(swap, message)


LOSS_HELP = ("ce, mse, l1, smooth-l1, bce or pkg.module:fn(outputs, targets); default: the model's own "
             "(outputs['loss']), else cross-entropy where the outputs are class scores")


def loss_value(text: str) -> object:
    """A ``--loss``: a name from :data:`dlperf.losses.LOSSES`, or ``pkg.module:fn`` (imported now: it is the user's)."""
    from ..losses import LOSSES

    if ":" in text and not text.startswith(("/", ".", "~")):
        from ..probe.targets import load_factory

        try:
            return load_factory(text)
        except UsageError as exc:
            raise _fail(str(exc)) from None
    if text.lower() in LOSSES:
        return text.lower()
    raise _fail(f"{_show(text)} is not a loss; give --loss one of {', '.join(LOSSES.names())} or MODULE:FN, e.g. mse "
                "or mylosses:weighted")


def warn(verb: str, message: str) -> None:
    """One warning line on stderr; the run goes on."""
    print(f"dlperf {verb}: warning: {one_line(message)}", file=sys.stderr)
