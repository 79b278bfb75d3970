"""The engine array: an :class:`Array`'s operations are pushed to the engine and return at once.

See :mod:`dlperf.engine.array` for what blocks and what does not; this module holds the class, the
path from an operation on arrays to one engine operation (:func:`apply`, and the inlined fast path
of ``x + 1``), and copies between devices.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

import numpy
import torch

from ..devices import Device, DeviceLike, require_available
from ..errors import DeviceMismatchError, ShapeError, UsageError
from .arguments import EngineArgumentError
from .engine import Engine
from .external import External, external, register_array_type
from .records import (
    rec_binary,
    rec_scalar,
    rec_unary,
    record_streams,
    run_binary,
    run_copy,
    run_copy_into,
    run_grad,
    storages,
    tag_result,
    unalias,
)
from .shapes import NO_KWARGS, RESHAPING_INPLACE, UNKNOWN, Inferable, infer
from .var import DONE as _DONE
from .var import Var

__all__ = ["Array", "apply", "copy_to", "as_in"]

_grad_enabled = torch.is_grad_enabled
_new = object.__new__
_NO_GRADS: frozenset = frozenset()


def _unwrap(x: Any) -> Any:
    t = type(x)
    if t is Array:
        return x._data
    if t is tuple or t is list:
        return t(_unwrap(v) for v in x)
    if t is dict:
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def _collect(x: Any, out: list[Array], tensors: list[torch.Tensor] | None = None) -> None:
    t = type(x)
    if t is Array:
        out.append(x)
    elif t is tuple or t is list:
        for v in x:
            _collect(v, out, tensors)
    elif t is dict:
        for v in x.values():
            _collect(v, out, tensors)
    elif tensors is not None and isinstance(x, torch.Tensor):
        tensors.append(x)



def _run_generic(func: Any, args: tuple, kwargs: dict, out: Array, inputs: list[Array], grad: bool) -> None:
    if out.device.is_gpu:
        record_streams(inputs)
    if grad:
        res = func(*_unwrap(args), **_unwrap(kwargs))
    else:
        with torch.no_grad():
            res = func(*_unwrap(args), **_unwrap(kwargs))
    out._data = tag_result(unalias(res, storages(inputs)), out.device)
    out._meta = None  # the value is there: drop the recipe (and its references to the inputs)



def _run_inplace(method: str, a: Array, args: tuple, kwargs: dict) -> None:
    getattr(a._data, method)(*_unwrap(args), **_unwrap(kwargs))


def _run_setitem(a: Array, key: Any, value: Any) -> None:
    a._data[_unwrap(key)] = _unwrap(value)



def _run_backward(loss: Array, gradient: Any, retain_graph: Any, create_graph: bool) -> None:
    loss._data.backward(_unwrap(gradient), retain_graph=retain_graph, create_graph=create_graph)



def _scalar_fast(func: Any, name: str) -> Callable[[Array, Any], Array]:
    """An operator method whose commonest case, ``x + 1``, collects into the open automatic batch
    without a further call: Engine._push_rec's common case, inlined (see
    ThreadedEngine._push_rec for the rules); everything else goes through ``Array._binary``."""

    def method(self: Array, other: Any) -> Array:
        t = type(other)
        if (t is not int and t is not float) or not _grad_enabled():
            return self._binary(func, other, name)
        eng = self.engine
        dev = self.device
        var = self._var
        batch = eng._local.auto
        if batch is not None and batch.device is dev and not batch.sealed and (
                (last := var._last_write) is None or last is batch.op or last.state == _DONE):
            op = batch.op
            # Var() and Array(eng, dev) inlined, the output already granted to the batch (saves
            # ~0.15 us an operation; tests/test_engine_autobulk.py checks every field is set).
            ov = _new(Var)
            ov.name = ov._queue = ov._bulk_write = ov.exc = ov._wev = ov._revs = None
            ov._readers = 0
            ov._writing = True
            ov._last_write = op
            out = _new(Array)
            out._data = out._leaf = None
            out._var = ov
            out.device = dev
            out.engine = eng
            out._grads = self._grads
            # The record doubles as the shape recipe (see infer): one allocation for both.
            out._meta = rec = (rec_scalar, func, self, other, out)
            batch.reads[var] = None
            batch.outs.append(ov)  # before the record: a sender takes as many outputs as records
            recs = batch.recs
            recs.append(rec)
            if batch.sealed or len(recs) >= eng._auto_size:
                eng._appended(batch, rec, var, None, name)
            return out
        out = Array(eng, dev)
        out._grads = self._grads
        out._meta = rec = (rec_scalar, func, self, other, out)
        eng._push_rec(rec, var, None, out._var, dev, name)
        return out

    method.__name__ = method.__qualname__ = f"__{name}__"
    return method


def _operator(route: Callable[[Array, Any, Any, str], Array], func: Any, label: str,
              dunder: str) -> Callable[[Array, Any], Array]:
    """The operator method ``dunder``: ``route`` (``Array._binary`` or ``_rbinary``) of ``func``."""

    def method(self: Array, other: Any) -> Array:
        return route(self, func, other, label)

    method.__name__ = method.__qualname__ = dunder
    return method


def _in_place(torch_method: str, dunder: str) -> Callable[[Array, Any], Array]:
    """The augmented assignment ``dunder`` (``x += y``): the tensor method ``torch_method`` as one write of ``x``."""

    def method(self: Array, other: Any) -> Array:
        return self._inplace(torch_method, other)

    method.__name__ = method.__qualname__ = dunder
    return method


class Array(Inferable):
    """An engine-managed array on one device; see the module docstring for what blocks.

    Construct with :func:`array`, :func:`ones`, :func:`random.normal` etc., not directly.
    """

    __slots__ = ("_data", "_var", "device", "engine", "_meta", "_grads", "_leaf")

    def __init__(self, engine: Engine, device: Device, data: Any = None) -> None:
        self._data = data
        self._var = Var()
        self.device = device
        self.engine = engine
        self._meta: Any = None  # a meta tensor, a (func, args, kwargs) recipe, UNKNOWN or None
        self._grads: frozenset[External] = _NO_GRADS  # gradients a backward() of this array writes
        self._leaf: External | None = None  # this array's own gradient, after attach_grad()

    # ------------------------------------------------------------------ pushing
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return apply(func, args, kwargs or {})

    def _binary(self, func: Any, other: Any, name: str) -> Array:
        t = type(other)
        if t is Array:
            if other.device is not self.device and other.device != self.device:
                _mismatch(name, self, other)
            if not _grad_enabled():
                return apply(func, (self, other), {}, name)
            out = Array(self.engine, self.device)
            out._grads = self._grads | other._grads if other._grads else self._grads
            out._meta = rec = (rec_binary, func, self, other, out)
            if func is torch.matmul:  # not a small operation: never collected into a batch
                out._meta = (func, (self, other), NO_KWARGS)
                self.engine._push(run_binary, (func, self, other, out), (self._var, other._var), (out._var,),
                                  self.device, 0, name)
            else:
                self.engine._push_rec(rec, self._var, other._var, out._var, self.device, name)
            return out
        # a scalar (int and float first: the hot path of small array arithmetic)
        if (t is not int and t is not float and isinstance(other, torch.Tensor)) or not _grad_enabled():
            return apply(func, (self, other), {}, name)
        out = Array(self.engine, self.device)
        out._grads = self._grads
        out._meta = rec = (rec_scalar, func, self, other, out)
        self.engine._push_rec(rec, self._var, None, out._var, self.device, name)
        return out

    def _rbinary(self, func: Any, other: Any, name: str) -> Array:
        return apply(func, (other, self), {}, name)

    def _unary(self, func: Any, name: str) -> Array:
        if not _grad_enabled():
            return apply(func, (self,), {}, name)
        out = Array(self.engine, self.device)
        out._grads = self._grads
        out._meta = rec = (rec_unary, func, self, out)
        self.engine._push_rec(rec, self._var, None, out._var, self.device, name)
        return out

    def _inplace(self, method: str, *args: Any, **kwargs: Any) -> Array:
        others: list[Array] = []
        _collect((args, kwargs), others)
        _check_devices(method, [self, *others])
        if method in RESHAPING_INPLACE:
            self._meta = UNKNOWN
        self.engine._push(_run_inplace, (method, self, args, kwargs), tuple(a._var for a in others),
                          (self._var,), self.device, 0, method)
        return self

    __add__ = _scalar_fast(torch.add, "add")

    __sub__ = _scalar_fast(torch.sub, "sub")

    __mul__ = _scalar_fast(torch.mul, "mul")

    __truediv__ = _scalar_fast(torch.true_divide, "div")

    __pow__ = _scalar_fast(torch.pow, "pow")

    __matmul__ = _operator(_binary, torch.matmul, "matmul", "__matmul__")
    __lt__ = _operator(_binary, torch.lt, "lt", "__lt__")
    __le__ = _operator(_binary, torch.le, "le", "__le__")
    __gt__ = _operator(_binary, torch.gt, "gt", "__gt__")
    __ge__ = _operator(_binary, torch.ge, "ge", "__ge__")
    __eq__ = _operator(_binary, torch.eq, "eq", "__eq__")  # type: ignore[assignment]  # elementwise, as torch's
    __ne__ = _operator(_binary, torch.ne, "ne", "__ne__")  # type: ignore[assignment]
    __hash__ = object.__hash__  # identity, as for torch tensors

    __radd__ = _operator(_rbinary, torch.add, "add", "__radd__")
    __rsub__ = _operator(_rbinary, torch.sub, "sub", "__rsub__")
    __rmul__ = _operator(_rbinary, torch.mul, "mul", "__rmul__")
    __rtruediv__ = _operator(_rbinary, torch.true_divide, "div", "__rtruediv__")
    __rpow__ = _operator(_rbinary, torch.pow, "pow", "__rpow__")
    __rmatmul__ = _operator(_rbinary, torch.matmul, "matmul", "__rmatmul__")

    def __neg__(self) -> Array:
        return self._unary(torch.neg, "neg")

    def __abs__(self) -> Array:
        return self._unary(torch.abs, "abs")

    __iadd__ = _in_place("add_", "__iadd__")
    __isub__ = _in_place("sub_", "__isub__")
    __imul__ = _in_place("mul_", "__imul__")
    __itruediv__ = _in_place("div_", "__itruediv__")

    def __getitem__(self, key: Any) -> Array:
        return apply(operator.getitem, (self, key), {}, "getitem")

    def __setitem__(self, key: Any, value: Any) -> None:
        others: list[Array] = []
        _collect((key, value), others)
        _check_devices("setitem", [self, *others])
        self.engine._push(_run_setitem, (self, key, value), tuple(a._var for a in others), (self._var,),
                          self.device, 0, "setitem")

    def dot(self, other: Any) -> Array:
        """Matrix (or vector) product, as ``numpy.dot`` for 1-D and 2-D operands."""
        return self._binary(torch.matmul, other, "dot")

    @property
    def T(self) -> Array:  # noqa: N802  (NumPy's name)
        """The array with its axes reversed (NumPy's ``.T``; a copy, see "No aliasing")."""
        return apply(_reverse_axes, (self,), {}, "T")

    def copyto(self, target: DeviceLike | Array) -> Array:
        """Copy into ``target``: a device (a new array there) or an array (overwritten, same shape).

        Either way the copy is an engine operation of its own and overlaps other work.
        """
        if isinstance(target, Array):
            return _copy_into(self, target)
        return copy_to(self, target)

    def as_in(self, device: DeviceLike) -> Array:
        """``self`` if already on ``device``, else a copy there."""
        return as_in(self, device)

    def as_in_ctx(self, ctx: DeviceLike) -> Array:
        """MXNet's name for :meth:`as_in`."""
        return as_in(self, ctx)

    @property
    def context(self) -> Device:
        """MXNet's name for :attr:`device`."""
        return self.device

    ctx = context

    # ------------------------------------------------------------------ autograd
    def attach_grad(self) -> Array:
        """Make this array a leaf whose gradient ``backward`` fills (MXNet's ``attach_grad``)."""
        if self._leaf is None:
            self._leaf = External()
        self._inplace("requires_grad_", True)
        self._grads = frozenset({self._leaf})
        return self

    def requires_grad_(self, requires_grad: bool = True) -> Array:
        """As ``torch.Tensor.requires_grad_``; see :meth:`attach_grad`."""
        if not requires_grad:
            self._grads = _NO_GRADS
            return self._inplace("requires_grad_", False)
        return self.attach_grad()

    @property
    def grad(self) -> Array | None:
        """The gradient of a leaf made with :meth:`attach_grad`, as a new array (zeros before any backward).

        ``None`` for an array that is not such a leaf (no ``attach_grad``, or computed from others), as in
        MXNet: a zero array there would hide the missing ``attach_grad``.
        """
        if self._leaf is None:
            return None
        out = Array(self.engine, self.device)
        out._meta = (torch.zeros_like, (self,), {})
        self.engine._push(run_grad, (self, out), (self._var, self._leaf.grad), (out._var,), self.device, 0, "grad")
        return out

    def backward(self, gradient: Any = None, retain_graph: bool | None = None, create_graph: bool = False,
                 *, wait: bool = True) -> None:
        """Push the backward pass; it writes the gradient of every tensor this array depends on.

        By default this returns once the gradients are written (only this operation and what it
        depends on is waited for), so ``p.grad`` right after it holds the new value, as in eager
        PyTorch. ``wait=False`` returns at once; then read gradients only through what waits for
        them (a torch optimizer's ``step``, ``state_dict``, an engine operation, :func:`waitall`,
        :func:`dlperf.engine.external.wait_for`), never ``p.grad`` directly.
        """
        others: list[Array] = []
        _collect(gradient, others)
        _check_devices("backward", [self, *others])
        writes = tuple(e.grad for e in self._grads)
        op = self.engine._push(_run_backward, (self, gradient, retain_graph, create_graph),
                               (self._var, *(a._var for a in others)), writes, self.device, 0, "backward")
        if wait:
            try:
                op.wait()
            except BaseException:
                # Reported here: later operations on these gradients must not be skipped for it.
                for e in self._grads:
                    e.grad = Var("grad")
                raise

    def reshape(self, *shape: Any, **kwargs: Any) -> Array:
        """As ``torch.Tensor.reshape`` (a copy: see "No aliasing"); a shape that cannot hold this array's
        elements is a :class:`~dlperf.errors.ShapeError` here, when the shape is known without waiting."""
        self._check_reshape("reshape", shape or tuple(kwargs.values()))
        return apply(torch.Tensor.reshape, (self, *shape), kwargs, "reshape")

    def view(self, *shape: Any, **kwargs: Any) -> Array:
        """As ``torch.Tensor.view`` (a copy: see "No aliasing"), checked at the call like :meth:`reshape`."""
        self._check_reshape("view", shape or tuple(kwargs.values()))
        return apply(torch.Tensor.view, (self, *shape), kwargs, "view")

    def _check_reshape(self, call: str, shape: tuple) -> None:
        # MXNet infers shapes as an operation is pushed, so a reshape that cannot be fails where it is
        # written; the engine's worker would only fail it later, at a wait or at exit.
        known = self._shape_if_known()
        if known is None or (len(shape) == 1 and not isinstance(shape[0], (int, tuple, list, torch.Size))):
            return  # not known yet without waiting (or an odd argument torch itself judges on the worker)
        try:
            known.reshape(*shape)
        except (RuntimeError, TypeError) as exc:
            target = shape[0] if len(shape) == 1 else shape
            raise ShapeError(f"{call}: cannot give an array of shape {tuple(known.shape)} ({known.numel()} elements) "
                             f"the shape {tuple(target) if isinstance(target, (list, torch.Size)) else target} "
                             f"({str(exc).splitlines()[0]}); the new shape must hold as many elements") from None

    def _shape_if_known(self) -> torch.Tensor | None:
        """A tensor of this array's shape and dtype if known without waiting (its value, or inferred), else None."""
        meta = self._meta
        if meta is None:
            data = self._data
            return data if isinstance(data, torch.Tensor) else None
        if meta is UNKNOWN:
            return None
        if isinstance(meta, torch.Tensor):
            return meta
        inferred = infer(meta)
        if inferred is not None and self._meta is meta:
            self._meta = inferred
        return inferred

    def __getattr__(self, name: str) -> Any:
        # Any other torch.Tensor method becomes a pushed op: `b.sum()`, `x.relu()`, `w.zero_()`.
        if name.startswith("__") or not callable(getattr(torch.Tensor, name, None)):
            raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")
        if name.endswith("_") and not name.endswith("__"):
            return lambda *a, **k: self._inplace(name, *a, **k)
        method = getattr(torch.Tensor, name)
        return lambda *a, **k: apply(method, (self, *a), k, name)

    # ------------------------------------------------------------------ blocking
    def wait_to_read(self) -> Array:
        """Block until this array's value is computed (raises if computing it failed)."""
        self.engine.wait_to_read(self._var)
        return self

    def tensor(self) -> Any:
        """The computed value (a ``torch.Tensor`` for array results). Blocks."""
        self.engine.wait_to_read(self._var)
        return self._data

    def asnumpy(self) -> numpy.ndarray:
        """A NumPy copy of the value. Blocks (NumPy has no notion of pending values)."""
        return self.tensor().detach().cpu().numpy()

    def item(self) -> Any:
        """The value as a Python scalar. Blocks."""
        return self.tensor().item()

    def tolist(self) -> Any:
        """The value as nested Python lists. Blocks."""
        return self.tensor().tolist()

    def __array__(self, dtype: Any = None, copy: Any = None) -> numpy.ndarray:
        out = self.asnumpy()
        return out.astype(dtype) if dtype is not None else out

    # ------------------------------------------------------------------ inferred, not blocking
    def _described(self) -> Any:
        """A tensor with this array's shape and dtype: the value's, or one inferred on ``meta``."""
        meta = self._meta
        if meta is None or meta is UNKNOWN:
            data = self._data
            if meta is None and isinstance(data, torch.Tensor):
                return data  # computed (an in-place change of shape would have set UNKNOWN)
            return self.tensor()
        if isinstance(meta, torch.Tensor):
            return meta
        inferred = infer(meta)
        if inferred is None:
            self._meta = UNKNOWN if self._meta is meta else self._meta
            return self.tensor()
        if self._meta is meta:  # not overtaken by the worker, which clears it when the value exists
            self._meta = inferred
        return inferred

    @property
    def shape(self) -> torch.Size:
        """The shape; inferred without waiting for the value where PyTorch's meta device can."""
        return self._described().shape

    @property
    def dtype(self) -> torch.dtype:
        """The element type; inferred like :attr:`shape`."""
        return self._described().dtype

    @property
    def ndim(self) -> int:
        """Number of axes; inferred like :attr:`shape`."""
        return len(self.shape)

    def dim(self) -> int:
        """As ``torch.Tensor.dim``: inferred like :attr:`shape` (torch layers ask it of their input)."""
        return len(self.shape)

    ndimension = dim

    def size(self, dim: int | None = None) -> Any:
        """As ``torch.Tensor.size``: inferred like :attr:`shape`."""
        shape = self.shape
        return shape if dim is None else shape[dim]

    def numel(self) -> int:
        """Number of elements; inferred like :attr:`shape`."""
        return self._described().numel()

    def is_floating_point(self) -> bool:
        """Whether the dtype is a floating-point type; inferred like :attr:`dtype`."""
        return self.dtype.is_floating_point

    @property
    def requires_grad(self) -> bool:
        """Whether a ``backward`` of this array writes some gradient (known at push time)."""
        return bool(self._grads)

    def __len__(self) -> int:
        shape = self.shape
        if not shape:
            raise TypeError("len() of a 0-d array")
        return shape[0]

    def __iter__(self) -> Iterator[Array]:
        # A blocker: the rows are Python's to walk, so the value (and an error computing it) comes first.
        self.engine.wait_to_read(self._var)
        return (self[i] for i in range(len(self)))

    def __float__(self) -> float:
        return float(self.tensor())

    def __int__(self) -> int:
        return int(self.tensor())

    def __bool__(self) -> bool:
        return bool(self.tensor())

    def __repr__(self) -> str:
        body = repr(self.tensor())
        if body.startswith("tensor("):
            body = body[len("tensor("):-1]
        return f"array({body}, device={self.device})"

    __str__ = __repr__


register_array_type(Array)


def _reverse_axes(t: torch.Tensor) -> torch.Tensor:
    return t.permute(*reversed(range(t.dim())))



def _mismatch(op: str, a: Array, b: Array) -> None:
    raise DeviceMismatchError(
        f"{op} needs all operands on one device, but got {a.device} and {b.device}; "
        f"move one first, e.g. b = b.as_in({a.device})")


def _check_devices(op: str, arrays: list[Array]) -> None:
    first = arrays[0]
    for a in arrays[1:]:
        if a.device != first.device:
            _mismatch(op, first, a)
        if a.engine is not first.engine:
            raise UsageError(f"{op}: operands belong to different engines; copy one with array(x.tensor(), ...)")


def _writes_first(func: Any, args: tuple, kwargs: dict) -> bool:
    # torch's in-place convention: `Tensor.add_`, `torch.relu_`, `F.relu(..., inplace=True)`, out=.
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" or \
        bool(kwargs.get("inplace")) or "out" in kwargs


def apply(func: Any, args: tuple, kwargs: dict, name: str | None = None) -> Array:
    inputs: list[Array] = []
    tensors: list[torch.Tensor] = []
    _collect(args, inputs, tensors)
    _collect(kwargs, inputs, tensors)
    label: str = name if name else getattr(func, "__name__", "op")
    if not inputs:
        raise UsageError(f"{label} got no engine array")
    _check_devices(label, inputs)
    first = inputs[0]
    grad = _grad_enabled()
    out = Array(first.engine, first.device)
    reads = [a._var for a in inputs]
    writes = [out._var]
    if grad:
        out._grads = _NO_GRADS.union(*(a._grads for a in inputs)) if len(inputs) > 1 else first._grads
    if tensors:
        _track_tensors(first.engine, tensors, _writes_first(func, args, kwargs) and args, reads, writes, out, grad)
    out._meta = (func, args, kwargs)
    first.engine._push(_run_generic, (func, args, kwargs, out, inputs, grad), reads, writes,
                       first.device, 0, label)
    return out


def _track_tensors(engine: Engine, tensors: list[torch.Tensor], written: Any, reads: list, writes: list,
                   out: Array, grad: bool) -> None:
    """Declare plain tensors the operation uses (parameters, buffers), and the gradients they get."""
    target = written[0] if written else None
    leaves = []
    for t in tensors:
        ext = external(engine, t)
        (writes if t is target else reads).append(ext.value)
        if grad and t.requires_grad and t.is_leaf:
            leaves.append(ext)
    if leaves:
        out._grads = out._grads.union(leaves)



def copy_to(x: Array, device: DeviceLike) -> Array:
    """A new array on ``device``; a copy involving a GPU runs on that GPU's copy stream.

    >>> from dlperf.devices import cpu
    >>> from dlperf.engine.array import ones
    >>> y = copy_to(ones(2), cpu(1))
    >>> y.device, y.tolist()
    (cpu(1), [1.0, 1.0])
    """
    if not isinstance(x, Array):
        raise EngineArgumentError(f"copy_to: x is {type(x).__name__}; expected an engine array (array(x) makes one)")
    dev = require_available(device)
    out = Array(x.engine, dev)
    out._meta = (torch.clone, (x,), {})
    where = x.device if x.device.is_gpu else dev  # the GPU side drives the transfer
    x.engine._push(run_copy, (x, out), (x._var,), (out._var,), where, 0, "copy", "copy")
    return out


def _copy_into(x: Array, target: Array) -> Array:
    if target.engine is not x.engine:
        raise UsageError("copyto: the target array belongs to another engine; copy with array(x.tensor(), ...)")
    if target is x:
        return x
    where = x.device if x.device.is_gpu else target.device
    x.engine._push(run_copy_into, (x, target), (x._var,), (target._var,), where, 0, "copy", "copy")
    return target


def as_in(x: Array, device: DeviceLike) -> Array:
    """``x`` itself when it is on ``device`` already, else :func:`copy_to`."""
    dev = require_available(device)
    return x if x.device == dev else copy_to(x, dev)

