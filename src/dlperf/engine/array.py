"""An array whose operations are pushed to the engine and return at once (d2l's ``mxnet.np``).

Every operation on an :class:`Array` (operators, tensor methods, the functions of this module and
``torch.*`` functions through ``__torch_function__``) becomes one engine operation that reads its
input arrays and writes a new one, on the device of its inputs (small elementwise ones, such as
``x + 1``, may share one: see ``EngineConfig.auto_bulk``). The result is an :class:`Array`
whose value is not computed yet; the call returns immediately. The functions here take NumPy's
and MXNet's spellings where they differ from torch's (``axis=``, ``ctx=`` beside ``device=``).

Implicit blockers: anything that needs the values waits for them: ``asnumpy()``, ``item()``,
``tolist()``, ``tensor()``, ``print``/``repr``, ``float()``/``int()``/``bool()`` and iteration.
Explicit barriers: ``x.wait_to_read()`` and :func:`waitall`. ``shape``, ``dtype``, ``ndim`` and
``len()`` do not block: they are inferred when asked, by running the pending operations on
PyTorch's ``meta`` device (shapes only, no data); only an operation that cannot run there (or an
in-place change of shape such as ``resize_``) makes them wait for the value.

Autograd and plain tensors: a torch module called with an engine array pushes its operations with
the module's parameters as inputs; ``l.backward()`` is an engine operation that writes the
gradients of every parameter ``l`` depends on, and by default waits for itself before returning,
so ``p.grad`` read right after it is the finished gradient, as in eager PyTorch
(``backward(wait=False)`` returns at once). Torch optimizers, ``state_dict``/``load_state_dict``
and eager module calls wait for pending engine work on the tensors they use (see
:mod:`dlperf.engine.external` for exactly what is covered). Autograd's mode (``torch.no_grad()``)
at the time of a push is the mode its operation runs in.

No aliasing: the engine orders operations per array, so two arrays must never share memory. An
operation whose result would share storage with one of its inputs (indexing ``a[0:2]``, ``view``,
``reshape``, ``t``, ``narrow``, ``expand``, ``detach``, ...) returns a copy instead: after
``b = a[0:2]``, writing to ``a`` does not change ``b`` (unlike a NumPy view). Change part of an
array with ``a[key] = value``, which is one engine write of ``a``.

Example (d2l §12.2.1 with dlperf names):
    >>> from dlperf.engine import array as dnp
    >>> from dlperf.engine import create_engine
    >>> with create_engine() as eng:
    ...     a = dnp.random.normal(size=(100, 100), engine=eng)
    ...     b = dnp.dot(a, a)          # returns at once
    ...     print(b.shape)             # inferred, does not wait
    ...     x = dnp.ones((1, 2), engine=eng)
    ...     z = x * x + 2
    ...     print(z)                   # printing waits for z
    torch.Size([100, 100])
    array([[3., 3.]], device=cpu(0))
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any

import numpy
import torch

from ..devices import Device, DeviceLike, LogicalCpuTensor, cpu, require_available, tag
from ..errors import DeviceMismatchError, UsageError
from .batches import RECORD_GROUPS
from .engine import Engine, default_engine
from .external import External, external, watch
from .var import DONE as _DONE
from .var import Var

__all__ = ["Array", "array", "ones", "zeros", "empty", "full", "ones_like", "zeros_like", "arange", "dot",
           "exp", "log", "abs", "sqrt", "tanh", "relu", "sum", "mean", "max", "min", "maximum", "minimum",
           "concatenate", "stack", "reshape", "transpose", "matmul", "random", "copy_to", "as_in", "waitall"]

_grad_enabled = torch.is_grad_enabled
_new = object.__new__
_NO_GRADS: frozenset = frozenset()
_UNKNOWN = object()  # _meta: the shape is only known once the value is (wait for it)
_NO_KWARGS: dict = {}  # shared by recipes of operators; never modified


def _fix(res: Any, dev: Device) -> Any:
    # Results of ops on cpu(i), i > 0, carry their logical device (see dlperf.devices).
    if dev.index and dev.kind == "cpu" and isinstance(res, torch.Tensor):
        tag(res, dev)
    return res


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


def _record_streams(arrays: Sequence[Array]) -> None:
    # The caching allocator must not hand these blocks to another stream while this one uses them.
    stream = torch.cuda.current_stream()
    for a in arrays:
        if isinstance(a._data, torch.Tensor) and a._data.is_cuda:
            a._data.record_stream(stream)


# Functions run by the engine's workers ---------------------------------------------------------
def _storages(inputs: Sequence[Array]) -> set[int]:
    return {a._data.untyped_storage().data_ptr() for a in inputs if isinstance(a._data, torch.Tensor)}


def _unalias(res: Any, storages: set[int]) -> Any:
    # A result sharing memory with an input (a view, or the input itself) would escape the
    # engine's ordering: a later write to the input would change it behind its readers' backs.
    if isinstance(res, torch.Tensor):
        return res.clone() if res.untyped_storage().data_ptr() in storages else res
    if type(res) is tuple or type(res) is list:  # split, chunk, unbind, ...
        return type(res)(_unalias(r, storages) for r in res)
    return res


def _run_generic(func: Any, args: tuple, kwargs: dict, out: Array, inputs: list[Array], grad: bool) -> None:
    if out.device.is_gpu:
        _record_streams(inputs)
    if grad:
        res = func(*_unwrap(args), **_unwrap(kwargs))
    else:
        with torch.no_grad():
            res = func(*_unwrap(args), **_unwrap(kwargs))
    out._data = _fix(_unalias(res, _storages(inputs)), out.device)
    out._meta = None  # the value is there: drop the recipe (and its references to the inputs)


# Records (see Engine._push_rec): a tuple whose first item is the function that runs it, given
# the whole tuple, so that collecting one costs a single allocation.
def _rec_unary(rec: tuple) -> None:
    _, func, a, out = rec
    res = func(a._data)
    dev = out.device
    out._data = _fix(res, dev) if dev.index else res
    out._meta = None


def _rec_scalar(rec: tuple) -> None:
    _, func, a, b, out = rec
    res = func(a._data, b)
    dev = out.device
    out._data = _fix(res, dev) if dev.index else res
    out._meta = None


# One multi-tensor call for a run of scalar records: torch's foreach kernels on host tensors call
# the same per-tensor operator for each item (so results, dtypes and errors are those of one call
# each), but cross from Python into C++ once: about 0.4 us less an operation than one call each.
_FOREACH_SCALAR = {torch.add: torch._foreach_add, torch.sub: torch._foreach_sub,
                   torch.mul: torch._foreach_mul, torch.true_divide: torch._foreach_div,
                   torch.pow: torch._foreach_pow}
_HOST_TENSORS = (torch.Tensor, LogicalCpuTensor)


def _group_scalar(recs: list[tuple], i: int) -> int:
    """Run ``recs[i]`` and the scalar records after it with the same function on host tensors that
    do not need gradients, in one foreach call (see engine.RECORD_GROUPS for the result). A batch's
    records share its device; the scalars are checked by the call itself (one that it refuses runs
    the records one by one)."""
    first = recs[i]
    func = first[1]
    many = _FOREACH_SCALAR.get(func)
    if many is None:
        _rec_scalar(first)
        return i + 1
    tensors: list[torch.Tensor] = []
    scalars: list[Any] = []
    seen = None  # runs of records often share their input: check each input once
    scalar = first[3]
    same = True  # one scalar object for all (identity, not ==: 1, 1.0 and True differ in dtype)
    j, n = i, len(recs)
    while j < n:
        rec = recs[j]
        if rec[1] is not func or rec[0] is not _rec_scalar:
            break
        a = rec[2]
        if a is not seen:
            data = a._data  # None: the result of an earlier record of this run, not computed yet
            if data is None or type(data) not in _HOST_TENSORS or data.requires_grad or not data.is_cpu:
                break
            seen = a
        tensors.append(data)
        b = rec[3]
        if b is not scalar:
            same = False
        scalars.append(b)
        j += 1
    if j - i < 2:
        _rec_scalar(first)
        return i + 1
    dev = first[-1].device
    arg = scalar if same else scalars  # one Scalar parses faster than a list of them
    try:
        if dev.index:  # tagged inputs: compute plain, tag the results as _fix does
            with torch._C.DisableTorchFunctionSubclass():
                results = many(tensors, arg)
            for res in results:
                tag(res, dev)
        else:
            results = many(tensors, arg)
    except Exception:
        return -j
    for rec, res in zip(recs[i:j], results):
        out = rec[-1]
        out._data = res
        out._meta = None
    return j


def _run_binary(func: Any, a: Array, b: Array, out: Array) -> None:
    if out.device.is_gpu:
        _record_streams((a, b))
    out._data = _fix(func(a._data, b._data), out.device)
    out._meta = None


def _rec_binary(rec: tuple) -> None:
    _, func, a, b, out = rec
    dev = out.device
    if dev.is_gpu:
        _record_streams((a, b))
    res = func(a._data, b._data)
    out._data = _fix(res, dev) if dev.index else res
    out._meta = None


def _run_inplace(method: str, a: Array, args: tuple, kwargs: dict) -> None:
    getattr(a._data, method)(*_unwrap(args), **_unwrap(kwargs))


def _run_setitem(a: Array, key: Any, value: Any) -> None:
    a._data[_unwrap(key)] = _unwrap(value)


def _run_make(factory: Any, args: tuple, kwargs: dict, out: Array) -> None:
    out._data = _fix(factory(*args, **kwargs), out.device)
    out._meta = None


def _run_copy(src: Array, out: Array) -> None:
    data = src._data
    dst = out.device
    if dst.is_gpu or data.is_cuda:
        _record_streams((src,))
        if dst.is_gpu:
            out._data = data.to(dst.torch_device, non_blocking=True, copy=True)
        else:  # to pinned host memory, so the copy is asynchronous on the copy stream
            host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            host.copy_(data, non_blocking=True)
            out._data = _fix(host, dst)
    else:
        out._data = _fix(data.clone(), dst)
    out._meta = None


def _run_copy_into(src: Array, out: Array) -> None:
    if out._data is not None and tuple(out._data.shape) != tuple(src._data.shape):
        raise UsageError(f"copyto: the target has shape {tuple(out._data.shape)} but the source "
                         f"{tuple(src._data.shape)}; copy into an array of the same shape, or copy to a device")
    _run_copy(src, out)


def _run_backward(loss: Array, gradient: Any, retain_graph: Any, create_graph: bool) -> None:
    loss._data.backward(_unwrap(gradient), retain_graph=retain_graph, create_graph=create_graph)


def _run_grad(a: Array, out: Array) -> None:
    g = a._data.grad
    out._data = _fix(torch.zeros_like(a._data) if g is None else g.detach().clone(), out.device)
    out._meta = None


def _scalar_fast(func: Any, name: str) -> Any:
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
            # The record doubles as the shape recipe (see _infer): one allocation for both.
            out._meta = rec = (_rec_scalar, func, self, other, out)
            batch.reads[var] = None
            batch.outs.append(ov)  # before the record: a sender takes as many outputs as records
            recs = batch.recs
            recs.append(rec)
            if batch.sealed or len(recs) >= eng._auto_size:
                eng._appended(batch, rec, var, None, name)
            return out
        out = Array(eng, dev)
        out._grads = self._grads
        out._meta = rec = (_rec_scalar, func, self, other, out)
        eng._push_rec(rec, var, None, out._var, dev, name)
        return out

    method.__name__ = method.__qualname__ = f"__{name}__"
    return method


class Array:
    """An engine-managed array on one device; see the module docstring for what blocks.

    Construct with :func:`array`, :func:`ones`, :func:`random.normal` etc., not directly.
    """

    __slots__ = ("_data", "_var", "device", "engine", "_meta", "_grads", "_leaf")

    def __init__(self, engine: Engine, device: Device, data: Any = None) -> None:
        self._data = data
        self._var = Var()
        self.device = device
        self.engine = engine
        self._meta: Any = None  # a meta tensor, a (func, args, kwargs) recipe, _UNKNOWN or None
        self._grads: frozenset[External] = _NO_GRADS  # gradients a backward() of this array writes
        self._leaf: External | None = None  # this array's own gradient, after attach_grad()

    # ------------------------------------------------------------------ pushing
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _apply(func, args, kwargs or {})

    def _binary(self, func: Any, other: Any, name: str) -> Array:
        t = type(other)
        if t is Array:
            if other.device is not self.device and other.device != self.device:
                _mismatch(name, self, other)
            if not _grad_enabled():
                return _apply(func, (self, other), {}, name)
            out = Array(self.engine, self.device)
            out._grads = self._grads | other._grads if other._grads else self._grads
            out._meta = rec = (_rec_binary, func, self, other, out)
            if func is torch.matmul:  # not a small operation: never collected into a batch
                out._meta = (func, (self, other), _NO_KWARGS)
                self.engine.push(_run_binary, (func, self, other, out), (self._var, other._var), (out._var,),
                                 self.device, 0, name)
            else:
                self.engine._push_rec(rec, self._var, other._var, out._var, self.device, name)
            return out
        # a scalar (int and float first: the hot path of small array arithmetic)
        if (t is not int and t is not float and isinstance(other, torch.Tensor)) or not _grad_enabled():
            return _apply(func, (self, other), {}, name)
        out = Array(self.engine, self.device)
        out._grads = self._grads
        out._meta = rec = (_rec_scalar, func, self, other, out)
        self.engine._push_rec(rec, self._var, None, out._var, self.device, name)
        return out

    def _rbinary(self, func: Any, other: Any, name: str) -> Array:
        return _apply(func, (other, self), {}, name)

    def _unary(self, func: Any, name: str) -> Array:
        if not _grad_enabled():
            return _apply(func, (self,), {}, name)
        out = Array(self.engine, self.device)
        out._grads = self._grads
        out._meta = rec = (_rec_unary, func, self, out)
        self.engine._push_rec(rec, self._var, None, out._var, self.device, name)
        return out

    def _inplace(self, method: str, *args: Any, **kwargs: Any) -> Array:
        others: list[Array] = []
        _collect((args, kwargs), others)
        _check_devices(method, [self, *others])
        if method in _RESHAPING_INPLACE:
            self._meta = _UNKNOWN
        self.engine.push(_run_inplace, (method, self, args, kwargs), tuple(a._var for a in others),
                         (self._var,), self.device, 0, method)
        return self

    __add__ = _scalar_fast(torch.add, "add")

    __sub__ = _scalar_fast(torch.sub, "sub")

    __mul__ = _scalar_fast(torch.mul, "mul")

    __truediv__ = _scalar_fast(torch.true_divide, "div")

    __pow__ = _scalar_fast(torch.pow, "pow")

    def __matmul__(self, o: Any) -> Array:
        return self._binary(torch.matmul, o, "matmul")

    def __lt__(self, o: Any) -> Array:
        return self._binary(torch.lt, o, "lt")

    def __le__(self, o: Any) -> Array:
        return self._binary(torch.le, o, "le")

    def __gt__(self, o: Any) -> Array:
        return self._binary(torch.gt, o, "gt")

    def __ge__(self, o: Any) -> Array:
        return self._binary(torch.ge, o, "ge")

    def __eq__(self, o: Any) -> Array:  # type: ignore[override]
        return self._binary(torch.eq, o, "eq")

    def __ne__(self, o: Any) -> Array:  # type: ignore[override]
        return self._binary(torch.ne, o, "ne")

    __hash__ = object.__hash__  # identity, as for torch tensors

    def __radd__(self, o: Any) -> Array:
        return self._rbinary(torch.add, o, "add")

    def __rsub__(self, o: Any) -> Array:
        return self._rbinary(torch.sub, o, "sub")

    def __rmul__(self, o: Any) -> Array:
        return self._rbinary(torch.mul, o, "mul")

    def __rtruediv__(self, o: Any) -> Array:
        return self._rbinary(torch.true_divide, o, "div")

    def __rpow__(self, o: Any) -> Array:
        return self._rbinary(torch.pow, o, "pow")

    def __rmatmul__(self, o: Any) -> Array:
        return self._rbinary(torch.matmul, o, "matmul")

    def __neg__(self) -> Array:
        return self._unary(torch.neg, "neg")

    def __abs__(self) -> Array:
        return self._unary(torch.abs, "abs")

    def __iadd__(self, o: Any) -> Array:
        return self._inplace("add_", o)

    def __isub__(self, o: Any) -> Array:
        return self._inplace("sub_", o)

    def __imul__(self, o: Any) -> Array:
        return self._inplace("mul_", o)

    def __itruediv__(self, o: Any) -> Array:
        return self._inplace("div_", o)

    def __getitem__(self, key: Any) -> Array:
        return _apply(operator.getitem, (self, key), {}, "getitem")

    def __setitem__(self, key: Any, value: Any) -> None:
        others: list[Array] = []
        _collect((key, value), others)
        _check_devices("setitem", [self, *others])
        self.engine.push(_run_setitem, (self, key, value), tuple(a._var for a in others), (self._var,),
                         self.device, 0, "setitem")

    def dot(self, other: Any) -> Array:
        """Matrix (or vector) product, as ``numpy.dot`` for 1-D and 2-D operands."""
        return self._binary(torch.matmul, other, "dot")

    @property
    def T(self) -> Array:  # noqa: N802  (NumPy's name)
        """The array with its axes reversed (NumPy's ``.T``; a copy, see "No aliasing")."""
        return _apply(_reverse_axes, (self,), {}, "T")

    def copyto(self, target: DeviceLike | Array) -> Array:
        """Copy into ``target``: a device (a new array there) or an array (overwritten, same shape).

        Either way the copy is an engine operation of its own and overlaps other work.
        """
        if type(target) is Array:
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
    def grad(self) -> Array:
        """The gradient of a leaf made with :meth:`attach_grad`, as a new array (zeros before any backward)."""
        out = Array(self.engine, self.device)
        out._meta = (torch.zeros_like, (self,), {})
        reads = (self._var,) if self._leaf is None else (self._var, self._leaf.grad)
        self.engine.push(_run_grad, (self, out), reads, (out._var,), self.device, 0, "grad")
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
        op = self.engine.push(_run_backward, (self, gradient, retain_graph, create_graph),
                              (self._var, *(a._var for a in others)), writes, self.device, 0, "backward")
        if wait:
            try:
                op.wait()
            except BaseException:
                # Reported here: later operations on these gradients must not be skipped for it.
                for e in self._grads:
                    e.grad = Var("grad")
                raise

    def __getattr__(self, name: str) -> Any:
        # Any other torch.Tensor method becomes a pushed op: `b.sum()`, `x.relu()`, `w.zero_()`.
        if name.startswith("__") or not callable(getattr(torch.Tensor, name, None)):
            raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}")
        if name.endswith("_") and not name.endswith("__"):
            return lambda *a, **k: self._inplace(name, *a, **k)
        method = getattr(torch.Tensor, name)
        return lambda *a, **k: _apply(method, (self, *a), k, name)

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
        if meta is None or meta is _UNKNOWN:
            data = self._data
            if meta is None and isinstance(data, torch.Tensor):
                return data  # computed (an in-place change of shape would have set _UNKNOWN)
            return self.tensor()
        if isinstance(meta, torch.Tensor):
            return meta
        inferred = _infer(meta)
        if inferred is None:
            self._meta = _UNKNOWN if self._meta is meta else self._meta
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


