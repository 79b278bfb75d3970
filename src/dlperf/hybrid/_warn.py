"""Warnings located at the user's line, not at dlperf's.

A capture warning is about the user's code; ``warnings.warn(stacklevel=...)`` counts frames from the call
site inside dlperf, which changes with every refactoring and with the path a call takes (``__call__``, the
engine, a training step). This walks the stack to the first frame outside dlperf and torch instead.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

import torch

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _is_library(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE_DIR + os.sep) or path.startswith(_TORCH_DIR + os.sep)


_LOCATION = re.compile(r"^(?P<file>.+?):(?P<line>\d+): ")


def warn_at_caller(message: str, category: type[Warning], line: str | None = None) -> None:
    """``warnings.warn`` located at ``line`` (``"file:lineno: source"``, the user's offending line) when
    given, else at the first frame outside dlperf and torch (the user's call)."""
    match = _LOCATION.match(line) if line else None
    if match and not _is_library(match["file"]):
        warnings.warn_explicit(message, category, match["file"], int(match["line"]),
                               registry=_registry_of(match["file"]))
        return
    frame = sys._getframe(1)
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:  # called from dlperf itself (its tests, its benchmarks run as -m): no user frame
        warnings.warn(message, category, stacklevel=2)
        return
    module_globals = frame.f_globals
    filename = frame.f_code.co_filename
    where = dict(module=module_globals.get("__name__", "<unknown>"),
                 registry=module_globals.setdefault("__warningregistry__", {}))
    if filename.startswith("<"):  # <stdin>, <string>: no source a loader could give, and asking it can raise
        warnings.warn_explicit(message, category, filename, frame.f_lineno, **where)
        return
    try:
        # module_globals lets the warning show the line of a module loaded from a zip or by another loader
        warnings.warn_explicit(message, category, filename, frame.f_lineno, **where, module_globals=module_globals)
    except ImportError:  # that loader refused to give the source: the warning goes without its line
        warnings.warn_explicit(message, category, filename, frame.f_lineno, **where)


_REGISTRIES: dict[str, dict] = {}


def _registry_of(filename: str) -> dict:
    # One "already warned" registry per file, as warnings.warn keeps one per module: a warning at a
    # forward's line is shown once under the default filter, however many modules fall back there.
    return _REGISTRIES.setdefault(filename, {})
