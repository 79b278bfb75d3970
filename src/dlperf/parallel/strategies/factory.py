"""The one factory: which gradient synchronization strategy a set of options means, or why none does.

The Trainer, :class:`~dlperf.parallel.training.TrainConfig` and ``dlperf launch`` all ask
:func:`choose_strategy`, so the rule is written once: a distributed store (its class says so, see
:func:`~dlperf.parallel.servers.is_dist_kvstore`) needs several processes and means parameter servers;
a local store aggregates one process's devices only; across processes without a store the buckets are
summed by allreduce, on host memory.

>>> choose_strategy(devices=2), choose_strategy("local", devices=2, update_on_kvstore=True)
('allreduce', 'update-on-kvstore')
>>> choose_strategy("local", processes=2, cli=True)
Traceback (most recent call last):
  ...
dlperf.errors.UsageError: --kvstore local with 2 processes: the local stores aggregate one process's devices only; \
use --kvstore dist_sync, or drop --kvstore (gradients are then summed across processes by allreduce)
"""

from __future__ import annotations

from collections.abc import Sequence

from ...devices import Device
from ...errors import UsageError
from ...kvstore import KVStore
from ..servers import is_dist_kvstore
from ..trainer_config import check_update_on_kvstore
from .strategy import STRATEGIES, Strategy

__all__ = ["choose_strategy", "create_strategy"]


def _spell(cli: bool, kvstore: str | KVStore | None) -> str:
    if cli:
        return f"--kvstore {kvstore}"
    return f"kvstore={kvstore!r}"


def choose_strategy(kvstore: str | KVStore | None = None, *, update_on_kvstore: bool | None = None,
                    devices: Sequence[Device] | int = 1, processes: int = 1, num_servers: int = 0,
                    cli: bool = False) -> str:
    """The registered name of the strategy for these options; one :class:`UsageError` line when they conflict.

    Args:
        kvstore: a store type name, a store, or None (allreduce).
        update_on_kvstore: the store runs the optimizer (``None``: only a distributed store, which refuses
            ``False``).
        devices: this process's devices (or how many).
        processes: how many processes train together (servers included).
        num_servers: ranks that are parameter servers (``dlperf launch --num-servers``).
        cli: name the options as ``dlperf train`` spells them in messages (``--kvstore local``).
    """
    distributed = kvstore is not None and is_dist_kvstore(kvstore)
    where = _spell(cli, kvstore)
    dist_choice = "--kvstore dist_sync" if cli else "'dist_sync' or 'dist_device_sync'"
    if num_servers and not distributed:
        raise UsageError(f"--num-servers {num_servers} with train --kvstore {kvstore}: parameter servers serve a "
                         "distributed store; add --kvstore dist_sync to train, or drop --num-servers")
    check_update_on_kvstore(kvstore, update_on_kvstore)
    count = devices if isinstance(devices, int) else len(devices)
    if processes > 1:
        if kvstore is not None and not distributed:
            raise UsageError(f"{where} with {processes} processes: the local stores aggregate one process's devices "
                             f"only; use {dist_choice}, or drop {'--kvstore' if cli else 'the kvstore'} (gradients "
                             "are then summed across processes by allreduce)")
        if not isinstance(devices, int) and any(d.is_gpu for d in devices):
            raise UsageError(f"devices {list(devices)} with {processes} processes: gradients are summed across "
                             "processes by gloo on host memory; use CPU devices")
        return "parameter-servers" if distributed else "processes"
    if distributed:
        fix = "add --nproc-per-node 2, or use --kvstore local" if cli else \
            "start the processes with dlperf launch or torchrun, or use kvstore='local'"
        raise UsageError(f"{where} in one process: a distributed store needs several; {fix}")
    if kvstore is None:
        return "one-device" if count == 1 else "allreduce"
    return "update-on-kvstore" if update_on_kvstore else "kvstore"


def create_strategy(kvstore: str | KVStore | None = None, *, update_on_kvstore: bool | None = None,
                    devices: Sequence[Device] | int = 1, processes: int = 1) -> Strategy:
    """A new strategy for these options (see :func:`choose_strategy`), not attached to a trainer yet."""
    name = choose_strategy(kvstore, update_on_kvstore=update_on_kvstore, devices=devices, processes=processes)
    return STRATEGIES.get(name)(kvstore)
