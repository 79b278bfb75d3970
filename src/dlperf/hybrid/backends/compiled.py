"""torch.compile (TorchInductor) on the captured graph.

Not tried by ``auto``: compiling takes tens of seconds on a small CPU, which a first call should
not pay silently. Ask for it by name: ``hybridize(net, backend="compile")``.
"""

from __future__ import annotations

import torch

from ..capture import Captured
from .registry import Backend, BackendUnsupported, Runner, register_backend


def _prepare(captured: Captured, example_args: tuple) -> Runner:
    if not hasattr(torch, "compile"):
        raise BackendUnsupported("this PyTorch has no torch.compile")
    # dynamic=False: every signature gets its own specialization, matching hybridize's cache.
    return torch.compile(captured.graph_module, dynamic=False)


COMPILE = register_backend(Backend(
    name="compile", prepare=_prepare, supports_grad=True, devices=("cpu", "cuda"), runs_python=True, in_auto=False,
    description="torch.compile with the inductor backend (long first call)"))
