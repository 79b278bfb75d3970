"""Ways to replay a captured training step: the joint graph, the native plan, one CUDA graph.

Each ``prepare`` returns ``step(x, y) -> loss`` or raises :class:`~.backends.BackendUnsupported`; the
caller (:class:`~.train_step.TrainStep`) checks nothing itself, so every runner here is tested against
the eager step in tests/test_hybrid_train.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten

from .backends.registry import BackendUnsupported
from .optim_update import OptimizerUpdate
from .train_graph import JointGraph

StepRunner = Callable[[object, object], torch.Tensor]


def prepare_runner(name: str, joint: JointGraph, update: OptimizerUpdate | None, x, y, *,
                   keep_grads: bool) -> tuple[StepRunner | None, str | None]:
    """A runner for backend ``name``, or ``(None, why not)``."""
    assert update is not None
    prepare = {"graph": graph_runner, "native": _native, "cuda_graphs": cuda_graph_runner,
               "compile": compiled_runner}[name]
    try:
        return prepare(joint, update, x, y, keep_grads), None
    except BackendUnsupported as exc:
        return None, str(exc)
    except Exception as exc:  # a backend bug must not take the user's training down
        return None, f"failed: {type(exc).__name__}: {exc}"


def _native(joint, update, x, y, keep_grads):
    from .backends.native_train import native_runner

    return native_runner(joint, update, x, y, keep_grads)


def graph_runner(joint: JointGraph, update: OptimizerUpdate, x, y, keep_grads: bool) -> StepRunner:
    """The joint graph replayed under ``no_grad``, then the functional update."""
    forward = joint.graph_module.forward
    weights = [*joint.params, *joint.buffers]
    no_grad = torch.no_grad

    def step(x, y) -> torch.Tensor:
        leaves = [t for t in tree_flatten((x, y))[0] if isinstance(t, torch.Tensor)]
        with no_grad():
            loss, *grads = forward(*weights, *leaves)
            if keep_grads:
                keep(update, grads)
            update(grads)
        return loss

    step.detail = "joint forward+backward graph, no autograd"  # type: ignore[attr-defined]
    return step


def keep(update: OptimizerUpdate, grads: list[torch.Tensor]) -> None:
    """Each gradient in its parameter's ``.grad``, and None where there is none, as eager's step leaves them."""
    for p, g in zip(update.params, grads):
        p.grad = g
    for p in update.without:
        p.grad = None


def compiled_runner(joint: JointGraph, update: OptimizerUpdate, x, y, keep_grads: bool) -> StepRunner:
    """The joint graph compiled by ``torch.compile`` (TorchInductor), then the functional update.

    Compiling takes tens of seconds on a small CPU, paid in the first step; ``auto`` never tries it.
    """
    if not hasattr(torch, "compile"):
        raise BackendUnsupported("this PyTorch has no torch.compile")
    compiled = torch.compile(joint.graph_module, dynamic=False)
    step = graph_runner(JointGraph(joint.module, joint.loss_fn, compiled, joint.params, joint.buffers,  # type: ignore[arg-type]
                                   joint.input_spec, joint.output), update, x, y, keep_grads)
    step.detail = "joint graph compiled by torch.compile (inductor)"  # type: ignore[attr-defined]
    return step


def cuda_graph_runner(joint: JointGraph, update: OptimizerUpdate, x, y, keep_grads: bool) -> StepRunner:
    """Forward, backward and update recorded as one CUDA graph and replayed with one launch.

    The recorded step reads the batch from static buffers (copied in on each call) and the learning rate
    and other hyperparameters as the values at recording: a change of ``param_groups`` re-records. Adam's
    step counter must live on the GPU for this (``capturable=True``); otherwise the step is refused.
    """
    if not torch.cuda.is_available():
        raise BackendUnsupported("no CUDA device")
    leaves = [t for t in tree_flatten((x, y))[0] if isinstance(t, torch.Tensor)]
    if not leaves or not all(t.is_cuda for t in leaves) or not all(p.is_cuda for p in joint.params):
        raise BackendUnsupported("the model and batch are not on a CUDA device")
    if update.kind == "generic":
        raise BackendUnsupported(f"{type(update.optimizer).__name__}.step() cannot be recorded in a CUDA graph")
    if update.kind == "adam" and not all(g.get("capturable") for g in update.optimizer.param_groups):
        raise BackendUnsupported("Adam's step counter is on the CPU; create it with capturable=True")
    return _CudaGraphStep(joint, update, leaves, keep_grads)


class _CudaGraphStep:
    """A step recorded as a CUDA graph, re-recorded when the hyperparameters change."""

    WARMUP_STEPS = 3  # cuBLAS/cuDNN choose algorithms and allocate workspaces before recording

    def __init__(self, joint: JointGraph, update: OptimizerUpdate, leaves: list[torch.Tensor], keep_grads: bool):
        self.joint, self.update, self.keep_grads = joint, update, keep_grads
        self.static = [t.detach().clone() for t in leaves]
        self.detail = "forward, backward and update replayed as one CUDA graph"
        self._graph: torch.cuda.CUDAGraph | None = None
        self._hyper: tuple = ()
        self._stepped = False
        self.outputs: list[torch.Tensor] = []

    def reset(self) -> None:
        """Forget the recorded steps: trial steps were undone, and the next step is the first again."""
        self._graph, self._hyper, self._stepped, self.outputs = None, (), False, []

    def _hyperparameters(self) -> tuple:
        return tuple(tuple((k, v) for k, v in g.items() if k != "params") for g in self.update.optimizer.param_groups)

    def _run(self) -> list[torch.Tensor]:
        with torch.no_grad():
            loss, *grads = self.joint.graph_module.forward(*self.joint.params, *self.joint.buffers, *self.static)
            self.update(grads)
        return [loss, *grads]

    def _record(self) -> None:
        # Warm-up on a side stream, as recording requires. Those steps update weights for real, so
        # they are undone: what the caller sees is exactly the steps it asked for.
        saved = [t.detach().clone() for t in [*self.joint.params, *self.joint.buffers]]
        saved_opt = _optimizer_tensors(self.update.optimizer)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP_STEPS):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.outputs = self._run()
        with torch.no_grad():
            for live, old in zip([*self.joint.params, *self.joint.buffers], saved):
                live.copy_(old)
            for live, old in zip(_optimizer_tensors(self.update.optimizer), saved_opt):
                live.copy_(old)
        self._graph, self._hyper = graph, self._hyperparameters()

    def __call__(self, x, y) -> torch.Tensor:
        leaves = [t for t in tree_flatten((x, y))[0] if isinstance(t, torch.Tensor)]
        for buf, t in zip(self.static, leaves):
            buf.copy_(t, non_blocking=True)
        if not self._stepped:
            # The first step creates the optimizer's state (a momentum buffer starts as a copy of the
            # gradient), a different program from every later step: run it unrecorded.
            self._stepped = True
            outputs = self._run()
        else:
            if self._graph is None or self._hyperparameters() != self._hyper:
                self._record()
            assert self._graph is not None
            self._graph.replay()
            outputs = self.outputs
        if self.keep_grads:
            keep(self.update, [g.clone() for g in outputs[1:]])
        return outputs[0].clone()


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