# In-place methods after which the shape is only known from the value.
_RESHAPING_INPLACE = frozenset({"resize_", "resize_as_", "squeeze_", "unsqueeze_", "t_", "transpose_",
                                "as_strided_", "swapdims_", "swapaxes_", "set_"})


def _reverse_axes(t: torch.Tensor) -> torch.Tensor:
    return t.permute(*reversed(range(t.dim())))


def _to_meta(x: Any, depth: int) -> Any:
    t = type(x)
    if t is Array:
        described = _meta_of(x, depth)
        if described is None:
            raise _NotInferable
        return described
    if t is tuple or t is list:
        return t(_to_meta(v, depth) for v in x)
    if t is dict:
        return {k: _to_meta(v, depth) for k, v in x.items()}
    if isinstance(x, torch.Tensor) and x.device.type != "meta":
        return torch.empty_like(x, device="meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    return x


class _NotInferable(Exception):
    pass


_MAX_DEPTH = 64  # a longer chain of pending operations is waited for rather than inferred


def _meta_of(a: Array, depth: int) -> torch.Tensor | None:
    meta = a._meta
    if meta is None:
        data = a._data
        return torch.empty_like(data, device="meta") if isinstance(data, torch.Tensor) else None
    if meta is _UNKNOWN:
        return None
    if isinstance(meta, torch.Tensor):
        return meta
    if depth >= _MAX_DEPTH:
        return None
    inferred = _infer(meta, depth + 1)
    if inferred is not None and a._meta is meta:
        a._meta = inferred
    return inferred


def _infer(recipe: tuple, depth: int = 0) -> torch.Tensor | None:
    if recipe[0] in _RECORDS:  # a record (runner, func, inputs..., output)
        func, args, kwargs = recipe[1], recipe[2:-1], _NO_KWARGS
    else:
        func, args, kwargs = recipe
    try:
        with torch.no_grad():
            margs, mkwargs = _to_meta(args, depth), _to_meta(kwargs, depth)
            if "device" in mkwargs:
                mkwargs["device"] = "meta"
            res = func(*margs, **mkwargs)
    except Exception:  # not expressible on meta (data-dependent shapes, Python callables): wait
        return None
    return res if isinstance(res, torch.Tensor) and res.device.type == "meta" else None


_RECORDS = (_rec_unary, _rec_scalar, _rec_binary)
RECORD_GROUPS[_rec_scalar] = _group_scalar


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


def _apply(func: Any, args: tuple, kwargs: dict, name: str | None = None) -> Array:
    inputs: list[Array] = []
    tensors: list[torch.Tensor] = []
    _collect(args, inputs, tensors)
    _collect(kwargs, inputs, tensors)
    label = name or getattr(func, "__name__", "op")
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
    first.engine.push(_run_generic, (func, args, kwargs, out, inputs, grad), reads, writes,
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


def call_module(module: torch.nn.Module, args: tuple, name: str | None = None) -> Array:
    """Push one whole call of ``module`` on engine arrays as a single engine operation.

    Used for hybridized modules, whose replay is one unit (as MXNet runs a hybridized block as
    one cached operator): the operation reads the arrays and the module's parameters and buffers.
    """
    params = [*module.parameters(), *module.buffers()]
    out = _apply(_call, (module, list(args), params), {}, name or type(module).__name__)
    watch(module)  # its own __call__ bypasses the global module hooks that would do this
    return out


def _call(module: torch.nn.Module, args: list, params: list) -> Any:
    return module(*args)


def _make(factory: Any, args: tuple, kwargs: dict, device: DeviceLike | None, engine: Engine | None,
          name: str, meta: Any = None) -> Array:
    dev = cpu(0) if device is None else require_available(device)
    eng = engine if engine is not None else default_engine()
    kwargs = dict(kwargs)
    kwargs["device"] = dev.torch_device
    out = Array(eng, dev)
    out._meta = meta if meta is not None else (factory, args, kwargs)
    eng.push(_run_make, (factory, args, kwargs, out), (), (out._var,), dev, 0, name)
    return out


def _place(device: DeviceLike | None, ctx: DeviceLike | None) -> DeviceLike | None:
    if ctx is None:
        return device
    if device is not None and require_available(device) != require_available(ctx):
        raise UsageError(f"device={device} and ctx={ctx} disagree; pass one of them (ctx is MXNet's name "
                         "for device)")
    return ctx


def _shape(size: Any) -> tuple[int, ...]:
    if size is None:
        return ()
    return (size,) if isinstance(size, int) else tuple(size)


def array(data: Any, device: DeviceLike | None = None, dtype: torch.dtype | None = None,
          engine: Engine | None = None, *, ctx: DeviceLike | None = None) -> Array:
    """A new array holding a copy of ``data`` (tensor, NumPy array, nested lists, engine array).

    >>> array([[1, 2]]).tolist()
    [[1, 2]]
    """
    if type(data) is Array:
        data = data.tensor()
    src = data.detach() if isinstance(data, torch.Tensor) else torch.as_tensor(numpy.asarray(data))
    src = src.clone()  # the caller may change `data` after this returns
    meta = torch.empty_like(src, device="meta", dtype=dtype)
    return _make(torch.as_tensor, (src,), {"dtype": dtype}, _place(device, ctx), engine, "array", meta)


def ones(shape: Any, device: DeviceLike | None = None, dtype: torch.dtype | None = None,
         engine: Engine | None = None, *, ctx: DeviceLike | None = None) -> Array:
    """An array of ones (d2l's ``np.ones``)."""
    return _make(torch.ones, _shape(shape), {"dtype": dtype}, _place(device, ctx), engine, "ones")


def zeros(shape: Any, device: DeviceLike | None = None, dtype: torch.dtype | None = None,
          engine: Engine | None = None, *, ctx: DeviceLike | None = None) -> Array:
    """An array of zeros."""
    return _make(torch.zeros, _shape(shape), {"dtype": dtype}, _place(device, ctx), engine, "zeros")


def empty(shape: Any, device: DeviceLike | None = None, dtype: torch.dtype | None = None,
          engine: Engine | None = None, *, ctx: DeviceLike | None = None) -> Array:
    """An array with unspecified contents (allocation only)."""
    return _make(torch.empty, _shape(shape), {"dtype": dtype}, _place(device, ctx), engine, "empty")


def full(shape: Any, fill_value: Any, device: DeviceLike | None = None, dtype: torch.dtype | None = None,
         engine: Engine | None = None, *, ctx: DeviceLike | None = None) -> Array:
    """An array filled with ``fill_value``.

    >>> full((2,), 7.0).tolist()
    [7.0, 7.0]
    """
    return _make(torch.full, (_shape(shape), fill_value), {"dtype": dtype}, _place(device, ctx), engine, "full")


def ones_like(a: Array, dtype: torch.dtype | None = None) -> Array:
    """Ones with ``a``'s shape, device and (unless given) dtype."""
    return _apply(torch.ones_like, (a,), {"dtype": dtype}, "ones_like")


def zeros_like(a: Array, dtype: torch.dtype | None = None) -> Array:
    """Zeros with ``a``'s shape, device and (unless given) dtype."""
    return _apply(torch.zeros_like, (a,), {"dtype": dtype}, "zeros_like")


def arange(*args: Any, device: DeviceLike | None = None, dtype: torch.dtype | None = None,
           engine: Engine | None = None, ctx: DeviceLike | None = None) -> Array:
    """``torch.arange`` as an engine array."""
    return _make(torch.arange, args, {"dtype": dtype}, _place(device, ctx), engine, "arange")


def dot(a: Array, b: Array) -> Array:
    """Matrix (or vector) product of two arrays on one device; returns at once."""
    return a.dot(b)


def matmul(a: Array, b: Array) -> Array:
    """``a @ b``."""
    return a @ b


def _elementwise(torch_fn: Any, name: str, doc: str) -> Any:
    def fn(a: Array) -> Array:
        return _apply(torch_fn, (a,), {}, name)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


exp = _elementwise(torch.exp, "exp", "Elementwise e**a.")
log = _elementwise(torch.log, "log", "Elementwise natural logarithm.")
abs = _elementwise(torch.abs, "abs", "Elementwise absolute value.")  # noqa: A001  (NumPy's name)
sqrt = _elementwise(torch.sqrt, "sqrt", "Elementwise square root.")
tanh = _elementwise(torch.tanh, "tanh", "Elementwise hyperbolic tangent.")
relu = _elementwise(torch.relu, "relu", "max(a, 0) elementwise (MXNet's ``npx.relu``).")


def _reduce(torch_fn: Any, name: str, a: Array, axis: Any, keepdims: bool) -> Array:
    if axis is None:
        if keepdims:
            return _apply(_reduce_all_keepdims, (torch_fn, a), {}, name)
        return _apply(torch_fn, (a,), {}, name)
    return _apply(torch_fn, (a,), {"dim": axis, "keepdim": keepdims}, name)


def _reduce_all_keepdims(torch_fn: Any, t: torch.Tensor) -> torch.Tensor:
    return torch_fn(t).reshape([1] * t.dim())


def _max_values(t: torch.Tensor, dim: Any = None, keepdim: bool = False) -> torch.Tensor:
    return torch.amax(t) if dim is None else torch.amax(t, dim=dim, keepdim=keepdim)


def _min_values(t: torch.Tensor, dim: Any = None, keepdim: bool = False) -> torch.Tensor:
    return torch.amin(t) if dim is None else torch.amin(t, dim=dim, keepdim=keepdim)


def sum(a: Array, axis: Any = None, keepdims: bool = False) -> Array:  # noqa: A001  (NumPy's name)
    """Sum over ``axis`` (an int, a tuple, or None for all), NumPy style.

    >>> sum(array([[1.0, 2.0], [3.0, 4.0]]), axis=0).tolist()
    [4.0, 6.0]
    """
    return _reduce(torch.sum, "sum", a, axis, keepdims)


def mean(a: Array, axis: Any = None, keepdims: bool = False) -> Array:
    """Mean over ``axis``, NumPy style."""
    return _reduce(torch.mean, "mean", a, axis, keepdims)


def max(a: Array, axis: Any = None, keepdims: bool = False) -> Array:  # noqa: A001  (NumPy's name)
    """Largest element over ``axis`` (values only, as NumPy; not torch's (values, indices))."""
    return _reduce(_max_values, "max", a, axis, keepdims)


def min(a: Array, axis: Any = None, keepdims: bool = False) -> Array:  # noqa: A001  (NumPy's name)
    """Smallest element over ``axis`` (values only)."""
    return _reduce(_min_values, "min", a, axis, keepdims)


def _binary_fn(a: Any, b: Any, both: Any, scalar: Any, name: str) -> Array:
    if type(a) is not Array:  # a scalar first: the operation is symmetric
        a, b = b, a
    if type(b) is Array or isinstance(b, torch.Tensor):
        return _apply(both, (a, b), {}, name)
    return _apply(scalar, (a, b), {}, name)


def maximum(a: Any, b: Any) -> Array:
    """Elementwise larger of ``a`` and ``b`` (arrays or scalars, NumPy broadcasting).

    >>> maximum(array([-1.0, 2.0]), 0).tolist()
    [0.0, 2.0]
    """
    return _binary_fn(a, b, torch.maximum, torch.clamp_min, "maximum")


def minimum(a: Any, b: Any) -> Array:
    """Elementwise smaller of ``a`` and ``b``."""
    return _binary_fn(a, b, torch.minimum, torch.clamp_max, "minimum")


def concatenate(arrays: Sequence[Array], axis: int = 0) -> Array:
    """Join arrays along an existing axis (``torch.cat``).

    >>> concatenate([ones(2), zeros(1)]).tolist()
    [1.0, 1.0, 0.0]
    """
    return _apply(torch.cat, (list(arrays),), {"dim": axis}, "concatenate")


def stack(arrays: Sequence[Array], axis: int = 0) -> Array:
    """Join arrays along a new axis."""
    return _apply(torch.stack, (list(arrays),), {"dim": axis}, "stack")


def reshape(a: Array, newshape: Any) -> Array:
    """``a`` with a new shape (a copy: see "No aliasing")."""
    return _apply(torch.reshape, (a, _shape(newshape)), {}, "reshape")


def transpose(a: Array, axes: Sequence[int] | None = None) -> Array:
    """Permute the axes (reverse them when ``axes`` is None), NumPy style."""
    if axes is None:
        return a.T
    return _apply(torch.permute, (a, tuple(axes)), {}, "transpose")


def _normal(loc: float, scale: float, size: tuple[int, ...], device: torch.device) -> torch.Tensor:
    out = torch.empty(size, device=device)
    return out.normal_(loc, scale)


def _uniform(low: float, high: float, size: tuple[int, ...], device: torch.device) -> torch.Tensor:
    out = torch.empty(size, device=device)
    return out.uniform_(low, high)


class _Random:
    """Random arrays; each draw is an engine operation on the target device."""

    @staticmethod
    def normal(loc: float = 0.0, scale: float = 1.0, size: Any = None, device: DeviceLike | None = None,
               engine: Engine | None = None, *, ctx: DeviceLike | None = None) -> Array:
        """Normal samples (d2l's ``np.random.normal``)."""
        meta = torch.empty(_shape(size), device="meta")
        return _make(_normal, (loc, scale, _shape(size)), {}, _place(device, ctx), engine, "normal", meta)

    @staticmethod
    def uniform(low: float = 0.0, high: float = 1.0, size: Any = None, device: DeviceLike | None = None,
                engine: Engine | None = None, *, ctx: DeviceLike | None = None) -> Array:
        """Uniform samples in ``[low, high)`` (d2l's ``np.random.uniform``)."""
        meta = torch.empty(_shape(size), device="meta")
        return _make(_uniform, (low, high, _shape(size)), {}, _place(device, ctx), engine, "uniform", meta)


random = _Random()


def copy_to(x: Array, device: DeviceLike) -> Array:
    """A new array on ``device``; a copy involving a GPU runs on that GPU's copy stream.

    >>> from dlperf.devices import cpu
    >>> y = copy_to(ones(2), cpu(1))
    >>> y.device, y.tolist()
    (cpu(1), [1.0, 1.0])
    """
    dev = require_available(device)
    out = Array(x.engine, dev)
    out._meta = (torch.clone, (x,), {})
    where = x.device if x.device.is_gpu else dev  # the GPU side drives the transfer
    x.engine.push(_run_copy, (x, out), (x._var,), (out._var,), where, 0, "copy", "copy")
    return out


def _copy_into(x: Array, target: Array) -> Array:
    if target.engine is not x.engine:
        raise UsageError("copyto: the target array belongs to another engine; copy with array(x.tensor(), ...)")
    if target is x:
        return x
    where = x.device if x.device.is_gpu else target.device
    x.engine.push(_run_copy_into, (x, target), (x._var,), (target._var,), where, 0, "copy", "copy")
    return target


def as_in(x: Array, device: DeviceLike) -> Array:
    """``x`` itself when it is on ``device`` already, else :func:`copy_to`."""
    dev = require_available(device)
    return x if x.device == dev else copy_to(x, dev)


def waitall(engine: Engine | None = None) -> None:
    """Wait for every pushed operation: of ``engine``, or (default) of every open engine."""
    if engine is not None:
        engine.waitall()
        return
    from .engine import waitall as wait_every_engine

    wait_every_engine()
