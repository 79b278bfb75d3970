"""The one factory: the gradient synchronization strategy a trainer uses, named or inferred, or why none fits.

A strategy is named (``strategy="allreduce"``, ``--strategy``, a plan's ``strategy-NAME``) and checked against the
options (:meth:`~.strategy.Strategy.unusable`); without a name the options decide, by one rule written here for the
Trainer, :class:`~dlperf.parallel.training.run_config.RunConfig` and ``dlperf launch``: a distributed store (its
class says so, see :func:`~dlperf.parallel.communication.servers.is_dist_kvstore`) needs several processes and means
parameter servers; a local store aggregates one process's devices only; across processes without a store the
buckets are summed by allreduce, on host memory.

>>> choose_strategy(devices=2), choose_strategy("local", devices=2, update_on_kvstore=True)
('allreduce', 'update-on-kvstore')
>>> choose_strategy("local", processes=2)
Traceback (most recent call last):
  ...
dlperf.errors.UsageError: kvstore='local' with 2 processes: the local stores aggregate one process's devices only; \
use kvstore='dist_sync', or kvstore=None (gradients are then summed across processes by allreduce)
"""

from __future__ import annotations

from collections.abc import Sequence

from ...devices import Device
from ...errors import UsageError
from ...kvstore import KVStore
from ..communication.servers import is_dist_kvstore
from .strategy import STRATEGIES, Strategy, StrategyOptions

__all__ = ["choose_strategy", "create_strategy", "check_update_on_kvstore", "strategy_class"]


def check_update_on_kvstore(kvstore: str | KVStore | None, update_on_kvstore: bool | None) -> None:
    """Refuse an ``update_on_kvstore`` the store cannot honour: the rule a config and this factory both apply.

    A stated value is honoured or refused, never replaced: ``True`` needs a store, and ``False`` cannot
    be had with a distributed store, whose servers run the optimizer (``None`` lets the store decide).
    """
    if update_on_kvstore is not None and not isinstance(update_on_kvstore, bool):
        raise UsageError(f"update_on_kvstore={update_on_kvstore!r}: expected True, False or None (the store decides)")
    if update_on_kvstore and kvstore is None:
        raise UsageError("update_on_kvstore=True needs a kvstore, e.g. kvstore='local'")
    if update_on_kvstore is False and kvstore is not None and is_dist_kvstore(kvstore):
        name = kvstore if isinstance(kvstore, str) else kvstore.type
        raise UsageError(f"update_on_kvstore=False with kvstore={name!r}: its parameter servers run the "
                         "optimizer and serve the updated weights; leave update_on_kvstore out (or True), or "
                         "drop the kvstore to sum gradients across processes by allreduce")


def choose_strategy(kvstore: str | KVStore | None = None, *, update_on_kvstore: bool | None = None,
                    devices: Sequence[Device] | int = 1, processes: int = 1, num_servers: int = 0,
                    strategy: str | type[Strategy] | Strategy | None = None) -> str:
    """The registered name of the strategy for these options; one :class:`UsageError` line when they conflict.

    Args:
        kvstore: a store type name, a store, or None (allreduce).
        update_on_kvstore: the store runs the optimizer (``None``: only a distributed store, which refuses
            ``False``).
        devices: this process's devices (or how many).
        processes: how many processes train together (servers included).
        num_servers: ranks that are parameter servers (the launch's).
        strategy: a registered name (or an instance) to check against the options instead of inferring one.
    """
    if strategy is not None:
        return _named(strategy, kvstore, update_on_kvstore, devices, processes)
    distributed = kvstore is not None and is_dist_kvstore(kvstore)
    where = f"kvstore={kvstore!r}"
    if num_servers and not distributed:
        raise UsageError(f"num_servers={num_servers} with kvstore={kvstore!r}: parameter servers serve a distributed "
                         "store; give kvstore='dist_sync', or num_servers=0")
    check_update_on_kvstore(kvstore, update_on_kvstore)
    count = devices if isinstance(devices, int) else len(devices)
    if processes > 1:
        if kvstore is not None and not distributed:
            raise UsageError(f"{where} with {processes} processes: the local stores aggregate one process's devices "
                             "only; use kvstore='dist_sync', or kvstore=None (gradients are then summed across "
                             "processes by allreduce)")
        if not isinstance(devices, int) and any(d.is_gpu for d in devices):
            raise UsageError(f"devices {list(devices)} with {processes} processes: gradients are summed across "
                             "processes by gloo on host memory; use CPU devices")
        return "parameter-servers" if distributed else "processes"
    if distributed:
        raise UsageError(f"{where} in one process: a distributed store needs several; start them (nproc_per_node=2, "
                         "dlperf launch, torchrun), or use kvstore='local'")
    if kvstore is None:
        return "one-device" if count == 1 else "allreduce"
    return "update-on-kvstore" if update_on_kvstore else "kvstore"


def strategy_class(strategy: str | type[Strategy] | Strategy) -> type[Strategy]:
    """The class a strategy option names: a registered name, ``pkg.module:Class`` (imported and registered: a
    strategy of the user's own), a class or an instance."""
    if isinstance(strategy, Strategy):
        return type(strategy)
    if isinstance(strategy, type) and issubclass(strategy, Strategy):
        return strategy
    text = str(strategy)
    if ":" not in text:
        return STRATEGIES.get(text)
    from ...probe.targets import load_factory

    cls = load_factory(text)
    if not (isinstance(cls, type) and issubclass(cls, Strategy)) or not cls.name:
        raise UsageError(f"strategy={text!r} is not a Strategy subclass with a name; name one, e.g. "
                         "mystrategies:MySync")
    if cls.name not in STRATEGIES:
        STRATEGIES.register(cls.name, cls)
    return cls


def _named(strategy: str | type[Strategy] | Strategy, kvstore: str | KVStore | None,
           update_on_kvstore: bool | None,
           devices: Sequence[Device] | int, processes: int) -> str:
    cls = strategy_class(strategy)
    name = cls.name
    check_update_on_kvstore(kvstore, update_on_kvstore)
    options = StrategyOptions(kvstore, bool(update_on_kvstore) or (kvstore is not None and _dist(kvstore)),
                              devices if isinstance(devices, int) else len(devices), processes,
                              not isinstance(devices, int) and any(d.is_gpu for d in devices))
    why = cls.unusable(options)
    if why:
        raise UsageError(f"strategy={name!r} with {options.devices} device(s) in {processes} process(es)"
                         f"{f' and kvstore {kvstore!r}' if kvstore is not None else ''}: it {why}")
    return name


def _dist(kvstore: str | KVStore) -> bool:
    return is_dist_kvstore(kvstore)


def create_strategy(kvstore: str | KVStore | None = None, *, update_on_kvstore: bool | None = None,
                    devices: Sequence[Device] | int = 1, processes: int = 1,
                    strategy: str | type[Strategy] | Strategy | None = None) -> Strategy:
    """A new strategy for these options (see :func:`choose_strategy`), not attached to a trainer yet; a given
    instance is used itself while unattached (a copy of its kind otherwise: a trainer that builds again)."""
    name = choose_strategy(kvstore, update_on_kvstore=update_on_kvstore, devices=devices, processes=processes,
                           strategy=strategy)
    if isinstance(strategy, Strategy):
        return strategy if strategy._ctx is None else type(strategy)(kvstore)
    return STRATEGIES.get(name)(kvstore)
