"""The KVStore interface: a key -> tensor store that sums what workers push and serves what they pull.

This is the parameter-server view of data parallelism (d2l 12.7.4): each key holds one parameter (or
gradient bucket); ``push`` sends one value per device and the store sums them; ``pull`` copies the
stored value out to every device; ``pushpull`` does both. With an optimizer set on the store, pushes are
gradients and the store updates the weight it holds ("update on kvstore").

Vocabulary: a *worker* is one training process (rank), a *device* one of its devices; a single-process
store has one worker (``rank == 0``, ``num_workers == 1``). Distributed stores implement this same
class across processes: they sum over every worker's pushes, and ``priority`` orders their network
traffic (the single-process stores run each call at once, so they accept it and ignore it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from ..registry import Registry

__all__ = ["KVStore", "register_kvstore", "create_kvstore", "kvstore_types", "Key"]

Key = int | str
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def _as_list(value: torch.Tensor | Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    values = [value] if isinstance(value, torch.Tensor) else list(value)
    if not values:
        raise UsageError(f"{what} needs at least one tensor")
    for i, v in enumerate(values):
        if not isinstance(v, torch.Tensor):
            raise UsageError(f"{what} item {i} is a {type(v).__name__}, not a torch.Tensor")
    return values


class KVStore(ABC):
    """Single-key operations plus batched ones (lists of keys with a list of values each)."""

    type: str = ""

    def __new__(cls, kind: str | None = None):
        # KVStore("local") picks the registered type, as MXNet's mx.kv.create("local") does.
        if cls is KVStore:
            if kind is None:
                raise UsageError(f"KVStore needs a type; valid choices: {', '.join(_TYPES)}")
            cls = _TYPES.get(kind)
        return super().__new__(cls)

    def __init__(self, kind: str | None = None) -> None:
        self._store: dict[Key, torch.Tensor] = {}
        self._params: dict[Key, nn.Parameter] = {}
        self._optimizers: dict[Key, torch.optim.Optimizer] = {}
        self._factory: OptimizerFactory | None = None
        self._closed = False

    # -- who we are -------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's index among all workers (always 0 in one process)."""
        return 0

    @property
    def num_workers(self) -> int:
        """How many workers push to this store (1 in one process)."""
        return 1

    # -- where a key's value lives and how pushes are summed (what subclasses decide) ---------------
    @abstractmethod
    def _home(self, key: Key, like: torch.Tensor, devices: Sequence[torch.device]) -> torch.device:
        """The device that holds ``key``'s stored value and does its sums."""

    def _reduce(self, home: torch.device, values: list[torch.Tensor]) -> torch.Tensor:
        acc = values[0].to(home, copy=True)
        for v in values[1:]:
            acc.add_(v.to(home, non_blocking=True))
        return acc

    # -- the API ----------------------------------------------------------------------------------
    def init(self, key: Key | Sequence[Key], value: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Create ``key`` holding a copy of ``value``; each key is initialized once.

        >>> from dlperf.kvstore import create_kvstore
        >>> with create_kvstore("local") as kv:
        ...     kv.init("w", torch.zeros(2))
        ...     kv.push("w", [torch.ones(2), torch.ones(2)])
        ...     out = [torch.empty(2)]
        ...     kv.pull("w", out=out)
        ...     out[0].tolist()
        [2.0, 2.0]
        """
        self._check_open()
        if isinstance(key, (list, tuple)):
            for k, v in zip(key, _as_list(value, "init"), strict=True):
                self.init(k, v)
            return
        if key in self._store:
            raise UsageError(f"key {key!r} is already initialized; each key is initialized once")
        value = _as_list(value, "init")[0]
        home = self._home(key, value, [value.device])
        self._store[key] = value.detach().to(home, copy=True)

    def push(self, key: Key | Sequence[Key], value: torch.Tensor | Sequence[torch.Tensor],
             priority: int = 0) -> None:
        """Sum ``value`` (a tensor or one per device) into the store: assign it, or update with it.

        ``priority`` is accepted for the distributed interface and ignored: this store runs the push
        now, in call order.
        """
        self._check_open()
        if isinstance(key, (list, tuple)):
            for k, v in zip(key, value, strict=True):
                self.push(k, v, priority)
            return
        stored = self._get(key)
        values = _as_list(value, "push")
        for v in values:
            if v.shape != stored.shape:
                raise UsageError(f"push to key {key!r}: shape {tuple(v.shape)} does not match the stored "
                                 f"{tuple(stored.shape)}")
        total = self._reduce(stored.device, [v.detach() for v in values])
        if self._factory is None:
            stored.copy_(total)  # no optimizer: the store keeps the sum of the last push
        else:
            self._update(key, total)

    def pull(self, key: Key | Sequence[Key], out: torch.Tensor | Sequence[torch.Tensor],
             priority: int = 0) -> None:
        """Copy the stored value into ``out`` (a tensor or one per device); ``priority`` is ignored here."""
        self._check_open()
        if isinstance(key, (list, tuple)):
            for k, o in zip(key, out, strict=True):
                self.pull(k, o, priority)
            return
        stored = self._get(key)
        with torch.no_grad():
            for o in _as_list(out, "pull"):
                o.copy_(stored, non_blocking=True)

    def pushpull(self, key: Key | Sequence[Key], value: torch.Tensor | Sequence[torch.Tensor],
                 out: torch.Tensor | Sequence[torch.Tensor] | None = None, priority: int = 0) -> None:
        """``push`` then ``pull``; with ``out=None`` the result goes back into ``value``."""
        self.push(key, value, priority)
        self.pull(key, value if out is None else out, priority)

    def set_optimizer(self, factory: OptimizerFactory) -> None:
        """Update on the store: later pushes are gradients and ``factory([param])`` updates each key."""
        self._check_open()
        self._factory = factory

    def _update(self, key: Key, grad: torch.Tensor) -> None:
        param = self._params.get(key)
        if param is None:
            param = self._params[key] = nn.Parameter(self._store[key], requires_grad=True)
            self._optimizers[key] = self._factory([param])
        param.grad = grad
        self._optimizers[key].step()
        param.grad = None

    def _get(self, key: Key) -> torch.Tensor:
        try:
            return self._store[key]
        except KeyError:
            raise UsageError(f"key {key!r} is not initialized; call init({key!r}, value) first") from None

    def keys(self) -> list[Key]:
        return list(self._store)

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Stored values and optimizer states, on the host."""
        return {"values": {k: v.detach().cpu().clone() for k, v in self._store.items()},
                "optimizers": {k: o.state_dict() for k, o in self._optimizers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state["values"].items():
            if k in self._store:
                self._store[k].copy_(v)
            else:
                self.init(k, v)
        for k, s in state["optimizers"].items():
            if self._factory is None:
                raise UsageError("the checkpoint has store-side optimizer state; call set_optimizer first")
            if k not in self._optimizers:
                self._params[k] = nn.Parameter(self._store[k], requires_grad=True)
                self._optimizers[k] = self._factory([self._params[k]])
            self._optimizers[k].load_state_dict(s)

    # -- lifetime ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {self.type!r} KVStore is closed")

    def close(self) -> None:
        self._closed = True

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_TYPES: Registry[type[KVStore]] = Registry("kvstore type", normalize=str.lower)


def register_kvstore(name: str, factory: type[KVStore], *, replace: bool = False) -> None:
    """Make ``factory`` available as ``create_kvstore(name)``; a name already taken raises unless ``replace``."""
    _TYPES.register(name, factory, replace=replace)


def kvstore_types() -> list[str]:
    """Registered store types in registration order."""
    return _TYPES.names()


def create_kvstore(name: str = "local") -> KVStore:
    """A new store of the given type (``local``: sums on the host; ``device``: sums on the devices)."""
    return _TYPES.get(name)()
