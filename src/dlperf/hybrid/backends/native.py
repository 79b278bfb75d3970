"""Replay in one C++ call: the captured graph compiled into a plan of fused instructions.

Without autograd, a call is one ``run_plan``. With autograd recording, the plan's forward is one
autograd node whose backward is the plan's backward instructions (:mod:`.native_train`), so training
through a hybridized module skips autograd's per-operator bookkeeping too.

The plan interpreter (:mod:`.native_src`) is compiled with the machine's C++ compiler on first
use (a line on stderr says so, and how long it took) and cached under the user's cache directory,
keyed by everything the build depends on: source, flags, PyTorch and its headers, the Python
environment, the compiler and the CPU flags (the code is built with ``-march=native``). Later
processes load it in milliseconds, after checking its SHA-256 against the manifest written at build
time (:mod:`dlperf._buildcache`). When no compiler works the backend still serves, replaying the graph
in Python under ``no_grad``; the runner's ``detail`` says which path is live.

Supported graphs: one tensor input, one tensor output, and linear layers, ReLU/sigmoid/tanh,
flatten, add and mul in between (as torch functions, or as the ATen operators a loaded export
names); anything else raises :class:`BackendUnsupported`, and ``auto``
moves on to the next backend.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import operator
import os
import platform
import sys
import sysconfig
import threading
import weakref

import torch
from torch import fx
from torch.nn import functional as F

from ... import _buildcache
from ..capture import Captured
from . import native_src as src
from .native_train_src import MODE_GRADS
from .registry import Backend, BackendUnsupported, Runner, register_backend

log = logging.getLogger("dlperf.hybrid")

_ACTS = {torch.relu: src.ACT_RELU, torch.relu_: src.ACT_RELU, F.relu: src.ACT_RELU,
         torch.sigmoid: src.ACT_SIGMOID, torch.tanh: src.ACT_TANH}
_BINARY = {operator.add: src.OP_ADD, torch.add: src.OP_ADD, operator.mul: src.OP_MUL, torch.mul: src.OP_MUL}
# A loaded export's graph names ATen operators; each of these is the very kernel its torch function calls.
_aten = torch.ops.aten
_ATEN_ALIASES: dict[object, object] = {
    _aten.linear.default: F.linear, _aten.relu.default: torch.relu, _aten.sigmoid.default: torch.sigmoid,
    _aten.tanh.default: torch.tanh, _aten.flatten.using_ints: torch.flatten, _aten.add.Tensor: torch.add,
    _aten.mul.Tensor: torch.mul}
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math",
          # Reassociation lets the dot products vectorize; results differ from BLAS in the last bits.
          "-fassociative-math", "-fno-signed-zeros"]

_CACHE_SUBDIRS = ("dlperf", "native")
# How long to wait for another process that is compiling the same interpreter before replaying
# in Python instead; None: $DLPERF_BUILD_WAIT_S, else 15 minutes (see dlperf._buildcache).
BUILD_WAIT_S: float | None = None

_lock = threading.Lock()
_extension: object | None = None
_extension_error: str | None = None


cache_base = _buildcache.build_cache_base


def cache_dir() -> str:
    """Where compiled plan interpreters live: <base>/dlperf/native, the base being $DLPERF_BUILD_CACHE,
    $XDG_CACHE_HOME or ~/.cache."""
    return os.path.join(cache_base(), *_CACHE_SUBDIRS)


def build_environment() -> dict[str, str]:
    """Everything the compiled library depends on; a change in any of it means a separate build."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")  # the one torch.utils.cpp_extension invokes
    return {
        "source": src.SOURCE, "functions": " ".join(src.FUNCTIONS), "flags": " ".join(_FLAGS),
        "torch": torch.__version__, "torch_dir": os.path.dirname(torch.__file__),
        "torch_include": os.pathsep.join(cpp_extension.include_paths()),
        "cxx11_abi": str(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", "")),
        "python": sys.version, "executable": sys.executable, "prefix": sys.prefix, "base_prefix": sys.base_prefix,
        "python_include": sysconfig.get_paths()["include"], "soabi": str(sysconfig.get_config_var("SOABI")),
        "machine": platform.machine(), "cpu_flags": _cpu_flags(), "compiler": _compiler_identity(compiler),
    }


def build_key(environment: dict[str, str] | None = None) -> str:
    env = build_environment() if environment is None else environment
    return hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return platform.processor()


# The compiler's identity is part of every cache key; one definition, shared with the probe's kernels.
_compiler_identity = _buildcache.compiler_identity


def load_extension():
    """The compiled plan interpreter (compiling it on first use), or raise RuntimeError."""
    global _extension, _extension_error
    with _lock:
        if _extension is not None:
            return _extension
        if _extension_error is not None:
            raise RuntimeError(_extension_error)
        try:
            key = build_key()
            name = f"dlperf_plan_{key}"
            _extension = _buildcache.load_or_build(
                base=cache_base(), subdirs=[*_CACHE_SUBDIRS, key], filename=f"{name}.so",
                what="the native plan interpreter", expected_time="about a minute",
                build=functools.partial(_compile, name), load=functools.partial(_import, name),
                wait_s=BUILD_WAIT_S)
        except Exception as exc:  # a missing compiler, headers or ninja all land here
            _extension_error = f"cannot build the native plan interpreter: {type(exc).__name__}: {exc}"
            raise RuntimeError(_extension_error) from exc
        return _extension


def _compile(name: str, workdir: str):
    from torch.utils.cpp_extension import load_inline

    # workdir is new and private: load_inline imports whatever library its build directory holds,
    # and here that can only be the one it has just compiled.
    module = load_inline(name, cpp_sources=[src.SOURCE], functions=src.FUNCTIONS, build_directory=workdir,
                         extra_cflags=_FLAGS, verbose=False)
    return module.__file__, module


def _import(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_code(gm: fx.GraphModule) -> tuple[list[int], list[torch.Tensor], int, int]:
    """Translate a lowered graph into plan code: (code, params, num_slots, output_slot)."""
    slots: dict[fx.Node, int] = {}
    params: list[torch.Tensor] = []
    param_index: dict[fx.Node, int] = {}
    code: list[int] = []
    fused: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if slots:
                raise BackendUnsupported("the native plan takes exactly one input tensor")
            slots[node] = 0
        elif node.op == "get_attr":
            param_index[node] = len(params)
            # The Parameter itself, not a detached alias: an in-place optimizer step or a
            # `param.data = ...` swap stays visible to the plan (it runs under NoGradGuard).
            params.append(_fetch(gm, node.target))
        elif node.op == "call_function":
            if node in fused:
                continue
            slots[node] = len(slots)
            code += _instruction(node, slots, param_index, fused)
        elif node.op == "output":
            out = node.args[0]
            if not isinstance(out, fx.Node) or out not in slots:
                raise BackendUnsupported("the native plan returns exactly one tensor")
            return code, params, len(slots), slots[out]
        else:
            raise BackendUnsupported(f"{node.op} {node.target} is not supported by the native plan")
    raise BackendUnsupported("graph has no output")


def _fetch(gm: fx.GraphModule, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, torch.Tensor):
        raise BackendUnsupported(f"attribute {target} is not a tensor")
    return obj


def _instruction(node: fx.Node, slots, param_index, fused: set) -> list[int]:
    fn, args = _ATEN_ALIASES.get(node.target, node.target), node.args
    out = slots[node]
    if node.kwargs:
        raise BackendUnsupported(f"{getattr(fn, '__name__', fn)} with keyword arguments")
    if fn is F.linear:
        x, w, b = (list(args) + [None])[:3]
        if x not in slots or w not in param_index or (b is not None and b not in param_index):
            raise BackendUnsupported("linear on a computed weight")
        act = src.ACT_NONE
        users = list(node.users)
        # Fuse an activation that is this linear's only consumer into the kernel's epilogue.
        user_fn = _ATEN_ALIASES.get(users[0].target, users[0].target) if len(users) == 1 else None
        if user_fn in _ACTS and users[0].op == "call_function":
            act = _ACTS[user_fn]
            fused.add(users[0])
            slots[users[0]] = out
        return [src.OP_LINEAR, slots[x], out, param_index[w], param_index[b] if b is not None else -1, act]
    if fn in _ACTS and len(args) == 1 and args[0] in slots:
        return [src.OP_ACT, slots[args[0]], out, 0, 0, _ACTS[fn]]
    if fn is torch.flatten and args[0] in slots and all(isinstance(a, int) for a in args[1:]):
        start = args[1] if len(args) > 1 else 0
        end = args[2] if len(args) > 2 else -1
        return [src.OP_FLATTEN, slots[args[0]], out, start, end, 0]
    if fn in _BINARY and len(args) == 2 and all(a in slots for a in args):
        return [_BINARY[fn], slots[args[0]], out, slots[args[1]], 0, 0]
    raise BackendUnsupported(f"{getattr(fn, '__name__', fn)} is not supported by the native plan")


class NativePlan:
    """Owns one plan on the C++ side and frees it when collected."""

    def __init__(self, ext, code, params, num_slots, output_slot):
        self._free = ext.free_plan
        self.plan_id = ext.make_plan(code, params, num_slots, output_slot)
        self.params = params  # keeps the tensors alive for as long as the plan may read them

    def __del__(self):
        try:
            self._free(self.plan_id)
        except Exception:  # interpreter shutdown: the plan dies with the process anyway
            pass


class _NativeRun(functools.partial):
    """``run_plan(plan_id, x)`` as a C-level partial (no Python frame per call) that owns its plan."""

    plan: NativePlan
    detail: str


class _PythonReplay:
    """The graph replayed in Python under ``no_grad``: the backend's answer when nothing compiles."""

    def __init__(self, gm: fx.GraphModule, detail: str) -> None:
        self._gm = gm
        self.detail = detail

    def __call__(self, x):
        with torch.no_grad():
            return self._gm.forward(x)


def refuse_grad_mode_changes(captured: Captured) -> None:
    """Raise :class:`BackendUnsupported` when forward changes the autograd mode: the plan differentiates every
    instruction (its backward would train what ``no_grad`` froze) and hands back what the call's mode says."""
    lines = captured.grad_mode_changes()
    if lines:
        raise BackendUnsupported(f"forward changes the autograd mode (torch.no_grad, inference_mode or "
                                 f"set_grad_enabled) at {lines[0]}, which the plan cannot keep")


def _prepare(captured: Captured, example_args: tuple) -> Runner:
    if len(example_args) != 1:
        raise BackendUnsupported("the native plan takes exactly one input tensor")
    refuse_grad_mode_changes(captured)
    code, params, num_slots, output_slot = build_code(captured.graph_module)
    try:
        ext = load_extension()
    except RuntimeError as exc:
        if torch.is_grad_enabled():
            raise BackendUnsupported(str(exc)) from None
        return _PythonReplay(captured.graph_module, f"Python graph replay under no_grad ({exc})")
    if torch.is_grad_enabled():  # training through the hybridized module: forward and backward in the plan
        return autograd_runner(ext, code, params, num_slots, output_slot, example_args)
    plan = NativePlan(ext, code, params, num_slots, output_slot)
    run = _NativeRun(ext.run_plan, plan.plan_id)
    run.plan = plan
    run.detail = f"C++ plan of {len(code) // 6} fused instructions"
    return run


class _PlanFunction(torch.autograd.Function):
    """A hybridized module's forward and backward as two calls into one training plan."""

    @staticmethod
    def forward(ctx, runner: NativeAutogradRunner, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        out, ctx.generation = runner.forward(x)
        ctx.runner = runner
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        return (None, None, *ctx.runner.backward(x, ctx.generation, grad_out))


class NativeAutogradRunner:
    """``run(x)`` with autograd recording: the plan's forward, and its backward instructions as the backward.

    The plan keeps one set of activations; a backward whose forward has been overwritten by a later call
    (two forwards, then two backwards) recomputes its forward from the saved input first.
    """

    def __init__(self, ext, code, params, num_slots, out_slot):
        self.plan_id = ext.make_train_plan(code, params, num_slots, out_slot)
        weakref.finalize(self, ext.free_train_plan, self.plan_id)
        self._forward, self._backward = ext.train_forward, ext.train_backward
        self.params = params
        self.generation = 0
        self.detail = f"C++ plan of {len(code) // 6} instructions, forward and backward (autograd sees one node)"

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        self.generation += 1
        # A copy: the plan's buffers are reused by the next call, the caller keeps this output.
        return self._forward(self.plan_id, x).clone(), self.generation

    def backward(self, x: torch.Tensor, generation: int, grad_out: torch.Tensor) -> list[torch.Tensor]:
        if generation != self.generation:
            self._forward(self.plan_id, x)
        grads = [torch.empty_like(p) for p in self.params]
        self._backward(self.plan_id, grad_out.contiguous(), grads, [], [], MODE_GRADS)
        self.generation += 1  # the backward released the input: a second backward recomputes
        return grads

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _PlanFunction.apply(self, x, *self.params)


def autograd_runner(ext, code, params, num_slots, out_slot, example_args: tuple) -> NativeAutogradRunner:
    """The native backend's runner for calls that record autograd (training through a hybridized module)."""
    (x,) = example_args
    if x.requires_grad:
        raise BackendUnsupported("the native plan computes no gradient for the input")
    if not all(p.requires_grad for p in params):
        raise BackendUnsupported("the native plan differentiates every weight; some are frozen")
    if not all(p.dtype == torch.float32 and p.is_contiguous() for p in params):
        raise BackendUnsupported("the native plan differentiates contiguous float32 weights only")
    return NativeAutogradRunner(ext, code, params, num_slots, out_slot)


NATIVE = register_backend(Backend(
    name="native", prepare=_prepare, supports_grad=True, devices=("cpu",), in_auto=True,
    description="fused C++ plan replayed in one call (with autograd: its backward instructions as one "
                "autograd node; Python fallback without a compiler)"))
