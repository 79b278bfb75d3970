"""The reference backend: call the original module, Python and all."""

from __future__ import annotations

from ..capture import Captured
from .registry import Backend, Runner, register_backend


def _prepare(captured: Captured, example_args: tuple) -> Runner:
    return captured.module


EAGER = register_backend(Backend(
    name="eager", prepare=_prepare, supports_grad=True, devices=("cpu", "cuda"), runs_python=True, in_auto=True,
    description="the module's own forward (the baseline every other backend is checked against)"))
