"""The compiled parts of dlperf in tests: a build failure fails where a compiler exists, and skips only where none does.

A skip on any build error would let a broken C or C++ source pass as "no toolchain"; these helpers
skip only when the compiler (and, for torch's extensions, ninja) is missing from PATH.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def c_compiler() -> str | None:
    """The C compiler the probe's kernels use, or None."""
    from dlperf.probe.kernels import find_compiler

    return find_compiler()


def cxx_toolchain() -> str | None:
    """Why torch's C++ extensions cannot be built here (no c++, no ninja), or None when they can."""
    import os

    from torch.utils.cpp_extension import is_ninja_available

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx}) on PATH"
    if not is_ninja_available():
        return "no ninja on PATH"
    return None


def built_or_skip(build: Callable[[], T], missing: str | None) -> T:
    """``build()``; where the toolchain is ``missing`` (a reason) its failure skips, otherwise it fails."""
    try:
        return build()
    except Exception as exc:
        if missing is not None:
            pytest.skip(f"{missing}: {exc}")
        pytest.fail(f"the toolchain is here, yet dlperf's own source did not build: {type(exc).__name__}: {exc}")
