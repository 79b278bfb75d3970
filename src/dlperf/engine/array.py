"""An array whose operations are pushed to the engine and return at once (d2l's ``mxnet.np``).

Every operation on an :class:`Array` (operators, methods, the functions here and ``torch.*`` functions) is one
engine operation on the device of its inputs; the result's value is computed later. Anything that needs the values
(``asnumpy()``, ``item()``, ``print``) waits for them; ``shape`` and ``dtype`` are inferred without waiting. Results
never share memory with inputs: ``a[0:2]`` is a copy. Blocking, autograd and aliasing in full:
docs/design/engine.md. The array class is in :mod:`~dlperf.engine.ndarray`, what workers run in
:mod:`~dlperf.engine.records`, shape inference in :mod:`~dlperf.engine.shapes`; this is the NumPy-style namespace.

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
from collections.abc import Sequence
from typing import Any

import numpy
import torch

from ..devices import DeviceLike, cpu, require_available
from ..errors import UsageError
from .arguments import EngineArgumentError
from .engine import Engine, default_engine
from .engine import waitall as _wait_every_engine
from .external import watch
from .ndarray import Array, apply, as_in, copy_to
from .records import run_make

__all__ = ["Array", "array", "ones", "zeros", "empty", "full", "ones_like", "zeros_like", "arange", "dot",
           "exp", "log", "abs", "sqrt", "tanh", "relu", "sum", "mean", "max", "min", "maximum", "minimum",
           "concatenate", "stack", "reshape", "transpose", "matmul", "random", "copy_to", "as_in", "waitall"]


def call_module(module: torch.nn.Module, args: tuple, name: str | None = None) -> Array:
    """Push one whole call of ``module`` on engine arrays as a single engine operation.

    Used for hybridized modules, whose replay is one unit (as MXNet runs a hybridized block as
    one cached operator): the operation reads the arrays and the module's parameters and buffers.
    """
    params = [*module.parameters(), *module.buffers()]
    out = apply(_call, (module, list(args), params), {}, name or type(module).__name__)
    watch(module)  # its own __call__ bypasses the global module hooks that would do this
    return out


def _call(module: torch.nn.Module, args: list, params: list) -> Any:
    return module(*args)


def _make(factory: Any, args: tuple, kwargs: dict, device: DeviceLike | None, engine: Engine | None,
          name: str, meta: Any = None) -> Array:
    if engine is not None and not isinstance(engine, Engine):
        raise EngineArgumentError(f"{name}: engine is {type(engine).__name__}; expected an Engine "
                                  "(create_engine()) or None for the default one")
    dev = cpu(0) if device is None else require_available(device)
    eng = engine if engine is not None else default_engine()
    kwargs = dict(kwargs)
    kwargs["device"] = dev.torch_device
    out = Array(eng, dev)
    out._meta = meta if meta is not None else (factory, args, kwargs)
    eng._push(run_make, (factory, args, kwargs, out), (), (out._var,), dev, 0, name)
    return out


def _place(device: DeviceLike | None, ctx: DeviceLike | None) -> DeviceLike | None:
    if ctx is None:
        return device
    if device is not None and require_available(device) != require_available(ctx):
        raise UsageError(f"device={device} and ctx={ctx} disagree; pass one of them (ctx is MXNet's name "
                         "for device)")
    return ctx


def _shape(size: Any, call: str, *, infer_one: bool = False) -> tuple[int, ...]:
    """``size`` (None, an integer or a sequence of them) as a shape; ``infer_one``: -1 is allowed."""
    if size is None:
        return ()
    try:
        dims: tuple = (operator.index(size),) if not isinstance(size, bool) else (size,)
    except TypeError:
        try:
            dims = tuple(size) if not isinstance(size, (str, bytes)) else (size,)
        except TypeError:
            dims = (size,)
    low = -1 if infer_one else 0
    shape = []
    for d in dims:
        try:
            if isinstance(d, bool):
                raise TypeError
            shape.append(operator.index(d))
        except TypeError:
            raise EngineArgumentError(f"{call}: shape {size!r:.60} is not valid; expected an integer or a tuple "
                                      "of integers, e.g. (2, 3)") from None
        if shape[-1] < low:
            raise EngineArgumentError(f"{call}: shape {size!r:.60} has a dimension below {low}; expected sizes "
                                      f">= {low}")
    return tuple(shape)


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
    return _make(torch.ones, _shape(shape, "ones"), {"dtype": dtype}, _place(device, ctx), engine, "ones")


def zeros(shape: Any, device: DeviceLike | None = None, dtype: torch.dtype | None = None,
          engine: Engine | None = None, *, ctx: DeviceLike | None = None) -> Array:
    """An array of zeros."""
    return _make(torch.zeros, _shape(shape, "zeros"), {"dtype": dtype}, _place(device, ctx), engine, "zeros")


def empty(shape: Any, device: DeviceLike | None = None, dtype: torch.dtype | None = None,
          engine: Engine | None = None, *, ctx: DeviceLike | None = None) -> Array:
    """An array with unspecified contents (allocation only)."""
    return _make(torch.empty, _shape(shape, "empty"), {"dtype": dtype}, _place(device, ctx), engine, "empty")


def full(shape: Any, fill_value: Any, device: DeviceLike | None = None, dtype: torch.dtype | None = None,
         engine: Engine | None = None, *, ctx: DeviceLike | None = None) -> Array:
    """An array filled with ``fill_value``.

    >>> full((2,), 7.0).tolist()
    [7.0, 7.0]
    """
    return _make(torch.full, (_shape(shape, "full"), fill_value), {"dtype": dtype}, _place(device, ctx), engine, "full")


def ones_like(a: Array, dtype: torch.dtype | None = None) -> Array:
    """Ones with ``a``'s shape, device and (unless given) dtype."""
    return apply(torch.ones_like, (a,), {"dtype": dtype}, "ones_like")


