"""The KVStore interface: a key -> tensor store that sums what workers push and serves what they pull.

This is the parameter-server view of data parallelism (d2l 12.7.4): each key holds one parameter (or
gradient bucket); ``push`` sends one value per device and the store sums them; ``pull`` copies the
stored value out to every device; ``pushpull`` does both. With an optimizer set on the store, pushes are
gradients and the store updates the weight it holds ("update on kvstore").

Vocabulary: a *worker* is one training process (rank), a *device* one of its devices; a single-process
store has one worker (``rank == 0``, ``num_workers == 1``). Distributed stores implement this same
class across processes: they sum over every worker's pushes, and ``priority`` orders their network
traffic.

Every call also has an asynchronous form that returns an engine operation, Horovod style:
``op = kv.push_async(key, grads)``, ``kv.pull_async(key, out)``, ``kv.pushpull_async(...)``, then
``op.wait()``. Each key has an engine variable: pushes write it, pulls read it, so calls on one key run
in call order while different keys (and the caller) run on; ``priority`` orders ready calls. The
tensors passed must not be touched until the operation is done. A store runs its operations on an
engine it is bound to (:meth:`KVStore.bind_engine`, as the Trainer does), or on its own threaded engine
created on first use and closed by :meth:`KVStore.close`. The blocking calls wait for pending
operations on their key first, then run in the calling thread.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .._cliargs import one_line
from .._io import safe_torch_load, save_torch
from ..devices import Device, DeviceLike, cpu, to_device
from ..engine import Engine, Op, Var, create_engine
from ..errors import UsageError
from ..optimizer_group import OptimizerGroup
from ..registry import Registry

__all__ = ["KVStore", "register_kvstore", "register_kvstore_alias", "create_kvstore", "kvstore_types", "Key"]

Key = int | str
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
Updater = Callable[[Key, torch.Tensor, torch.Tensor], None]


def as_tensor_list(value: torch.Tensor | Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
    values = [value] if isinstance(value, torch.Tensor) else list(value)
    if not values:
        raise UsageError(f"{what} needs at least one tensor")
    for i, v in enumerate(values):
        if not isinstance(v, torch.Tensor):
            raise UsageError(f"{what} item {i} is a {type(v).__name__}, not a torch.Tensor")
    return values


def key_value_pairs(key: Key | Sequence[Key], value: Any, call: str) -> list[tuple[Key, Any]]:
    """``[(key, value)]`` for one key, or one pair per key of a list; a key that is neither an int nor a str,
    or a value list of another length, is one :class:`UsageError`."""
    if not isinstance(key, (list, tuple)):
        _check_key(key, call)
        return [(key, value)]  # type: ignore[list-item]  # _check_key proved key an int or a str
    for k in key:
        _check_key(k, call)
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)) or len(value) != len(key):
        got = (f"{len(value)} values" if isinstance(value, (list, tuple))
               else f"a {type(value).__name__}")
        raise UsageError(f"{call} got {len(key)} keys and {got}; give a list of values (a tensor, or one list of "
                         "per-device tensors) with one entry per key")
    return list(zip(key, value, strict=True))


def _check_key(key: object, call: str) -> None:
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise UsageError(f"{call} got key {one_line(repr(key))[:80]} of type {type(key).__name__}; expected an int "
                         "or a str (several keys: a list of them)")


def _values_of(value: Any) -> list[torch.Tensor] | None:
    """``value`` as a list of tensors when it plainly is one (a tensor, or a list or tuple of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if (type(value) is list or type(value) is tuple) and value:
        for v in value:
            if not isinstance(v, torch.Tensor):
                return None
        return value if type(value) is list else list(value)
    return None


def _sum_into(target: torch.Tensor, values: Sequence[torch.Tensor]) -> None:
    """``target = sum(values)``, one pass over the values, no temporary on the target's device.

    Values on another device are copied over first (non-blocking only towards a GPU: a host tensor is
    read at once).
    """
    home = target.device
    moved = [v if v.device == home else v.to(home, non_blocking=home.type == "cuda") for v in values]
    if len(moved) == 1:
        target.copy_(moved[0])
        return
    torch.add(moved[0], moved[1], out=target)
    for v in moved[2:]:
        target.add_(v)


def _check_dtype(what: str, key: Key, given: torch.Tensor, stored: torch.Tensor) -> None:
    # copy_ converts silently: a float64 push into a float32 key, or a pull into int64, would round away
    if given.dtype != stored.dtype:
        fix = f"convert with .to({stored.dtype})" if what == "push to" else f"pull into a {stored.dtype} tensor"
        raise UsageError(f"{what} key {key!r}: dtype {given.dtype} does not match the stored {stored.dtype}; {fix}")


class KVStore(ABC):
    """Single-key operations plus batched ones (lists of keys with a list of values each)."""

    type: str = ""

    def __new__(cls, kind: str | None = None, **options: Any):
        # KVStore("local") picks the registered type, as MXNet's mx.kv.create("local") does.
        if cls is KVStore:
            if kind is None:
                raise UsageError(f"KVStore needs a type; valid choices: {', '.join(_TYPES)}")
            cls = _TYPES.get(_canonical(kind))
        return super().__new__(cls)

    def __init__(self, kind: str | None = None) -> None:
        if isinstance(kind, str) and kind.lower() in _ALIASES and _canonical(kind) == type(self).type:
            self.type = kind.lower()  # MXNet's name, as given (KVStore("local_allreduce_cpu").type)
        self._store: dict[Key, torch.Tensor] = {}
        self._params: dict[Key, nn.Parameter] = {}
        self._optimizers: dict[Key, torch.optim.Optimizer] = {}
        self._optimizer_group: OptimizerGroup | None = None
        self._received: dict[Key, torch.Tensor] = {}  # per key, the buffer a push's sum goes to before an update
        self._factory: OptimizerFactory | None = None
        self._updater: Updater | None = None
        self._key_type: type | None = None
        self._closed = False
        self._engine: Engine | None = None
        self._own_engine = False
        self._lane: Device = cpu(0)
        self._lane_kind = "compute"
        self._vars: dict[Key, Var] = {}

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
        """A new tensor on ``home`` holding the sum of ``values``."""
        total = torch.empty_like(values[0], device=home)
        _sum_into(total, values)
        return total

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
        for k, v in key_value_pairs(key, value, "init"):
            self._check_key_type(k)
            if k in self._store:
                raise UsageError(f"key {k!r} is already initialized; each key is initialized once")
            first = as_tensor_list(v, "init")[0]
            home = self._home(k, first, [first.device])
            self._store[k] = first.detach().to(home, copy=True)
            if self._factory is not None and self._optimizer_group is not None:
                self._key_optimizer(k)  # a scheduler driving the store's optimizers reaches this key too

    def push(self, key: Key | Sequence[Key], value: torch.Tensor | Sequence[torch.Tensor],
             priority: int = 0) -> None:
        """Sum ``value`` (a tensor or one per device) into the store: assign it, or update with it.

        ``priority`` is accepted for the distributed interface and ignored: this store runs the push
        now, in call order.
        """
        self._check_open()
        # Every key is checked before the first is pushed, so a bad one leaves the store as it was.
        for k, values in [self._checked_push(k, v) for k, v in self._key_value_pairs(key, value, "push")]:
            self._settle(k)
            self._push_now(k, values)

    def _key_value_pairs(self, key: Key | Sequence[Key], value: Any, call: str) -> list[tuple[Key, Any]]:
        if type(key) is int or type(key) is str:  # one key: the common case, no list to check
            return [(key, value)]
        return key_value_pairs(key, value, call)

    def _checked_push(self, key: Key, value: Any) -> tuple[Key, list[torch.Tensor]]:
        """``(key, values)`` when ``value`` fits the stored value exactly; else :meth:`_check_push`'s error.

        The common case in a few attribute reads; anything unusual takes the full check, which names
        the problem.
        """
        stored = self._store.get(key)
        values = _values_of(value)
        if stored is None or values is None:
            return key, self._check_push(key, value)
        shape, dtype = stored.shape, stored.dtype
        for v in values:
            if v.shape != shape or v.dtype != dtype or v.requires_grad:
                return key, self._check_push(key, value)
        return key, values

    def _check_push(self, key: Key, value: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
        stored = self._get(key)
        values = as_tensor_list(value, "push")
        for v in values:
            if v.shape != stored.shape:
                raise UsageError(f"push to key {key!r}: shape {tuple(v.shape)} does not match the stored "
                                 f"{tuple(stored.shape)}")
            _check_dtype("push to", key, v, stored)
        return [v.detach() for v in values]

    def _push_now(self, key: Key, values: list[torch.Tensor]) -> None:
        stored = self._store[key]
        if self._updater is None and self._factory is None:
            _sum_into(stored, values)  # no optimizer: the store keeps the sum of the last push, written in place
            return
        received = self._received.get(key)
        if received is None or received.device != stored.device:
            received = self._received[key] = torch.empty_like(stored)
        _sum_into(received, values)
        if self._updater is not None:
            with torch.no_grad():
                self._updater(key, received, stored)
        else:
            self._update(key, received)

    def pull(self, key: Key | Sequence[Key], out: torch.Tensor | Sequence[torch.Tensor],
             priority: int = 0) -> None:
        """Copy the stored value into ``out`` (a tensor or one per device); ``priority`` is ignored here."""
        self._check_open()
        for k, outs in [self._checked_pull(k, o) for k, o in self._key_value_pairs(key, out, "pull")]:
            self._settle(k)
            self._pull_now(k, outs)

    def _checked_pull(self, key: Key, out: Any) -> tuple[Key, list[torch.Tensor]]:
        """``(key, outs)`` when ``out`` fits the stored value exactly; else :meth:`_check_pull`'s error."""
        stored = self._store.get(key)
        outs = _values_of(out)
        if stored is None or outs is None:
            return key, self._check_pull(key, out)
        shape, dtype = stored.shape, stored.dtype
        for o in outs:
            if o.shape != shape or o.dtype != dtype:
                return key, self._check_pull(key, out)
        return key, outs

    def _check_pull(self, key: Key, out: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
        stored = self._get(key)
        outs = as_tensor_list(out, "pull")
        for o in outs:
            # copy_ would broadcast a (3,) stored value into a (2, 3) out without a word: refuse instead
            if o.shape != stored.shape:
                raise UsageError(f"pull from key {key!r}: out shape {tuple(o.shape)} does not match the stored "
                                 f"{tuple(stored.shape)}; pull into a tensor of the stored shape")
            _check_dtype("pull from", key, o, stored)
        return outs

    def _pull_now(self, key: Key, outs: list[torch.Tensor]) -> None:
        stored = self._store[key]
        if any(o.requires_grad for o in outs):
            with torch.no_grad():  # a leaf that requires grad takes in-place copies only outside autograd
                for o in outs:
                    o.copy_(stored, non_blocking=o.is_cuda)
            return
        for o in outs:
            o.copy_(stored, non_blocking=o.is_cuda)

    def broadcast(self, key: Key | Sequence[Key], value: torch.Tensor | Sequence[torch.Tensor],
                  out: torch.Tensor | Sequence[torch.Tensor], priority: int = 0) -> None:
        """Initialize ``key`` with ``value`` (rank 0's, across processes) and pull it into ``out``.

        >>> with KVStore("local") as kv:
        ...     outs = [torch.zeros(2), torch.zeros(2)]
        ...     kv.broadcast("w", torch.ones(2), out=outs)
        ...     outs[1].tolist()
        [1.0, 1.0]
        """
        self.init(key, value)
        self.pull(key, out, priority)

    def pushpull(self, key: Key | Sequence[Key], value: torch.Tensor | Sequence[torch.Tensor],
                 out: torch.Tensor | Sequence[torch.Tensor] | None = None, priority: int = 0) -> None:
        """``push`` then ``pull``; with ``out=None`` the result goes back into ``value``."""
        self.push(key, value, priority)
        self.pull(key, value if out is None else out, priority)

    # -- asynchronous forms: engine operations ------------------------------------------------------
    def bind_engine(self, engine: Engine | None, device: DeviceLike | None = None, kind: str = "compute") -> None:
        """Run this store's asynchronous calls on ``engine`` (``None``: its own engine again), on ``device``'s lane.

        Pending calls finish first. ``kind="copy"`` puts them on a GPU's copy stream.
        """
        self.wait_all()
        if self._own_engine and self._engine is not None:
            self._engine.close()
        self._engine, self._own_engine = engine, False
        self._lane = cpu(0) if device is None else to_device(device)
        self._lane_kind = kind
        self._vars = {}

    def _get_engine(self) -> Engine:
        if self._engine is None or self._engine.closed:
            self._engine, self._own_engine = create_engine("threaded"), True
            self._vars = {}
        return self._engine

    def _var(self, key: Key) -> Var:
        v = self._vars.get(key)
        # a variable a failed call wrote carries that error to every later call: start a clean one
        if v is None or v.exc is not None:
            v = self._vars[key] = Var(f"kvstore key {key}")
        return v

    def _settle(self, key: Key) -> None:
        """Wait for pending asynchronous calls on ``key`` (a blocking call runs after them)."""
        v = self._vars.get(key)
        if v is not None and self._engine is not None and not self._engine.closed:
            self._engine.wait_to_write(v)

    def wait_all(self) -> None:
        """Wait for every pending asynchronous call of this store; raise the first error once."""
        if self._engine is None or self._engine.closed:
            return
        first: BaseException | None = None
        for v in list(self._vars.values()):
            try:
                self._engine.wait_to_read(v)
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    def _single(self, key: Key, call: str) -> None:
        self._check_open()
        if isinstance(key, (list, tuple)):
            raise UsageError(f"{call} takes one key and returns one operation, got {len(key)} keys; call it once "
                             "per key and wait for each operation")

    def push_async(self, key: Key, value: torch.Tensor | Sequence[torch.Tensor], priority: int = 0) -> Op:
        """:meth:`push` as an engine operation; ``op.wait()`` raises its error, if any, once."""
        self._single(key, "push_async")
        values = self._check_push(key, value)
        return self._get_engine().push(self._push_now, args=(key, values), writes=(self._var(key),),
                                       device=self._lane, priority=priority, name=f"kvstore push {key}",
                                       kind=self._lane_kind)

    def pull_async(self, key: Key, out: torch.Tensor | Sequence[torch.Tensor], priority: int = 0) -> Op:
        """:meth:`pull` as an engine operation; ``out`` holds the value once ``op.wait()`` returns."""
        self._single(key, "pull_async")
        outs = self._check_pull(key, out)
        return self._get_engine().push(self._pull_now, args=(key, outs), reads=(self._var(key),),
                                       device=self._lane, priority=priority, name=f"kvstore pull {key}",
                                       kind=self._lane_kind)

    def pushpull_async(self, key: Key, value: torch.Tensor | Sequence[torch.Tensor],
                       out: torch.Tensor | Sequence[torch.Tensor] | None = None, priority: int = 0) -> Op:
        """:meth:`pushpull` as one engine operation (it writes the key's variable)."""
        self._single(key, "pushpull_async")
        values = self._check_push(key, value)
        outs = self._check_pull(key, value if out is None else out)

        def run() -> None:
            self._push_now(key, values)
            self._pull_now(key, outs)

        return self._get_engine().push(run, writes=(self._var(key),), device=self._lane, priority=priority,
                                       name=f"kvstore pushpull {key}", kind=self._lane_kind)

    def set_optimizer(self, factory: OptimizerFactory) -> None:
        """Update on the store: later pushes are gradients and ``factory([param])`` updates each key.

        Replaces an updater set with :meth:`set_updater`.
        """
        self._check_open()
        if not callable(factory):
            raise UsageError(f"set_optimizer needs a callable that builds an optimizer from [param], got "
                             f"{type(factory).__name__}; e.g. lambda ps: torch.optim.SGD(ps, lr=0.1)")
        self._factory, self._updater = factory, None
        self._params, self._optimizers, self._optimizer_group = {}, {}, None

    def set_updater(self, updater: Updater) -> None:
        """Merge each push with ``updater(key, received, stored)``, which updates ``stored`` in place.

        ``received`` is the sum of the push's values (across processes: of every worker's, per round);
        this is MXNet's custom updater, and it replaces the default (the store keeps the last sum) and
        an optimizer set with :meth:`set_optimizer`.

        >>> def accumulate(key, received, stored):
        ...     stored += received
        >>> with KVStore("local") as kv:
        ...     kv.set_updater(accumulate)
        ...     kv.init(0, torch.ones(2))
        ...     kv.push(0, [torch.ones(2), torch.ones(2)])
        ...     out = torch.empty(2)
        ...     kv.pull(0, out=out)
        ...     out.tolist()
        [3.0, 3.0]
        """
        self._check_open()
        if not callable(updater):
            raise UsageError(f"set_updater needs a callable updater(key, received, stored), got "
                             f"{type(updater).__name__}")
        self._updater, self._factory = updater, None
        self._params, self._optimizers, self._optimizer_group = {}, {}, None

    def _update(self, key: Key, grad: torch.Tensor) -> None:
        param, optimizer = self._key_optimizer(key)
        param.grad = grad
        optimizer.step()
        param.grad = None
        if self._optimizer_group is not None:
            self._optimizer_group.mark_stepped()

    def _key_optimizer(self, key: Key) -> tuple[nn.Parameter, torch.optim.Optimizer]:
        """The parameter over ``key``'s stored value and its optimizer, made on first use."""
        param = self._params.get(key)
        if param is None:
            assert self._factory is not None  # only called with an optimizer set
            param = self._params[key] = nn.Parameter(self._store[key], requires_grad=True)
            self._optimizers[key] = self._factory([param])
        return param, self._optimizers[key]

    @property
    def optimizer(self) -> OptimizerGroup:
        """The store's optimizers (one per key) as one, for learning-rate schedulers and ``lr`` changes.

        MXNet's store runs one optimizer for every key; here each key has its own (made by the factory
        given to :meth:`set_optimizer`), and this group lists all their ``param_groups``, so
        ``torch.optim.lr_scheduler.StepLR(kv.optimizer, ...)`` or ``group["lr"] = x`` for each of
        ``kv.optimizer.param_groups`` changes every key's rate. Keys initialized later join the group.

        >>> with KVStore("local") as kv:
        ...     kv.set_optimizer(lambda ps: torch.optim.SGD(ps, lr=1.0))
        ...     kv.init([0, 1], [torch.zeros(2), torch.zeros(3)])
        ...     for group in kv.optimizer.param_groups:
        ...         group["lr"] = 0.5
        ...     kv.push(0, torch.ones(2))
        ...     out = torch.empty(2)
        ...     kv.pull(0, out=out)
        ...     out.tolist()
        [-0.5, -0.5]
        """
        self._check_open()
        if len(self._store) < len(self.keys()):  # a distributed store: the values live on its servers
            raise UsageError(f"the {self.type!r} store's optimizers run on its servers, in their own processes; give "
                             "the servers an optimizer factory that schedules its own learning rate")
        if self._factory is None:
            raise UsageError("this store has no optimizer: call set_optimizer(factory) first (with a custom updater "
                             "set_updater, the updater itself holds any learning rate)")
        if self._optimizer_group is None:
            for k in list(self._store):
                self._key_optimizer(k)  # a scheduler takes the groups that exist when it is made
            self._optimizer_group = OptimizerGroup(lambda: list(self._optimizers.values()),
                                                   f"the optimizers of the {self.type!r} store's keys")
        return self._optimizer_group

    def reset(self, key: Key | Sequence[Key], value: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Give initialized keys new values and start their update state afresh (MXNet's store reset).

        What a Trainer that updates on the store does when its replicas' parameters were loaded: the
        store's copy is replaced by the loaded values, and an optimizer's per-key state (momentum) is
        dropped, while its settings (the learning rate a scheduler set) stay.

        >>> with KVStore("local") as kv:
        ...     kv.init("w", torch.zeros(2))
        ...     kv.reset("w", torch.ones(2))
        ...     out = torch.empty(2)
        ...     kv.pull("w", out=out)
        ...     out.tolist()
        [1.0, 1.0]
        """
        self._check_open()
        pairs = [(k, self._check_push(k, [as_tensor_list(v, "reset")[0]])[0])
                 for k, v in key_value_pairs(key, value, "reset")]
        self.wait_all()
        for k, v in pairs:
            with torch.no_grad():
                self._store[k].copy_(v)
            optimizer = self._optimizers.get(k)
            if optimizer is not None:
                optimizer.state.clear()

    def _check_key_type(self, key: object) -> None:
        """Keys are ints or strs, one kind per store (MXNet's rule: the two kinds name keys differently)."""
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise UsageError(f"key {key!r} is a {type(key).__name__}; expected an int or a str")
        kind = str if isinstance(key, str) else int
        if self._key_type is None:
            self._key_type = kind
        elif kind is not self._key_type:
            article = "a" if kind is str else "an"
            raise UsageError(f"key {key!r} is {article} {kind.__name__} but this store's keys are "
                             f"{self._key_type.__name__}s; use one kind of key per store")

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
        self.wait_all()
        return {"values": {k: v.detach().cpu().clone() for k, v in self._store.items()},
                "optimizers": {k: o.state_dict() for k, o in self._optimizers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait_all()
        for k, v in state["values"].items():
            if k in self._store:
                self._store[k].copy_(v)
            else:
                self.init(k, v)
        for k, s in state["optimizers"].items():
            if self._factory is None:
                raise UsageError("the checkpoint has store-side optimizer state; call set_optimizer first")
            self._key_optimizer(k)[1].load_state_dict(s)

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`state_dict` to ``path`` atomically (a crash leaves the old file or the new one).

        A write that fails (a full disk, a read-only directory) is one :class:`~dlperf._io.FileAccessError`
        naming ``path``; the previous file stays as it was and no temporary file is left.
        """
        save_torch(path, self.state_dict())  # its errors name the path, the cause and the fix

    def load(self, path: str | os.PathLike) -> None:
        """Read a file written by :meth:`save` as data only (no pickled code runs) and load it."""
        state = safe_torch_load(path, what="kvstore state", expected="a file written by KVStore.save")
        if not (isinstance(state, dict) and isinstance(state.get("values"), dict)
                and isinstance(state.get("optimizers"), dict)):
            raise UsageError(f"kvstore state {os.fspath(path)!r} is not a file written by KVStore.save "
                             "(no 'values' and 'optimizers' tables); give the path of one")
        bad = next((k for k, v in state["values"].items() if isinstance(k, bool) or not isinstance(k, (int, str))
                    or not isinstance(v, torch.Tensor)), None)
        if bad is not None or any(not isinstance(s, dict) for s in state["optimizers"].values()):
            what = f"key {bad!r}" if bad is not None else "an optimizer state"
            raise UsageError(f"kvstore state {os.fspath(path)!r} is not a file written by KVStore.save ({what} is "
                             "not a tensor under an int or str key); give the path of one")
        self.load_state_dict(state)

    # -- lifetime ---------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {self.type!r} KVStore is closed")

    def close(self) -> None:
        """Finish pending asynchronous calls and stop the store's own engine, if it made one."""
        if self._closed:
            return
        try:
            self.wait_all()
        finally:
            self._closed = True
            engine, self._engine = self._engine, None
            if engine is not None and self._own_engine and not engine.closed:
                engine.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_TYPES: Registry[type[KVStore]] = Registry("kvstore type", normalize=str.lower)
_ALIASES: dict[str, str] = {}  # MXNet's other names for a registered type -> that type


def register_kvstore(name: str, factory: type[KVStore], *, replace: bool = False) -> None:
    """Make ``factory`` available as ``create_kvstore(name)``; a name already taken raises unless ``replace``."""
    _TYPES.register(name, factory, replace=replace)


def register_kvstore_alias(alias: str, name: str) -> None:
    """Let ``create_kvstore(alias)`` make a ``name`` store whose :attr:`KVStore.type` reads ``alias``.

    MXNet's names for the same stores (``local_allreduce_cpu`` for ``local``, ...); an alias is not
    listed among :func:`kvstore_types`.
    """
    alias = alias.lower()
    if alias in _TYPES.names() or alias in _ALIASES:
        raise ValueError(f"kvstore type {alias!r} is registered twice")
    _ALIASES[alias] = name


def _canonical(name: str) -> str:
    if not isinstance(name, str):
        raise UsageError(f"a kvstore type is a name such as 'local', got {type(name).__name__}")
    return _ALIASES.get(name.lower(), name)


def kvstore_types() -> list[str]:
    """Registered store types in registration order (MXNet's aliases for them are accepted too)."""
    return _TYPES.names()


def create_kvstore(name: str = "local", **options: Any) -> KVStore:
    """A new store of the given type (``local``: sums on the host; ``device``: sums on the devices).

    ``options`` go to the type's constructor (the distributed types take ``num_servers``, ``staleness``).
    MXNet's aliases make the store they name and keep their own name as its ``type``:

    >>> with create_kvstore("local_allreduce_cpu") as kv:
    ...     type(kv).__name__, kv.type
    ('LocalKVStore', 'local_allreduce_cpu')
    """
    kv = _TYPES.get(_canonical(name))(**options)
    if name.lower() in _ALIASES:
        kv.type = name.lower()
    return kv


def kvstore_class(name: str) -> type[KVStore]:
    """The class ``create_kvstore(name)`` makes, without making one (a miss lists the registered types)."""
    return _TYPES.get(_canonical(name))
