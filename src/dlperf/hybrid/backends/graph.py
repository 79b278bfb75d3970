"""Replay the captured fx graph: the same autograd ops as eager, without the module tree's Python.

Leaf layers are lowered to functional calls at capture, so a replay skips ``nn.Module.__call__``
(hooks, forward pre-processing) for each of them; gradients are those of eager because the very
same ATen operations run on the very same parameters.
"""

from __future__ import annotations

from ..capture import Captured
from .registry import Backend, Runner, register_backend


def _prepare(captured: Captured, example_args: tuple) -> Runner:
    # The bound generated forward, not the module: skips Module.__call__ on every replay.
    return captured.graph_module.forward


GRAPH = register_backend(Backend(
    name="graph", prepare=_prepare, supports_grad=True, devices=("cpu", "cuda"), in_auto=True,
    description="the captured torch.fx graph, leaf layers lowered to functional ops"))