def zeros_like(a: Array, dtype: torch.dtype | None = None) -> Array:
    """Zeros with ``a``'s shape, device and (unless given) dtype."""
    return apply(torch.zeros_like, (a,), {"dtype": dtype}, "zeros_like")


def arange(*args: Any, device: DeviceLike | None = None, dtype: torch.dtype | None = None,
           engine: Engine | None = None, ctx: DeviceLike | None = None) -> Array:
    """``torch.arange`` as an engine array."""
    return _make(torch.arange, args, {"dtype": dtype}, _place(device, ctx), engine, "arange")


def dot(a: Array, b: Array) -> Array:
    """Matrix (or vector) product of two arrays on one device; returns at once."""
    if isinstance(a, Array):
        return a.dot(b)
    return apply(torch.matmul, (a, b), {}, "dot")  # refused with one line unless b is an engine array


def matmul(a: Array, b: Array) -> Array:
    """``a @ b``."""
    return a @ b


def _elementwise(torch_fn: Any, name: str, doc: str) -> Any:
    def fn(a: Array) -> Array:
        return apply(torch_fn, (a,), {}, name)

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
            return apply(_reduce_all_keepdims, (torch_fn, a), {}, name)
        return apply(torch_fn, (a,), {}, name)
    return apply(torch_fn, (a,), {"dim": axis, "keepdim": keepdims}, name)


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
        return apply(both, (a, b), {}, name)
    return apply(scalar, (a, b), {}, name)


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
    return apply(torch.cat, (list(arrays),), {"dim": axis}, "concatenate")


def stack(arrays: Sequence[Array], axis: int = 0) -> Array:
    """Join arrays along a new axis."""
    return apply(torch.stack, (list(arrays),), {"dim": axis}, "stack")


def reshape(a: Array, newshape: Any) -> Array:
    """``a`` with a new shape (a copy: see "No aliasing"); a shape that cannot hold ``a``'s elements is an
    error at the call whenever ``a``'s shape is known without waiting.

    >>> reshape(ones((2, 3)), (3, 2)).shape
    torch.Size([3, 2])
    """
    shape = _shape(newshape, "reshape", infer_one=True)
    if type(a) is not Array:
        return apply(torch.reshape, (a, shape), {}, "reshape")  # refused with one line: no engine array
    return a.reshape(shape)


def transpose(a: Array, axes: Sequence[int] | None = None) -> Array:
    """Permute the axes (reverse them when ``axes`` is None), NumPy style."""
    if axes is None:
        return a.T
    return apply(torch.permute, (a, tuple(axes)), {}, "transpose")


def _normal(loc: float, scale: float, size: tuple[int, ...], device: torch.device) -> torch.Tensor:
    out = torch.empty(size, device=device)
    return out.normal_(loc, scale)


def _uniform(low: float, high: float, size: tuple[int, ...], device: torch.device) -> torch.Tensor:
    out = torch.empty(size, device=device)
    return out.uniform_(low, high)


