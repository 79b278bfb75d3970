"""Warnings located at the user's line, not at dlperf's.

A capture warning is about the user's code; ``warnings.warn(stacklevel=...)`` counts frames from the call
site inside dlperf, which changes with every refactoring and with the path a call takes (``__call__``, the
engine, a training step). This walks the stack to the first frame outside dlperf and torch instead.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _is_library(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE_DIR + os.sep) or path.startswith(_TORCH_DIR + os.sep)


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` with the first frame outside dlperf and torch as the warning's location."""
    frame = sys._getframe(1)
    while frame is not None and _is_library(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:  # called from dlperf itself (its tests, its benchmarks run as -m): no user frame
        warnings.warn(message, category, stacklevel=2)
        return
    module_globals = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=module_globals.get("__name__", "<unknown>"),
                           registry=module_globals.setdefault("__warningregistry__", {}),
                           module_globals=module_globals)
