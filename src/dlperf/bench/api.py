"""``dlperf.bench.run``: the Table-7 sweep from Python, for notebooks and scripts.

The result is the CLI's: it prints as the same table, renders as an HTML table in Jupyter, and gives
its cells as rows (``to_rows()``) or a pandas DataFrame (``to_pandas()``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import UsageError
from .result import BenchResult
from .runner import BenchConfig, run_bench, user_networks

__all__ = ["run", "BenchConfig", "BenchResult"]


def _names(value, what: str) -> list[str] | None:
    """A name, a comma-separated string of names, or a sequence of names; None keeps the default."""
    if value is None:
        return None
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        items = list(value)
    else:
        raise UsageError(f"{what} must be a name, a comma-separated string or a list of names, got {value!r}; "
                         f"give e.g. {what}=['mlp', 'lenet']")
    if not items:
        raise UsageError(f"{what} is empty ({value!r}); give at least one name or leave it out for the default")
    return items


def _devices(value) -> list | None:
    from ..devices import Device

    if value is None:
        return None
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()] or [value]
    if isinstance(value, Device):
        return [value]
    if isinstance(value, Sequence):
        return list(value)
    raise UsageError(f"devices must be a device, a comma-separated string or a list of devices, got {value!r}; "
                     "give e.g. devices='cpu' or devices=['cpu', 'gpu(0)']")


def _int(value, what: str, low: int, allow_none: bool = True) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UsageError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def _threads(value) -> list[int] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, Sequence) or isinstance(items, str) or not items \
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in items):
        raise UsageError(f"threads must be an integer >= 1 or a list of them, got {value!r}; give e.g. threads=[1, 2]")
    return list(items)


def _inputs(value):
    """``inputs=`` as an :data:`~dlperf.probe.user_inputs.InputSource`: spec strings, a ``module:function``,
    or a batch itself (a tensor, tuple or dict of tensors)."""
    from ..batch import tensors_of
    from ..models.inputs import parse_tensor_spec

    if value is None:
        return None
    texts = [value] if isinstance(value, str) else value
    if isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts):
        if len(texts) == 1 and texts[0].strip()[:1].isalpha():
            return texts[0].strip()
        return [parse_tensor_spec(t, "inputs") for t in texts]
    if tensors_of(value):
        return lambda _model, _generator: value
    raise UsageError(f"inputs must be tensor specs ('64x32:int64'), a 'module:function' returning the batch, or "
                     f"the batch itself, got {type(value).__name__}; give e.g. inputs=['64x32:int64']")


def run(networks=None, devices=None, threads=None, batch_size: int | None = None, steps: int | None = None,
        warmup: int | None = None, mode: str = "eager", explain: bool = False, quick: bool = False,
        inputs=None) -> BenchResult:
    """Time one training step per network, device and thread count; the arguments are ``dlperf bench``'s.

    ``networks``, ``devices`` and ``threads`` take one value, a comma-separated string or a list;
    left out, they are the CLI's defaults (the paper's seven networks, every device, 1, 2, 4, ...
    threads); a network may be your model's ``"module:factory"``, with ``inputs`` its batch: tensor specs
    (``["64x32:int64", "64:int64"]``), a ``"module:function"`` returning it, or the batch itself. ``mode`` is
    one of the bench modes (``eager``, ``compile``, ``hybrid``, ``auto``);
    ``explain`` adds the cost model's floor to every cell; ``quick`` takes fewer timed steps. A bad
    argument raises :class:`~dlperf.errors.UsageError` naming it, before anything is timed.

    >>> result = run(networks="mlp", devices="cpu", threads=1, batch_size=8, steps=2, warmup=1)
    >>> row = result.to_rows()[0]
    >>> row["network"], row["batch_size"], row["median_s"] > 0
    ('mlp', 8, True)
    >>> "dlperf (s)" in str(result) and "<table" in result._repr_html_()
    True
    """
    if not isinstance(mode, str):
        raise UsageError(f"mode must be a string, got {mode!r}; give e.g. mode='eager'")
    for flag, value in (("explain", explain), ("quick", quick)):
        if not isinstance(value, bool):
            raise UsageError(f"{flag} must be True or False, got {value!r}")
    overrides: dict = {"mode": mode, "explain": explain}
    with user_networks(_names(networks, "networks") or [], _inputs(inputs)):
        candidates = {"networks": _names(networks, "networks"), "devices": _devices(devices),
                      "threads": _threads(threads), "batch_size": _int(batch_size, "batch_size", 1),
                      "steps": _int(steps, "steps", 1), "warmup": _int(warmup, "warmup", 1)}
        overrides.update({k: v for k, v in candidates.items() if v is not None})
        config = BenchConfig.quick(**overrides) if quick else BenchConfig(**overrides)
        return run_bench(config)