def _randint(low: int, high: int, size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randint(low, high, size, dtype=dtype, device=device)


def _choice(n: int, size: tuple[int, ...], replace: bool, weights: torch.Tensor | None,
            device: torch.device) -> torch.Tensor:
    count = int(torch.Size(size).numel())
    if weights is not None:
        picked = torch.multinomial(weights.to(device), count, replacement=replace)
    elif replace:
        picked = torch.randint(0, n, (count,), device=device)
    else:
        picked = torch.randperm(n, device=device)[:count]
    return picked.reshape(size)


def _choice_of(values: torch.Tensor, n: int, size: tuple[int, ...], replace: bool,
               weights: torch.Tensor | None) -> torch.Tensor:
    return values[_choice(n, size, replace, weights, values.device)]


def _probabilities(p: Any, n: int) -> torch.Tensor:
    """``p`` as float64 probabilities of ``n`` elements (one line when they are not)."""
    try:
        weights = torch.as_tensor(p.tensor() if type(p) is Array else p, dtype=torch.float64).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        raise EngineArgumentError(f"random.choice: p={p!r:.60} is not a list of numbers") from None
    # (this module's abs and sum are NumPy's, for arrays)
    if weights.shape != (n,) or not bool(torch.isfinite(weights).all()) or bool((weights < 0).any()) or \
            not -1e-6 <= float(weights.sum()) - 1.0 <= 1e-6:
        raise EngineArgumentError(f"random.choice: p={p!r:.60} is not {n} probabilities; expected {n} "
                                  "non-negative numbers that sum to 1")
    return weights


def _draw(sampler: Any, params: tuple, size: Any, device: DeviceLike | None, engine: Engine | None,
          name: str) -> Array:
    shape = _shape(size, f"random.{name}")
    return _make(sampler, (*params, shape), {}, device, engine, name, torch.empty(shape, device="meta"))


class _Random:
    """Random arrays; each draw is an engine operation on the target device."""

    @staticmethod
    def normal(loc: float = 0.0, scale: float = 1.0, size: Any = None, device: DeviceLike | None = None,
               engine: Engine | None = None, *, ctx: DeviceLike | None = None) -> Array:
        """Normal samples (d2l's ``np.random.normal``)."""
        return _draw(_normal, (loc, scale), size, _place(device, ctx), engine, "normal")

    @staticmethod
    def uniform(low: float = 0.0, high: float = 1.0, size: Any = None, device: DeviceLike | None = None,
                engine: Engine | None = None, *, ctx: DeviceLike | None = None) -> Array:
        """Uniform samples in ``[low, high)`` (d2l's ``np.random.uniform``)."""
        return _draw(_uniform, (low, high), size, _place(device, ctx), engine, "uniform")

    @staticmethod
    def randint(low: int, high: int | None = None, size: Any = None, dtype: torch.dtype | None = None,
                device: DeviceLike | None = None, engine: Engine | None = None, *,
                ctx: DeviceLike | None = None) -> Array:
        """Integers drawn uniformly from ``[low, high)``, or ``[0, low)`` without ``high`` (NumPy's ``randint``).

        >>> x = random.randint(3, 5, size=(2, 4))
        >>> x.shape, x.dtype, set(x.tolist()[0]) <= {3, 4}
        (torch.Size([2, 4]), torch.int64, True)
        """
        lo, hi = (0, low) if high is None else (low, high)
        for name, v in (("low", lo), ("high", hi)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise EngineArgumentError(f"random.randint: {name}={v!r} is not an integer")
        if lo >= hi:
            raise EngineArgumentError(f"random.randint: low={lo} >= high={hi}; expected low < high (an empty range "
                                      "has nothing to draw)")
        kind = torch.int64 if dtype is None else dtype
        shape = _shape(size, "random.randint")
        return _make(_randint, (lo, hi, shape, kind), {}, _place(device, ctx), engine, "randint",
                     torch.empty(shape, dtype=kind, device="meta"))

    @staticmethod
    def choice(a: Any, size: Any = None, replace: bool = True, p: Any = None, device: DeviceLike | None = None,
               engine: Engine | None = None, *, ctx: DeviceLike | None = None) -> Array:
        """Samples of ``a`` (an integer n: of ``arange(n)``; else a 1-d array of values), NumPy's ``choice``.

        ``replace=False`` draws distinct elements; ``p`` gives each element's probability.

        >>> sorted(random.choice(5, size=5, replace=False).tolist())
        [0, 1, 2, 3, 4]
        """
        if type(a) is Array:
            if a.ndim != 1:
                raise EngineArgumentError(f"random.choice: a has shape {tuple(a.shape)}; expected a 1-d array "
                                          "(or an integer n for arange(n))")
            values: Any = a
            n = a.shape[0]
        elif isinstance(a, int) and not isinstance(a, bool):
            values, n = None, a
        else:
            raise EngineArgumentError(f"random.choice: a is {type(a).__name__}; expected an integer n or a 1-d "
                                      "engine array")
        if n < 1:
            raise EngineArgumentError(f"random.choice: a has {n} elements; expected at least one")
        shape = _shape(size, "random.choice")
        count = int(torch.Size(shape).numel())
        if not replace and count > n:
            raise EngineArgumentError(f"random.choice: {count} samples without replacement from {n} elements; "
                                      "take at most as many as there are, or pass replace=True")
        weights = None if p is None else _probabilities(p, n)
        args = (n, shape, bool(replace), weights)
        if values is None:
            return _make(_choice, args, {}, _place(device, ctx), engine, "choice",
                         torch.empty(shape, dtype=torch.int64, device="meta"))
        return apply(_choice_of, (values, *args), {}, "choice")


random = _Random()


def waitall(engine: Engine | None = None) -> None:
    """Wait for every pushed operation: of ``engine``, or (default) of every open engine."""
    if engine is not None:
        if not isinstance(engine, Engine):
            raise EngineArgumentError(f"waitall: engine is {type(engine).__name__}; expected an Engine, or None "
                                      "for every open engine")
        engine.waitall()
        return
    _wait_every_engine()
