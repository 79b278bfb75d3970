"""An array whose operations are pushed to the engine and return at once (d2l's ``mxnet.np``).

Every operation on an :class:`Array` (operators, tensor methods, and ``torch.*`` functions through
``__torch_function__``) becomes one engine operation that reads its input arrays and writes a
new one, on the device of its inputs. The result is an :class:`Array` whose value is not computed
yet; the call returns immediately.

Implicit blockers: anything that needs the values waits for them: ``asnumpy()``, ``item()``,
``tolist()``, ``tensor()``, ``print``/``repr``, ``float()``/``int()``/``bool()``, ``len()``, and
the ``shape``/``dtype`` properties (shapes are known only once the op has run). Explicit barriers:
``x.wait_to_read()`` and :func:`waitall`.

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
    ...     x = dnp.ones((1, 2), engine=eng)
    ...     z = x * x + 2
    ...     print(z)                   # printing waits for z
    array([[3., 3.]], device=cpu(0))
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any

import numpy
import torch

from ..devices import Device, DeviceLike, cpu, require_available, tag
from ..errors import DeviceMismatchError, UsageError
from .engine import Engine, default_engine
from .var import Var

__all__ = ["Array", "array", "ones", "zeros", "arange", "dot", "random", "copy_to", "as_in", "waitall"]


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


def _collect(x: Any, out: list[Array]) -> None:
    t = type(x)
    if t is Array:
        out.append(x)
    elif t is tuple or t is list:
        for v in x:
            _collect(v, out)
    elif t is dict:
        for v in x.values():
            _collect(v, out)


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


def _run_generic(func: Any, args: tuple, kwargs: dict, out: Array, inputs: list[Array]) -> None:
    if out.device.is_gpu:
        _record_streams(inputs)
    res = func(*_unwrap(args), **_unwrap(kwargs))
    out._data = _fix(_unalias(res, _storages(inputs)), out.device)


def _run_unary(func: Any, a: Array, out: Array) -> None:
    out._data = _fix(func(a._data), out.device)


def _run_scalar(func: Any, a: Array, b: Any, out: Array) -> None:
    out._data = _fix(func(a._data, b), out.device)


def _run_binary(func: Any, a: Array, b: Array, out: Array) -> None:
    if out.device.is_gpu:
        _record_streams((a, b))
    out._data = _fix(func(a._data, b._data), out.device)


def _run_inplace(method: str, a: Array, args: tuple, kwargs: dict) -> None:
    getattr(a._data, method)(*_unwrap(args), **_unwrap(kwargs))


def _run_setitem(a: Array, key: Any, value: Any) -> None:
    a._data[_unwrap(key)] = _unwrap(value)


def _run_make(factory: Any, args: tuple, kwargs: dict, out: Array) -> None:
    out._data = _fix(factory(*args, **kwargs), out.device)


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


class Array:
    """An engine-managed array on one device; see the module docstring for what blocks.

    Construct with :func:`array`, :func:`ones`, :func:`random.normal` etc., not directly.
    """

    __slots__ = ("_data", "_var", "device", "engine")

    def __init__(self, engine: Engine, device: Device, data: Any = None) -> None:
        self._data = data
        self._var = Var()
        self.device = device
        self.engine = engine

    # ------------------------------------------------------------------ pushing
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _apply(func, args, kwargs or {})

    def _binary(self, func: Any, other: Any, name: str) -> Array:
        out = Array(self.engine, self.device)
        if type(other) is Array:
            if other.device != self.device:
                _mismatch(name, self, other)
            self.engine.push(_run_binary, (func, self, other, out), (self._var, other._var), (out._var,),
                             self.device, 0, name)
        else:
            self.engine.push(_run_scalar, (func, self, other, out), (self._var,), (out._var,),
                             self.device, 0, name)
        return out

    def _rbinary(self, func: Any, other: Any, name: str) -> Array:
        return _apply(func, (other, self), {}, name)

    def _unary(self, func: Any, name: str) -> Array:
        out = Array(self.engine, self.device)
        self.engine.push(_run_unary, (func, self, out), (self._var,), (out._var,), self.device, 0, name)
        return out

    def _inplace(self, method: str, *args: Any, **kwargs: Any) -> Array:
        others: list[Array] = []
        _collect((args, kwargs), others)
        _check_devices(method, [self, *others])
        self.engine.push(_run_inplace, (method, self, args, kwargs), tuple(a._var for a in others),
                         (self._var,), self.device, 0, method)
        return self

    def __add__(self, o: Any) -> Array:
        return self._binary(torch.add, o, "add")

    def __sub__(self, o: Any) -> Array:
        return self._binary(torch.sub, o, "sub")

    def __mul__(self, o: Any) -> Array:
        return self._binary(torch.mul, o, "mul")

    def __truediv__(self, o: Any) -> Array:
        return self._binary(torch.true_divide, o, "div")

    def __pow__(self, o: Any) -> Array:
        return self._binary(torch.pow, o, "pow")

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

    def copyto(self, device: DeviceLike) -> Array:
        """Always a new array on ``device``; the copy is an engine operation of its own (overlaps)."""
        return copy_to(self, device)

    def as_in(self, device: DeviceLike) -> Array:
        """``self`` if already on ``device``, else a copy there."""
        return as_in(self, device)

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

    @property
    def shape(self) -> torch.Size:
        """Blocks: shapes are known once the producing op has run."""
        return self.tensor().shape

    @property
    def dtype(self) -> torch.dtype:
        """Blocks, like :attr:`shape`."""
        return self.tensor().dtype

    def __len__(self) -> int:
        return len(self.tensor())

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


def _apply(func: Any, args: tuple, kwargs: dict, name: str | None = None) -> Array:
    inputs: list[Array] = []
    _collect(args, inputs)
    _collect(kwargs, inputs)
    if not inputs:
        raise UsageError(f"{getattr(func, '__name__', func)} got no engine array")
    _check_devices(name or getattr(func, "__name__", "op"), inputs)
    first = inputs[0]
    out = Array(first.engine, first.device)
    first.engine.push(_run_generic, (func, args, kwargs, out, inputs), tuple(a._var for a in inputs),
                      (out._var,), first.device, 0, name or getattr(func, "__name__", None))
    return out


def _make(factory: Any, args: tuple, kwargs: dict, device: DeviceLike | None, engine: Engine | None,
          name: str) -> Array:
    dev = cpu(0) if device is None else require_available(device)
    eng = engine if engine is not None else default_engine()
    kwargs = dict(kwargs)
    kwargs["device"] = dev.torch_device
    out = Array(eng, dev)
    eng.push(_run_make, (factory, args, kwargs, out), (), (out._var,), dev, 0, name)
    return out


def _shape(size: Any) -> tuple[int, ...]:
    if size is None:
        return ()
    return (size,) if isinstance(size, int) else tuple(size)


def array(data: Any, device: DeviceLike | None = None, dtype: torch.dtype | None = None,
          engine: Engine | None = None) -> Array:
    """A new array holding a copy of ``data`` (tensor, NumPy array, nested lists).

    >>> array([[1, 2]]).tolist()
    [[1, 2]]
    """
    src = data.detach() if isinstance(data, torch.Tensor) else torch.as_tensor(numpy.asarray(data))
    src = src.clone()  # the caller may change `data` after this returns
    return _make(torch.as_tensor, (src,), {"dtype": dtype}, device, engine, "array")


def ones(shape: Any, device: DeviceLike | None = None, dtype: torch.dtype | None = None,
         engine: Engine | None = None) -> Array:
    """An array of ones (d2l's ``np.ones``)."""
    return _make(torch.ones, _shape(shape), {"dtype": dtype}, device, engine, "ones")


def zeros(shape: Any, device: DeviceLike | None = None, dtype: torch.dtype | None = None,
          engine: Engine | None = None) -> Array:
    """An array of zeros."""
    return _make(torch.zeros, _shape(shape), {"dtype": dtype}, device, engine, "zeros")


def arange(*args: Any, device: DeviceLike | None = None, dtype: torch.dtype | None = None,
           engine: Engine | None = None) -> Array:
    """``torch.arange`` as an engine array."""
    return _make(torch.arange, args, {"dtype": dtype}, device, engine, "arange")


def dot(a: Array, b: Array) -> Array:
    """Matrix (or vector) product of two arrays on one device; returns at once."""
    return a.dot(b)


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
               engine: Engine | None = None) -> Array:
        """Normal samples (d2l's ``np.random.normal``)."""
        return _make(_normal, (loc, scale, _shape(size)), {}, device, engine, "normal")

    @staticmethod
    def uniform(low: float = 0.0, high: float = 1.0, size: Any = None, device: DeviceLike | None = None,
                engine: Engine | None = None) -> Array:
        """Uniform samples in ``[low, high)`` (d2l's ``np.random.uniform``)."""
        return _make(_uniform, (low, high, _shape(size)), {}, device, engine, "uniform")


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
    where = x.device if x.device.is_gpu else dev  # the GPU side drives the transfer
    x.engine.push(_run_copy, (x, out), (x._var,), (out._var,), where, 0, "copy", "copy")
    return out


def as_in(x: Array, device: DeviceLike) -> Array:
    """``x`` itself when it is on ``device`` already, else :func:`copy_to`."""
    dev = require_available(device)
    return x if x.device == dev else copy_to(x, dev)


def waitall(engine: Engine | None = None) -> None:
    """Wait for every pushed operation (of ``engine``, default: the default engine)."""
    (engine if engine is not None else default_engine()).waitall()
