"""CUDA graphs: record the kernel launches of one call, then replay them with a single launch.

On a GPU a small network is bound by kernel-launch latency (5-10 us per launch from Python), not
by arithmetic; a graph replay launches everything at once. Inputs are copied into the static
buffers the graph was recorded with, and outputs (any structure of tensors) are copied out so the
caller never holds memory that the next replay overwrites; an input the forward modifies in place
is copied back, so the caller sees the change as in eager. Training uses ``torch.cuda.make_graphed_callables``, which
records the backward pass too.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..capture import Captured
from .registry import Backend, BackendUnsupported, Runner, register_backend

WARMUP_CALLS = 3  # lets cuDNN/cuBLAS pick algorithms and allocate workspaces before recording


def _prepare(captured: Captured, example_args: tuple) -> Runner:
    if not torch.cuda.is_available():
        raise BackendUnsupported("no CUDA device")
    if not all(isinstance(a, torch.Tensor) and a.is_cuda for a in example_args):
        raise BackendUnsupported("inputs are not on a CUDA device")
    gm = captured.graph_module
    if torch.is_grad_enabled():
        return torch.cuda.make_graphed_callables(gm, tuple(example_args), num_warmup_iters=WARMUP_CALLS)
    return _inference_runner(gm, example_args)


def _inference_runner(gm, example_args: tuple) -> Runner:
    static_in = [a.detach().clone() for a in example_args]
    versions = [t._version for t in static_in]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # Warm up on a side stream, as graph capture requires, so lazy initialization is not recorded.
    with torch.cuda.stream(side):
        for _ in range(WARMUP_CALLS):
            gm(*static_in)
    torch.cuda.current_stream().wait_stream(side)
    # Inputs the forward modifies in place: the replay changes the static copy, so copy it back.
    modified = [i for i, t in enumerate(static_in) if t._version != versions[i]]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = gm(*static_in)
    out_leaves, out_spec = tree_flatten(static_out)
    if not all(isinstance(t, torch.Tensor) for t in out_leaves):
        raise BackendUnsupported("cuda graphs replay only outputs made of tensors")

    def replay(*args):
        for buf, a in zip(static_in, args):
            buf.copy_(a, non_blocking=True)
        graph.replay()
        for i in modified:
            args[i].copy_(static_in[i], non_blocking=True)
        return tree_unflatten([t.clone() for t in out_leaves], out_spec)

    return replay


CUDA_GRAPHS = register_backend(Backend(
    name="cuda_graphs", prepare=_prepare, supports_grad=True, devices=("cuda",), in_auto=True,
    description="CUDA graph replay: one launch per call"))
