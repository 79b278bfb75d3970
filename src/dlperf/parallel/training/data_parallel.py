"""DataParallel: a module wrapper whose forward splits the batch and runs on k devices at once.

The first replica is the wrapped module itself (on ``devices[0]``); the others share its parameters (logical CPU
devices) or use differentiable copies (GPUs), so gradients flow back into the original parameters. The
per-device forwards are engine operations. Replicas and backward: docs/design/engine.md.

>>> import torch
>>> from torch import nn
>>> from dlperf.devices import cpu, device_of
>>> seen = []  # the workers run at once: collect what each saw, then sort
>>> class Record(nn.Module):
...     def __init__(self, m):
...         super().__init__()
...         self.m = m
...     def forward(self, x):
...         seen.append((tuple(x.shape), str(device_of(x))))
...         return self.m(x)
>>> with DataParallel(Record(nn.Linear(10, 5)), [cpu(0), cpu(1)], threads=[1, 1]) as dp:
...     y = dp(torch.randn(50, 10))
>>> sorted(seen), tuple(y.shape), device_of(y)
([((25, 10), 'cpu(0)'), ((25, 10), 'cpu(1)')], (50, 5), cpu(0))
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...batch import batch_size, call_model, gather_tree, map_tensors
from ...devices import Device, DeviceLike, device_of, num_gpus, tag, try_all_gpus
from ...engine import Engine, create_engine, wait_ops
from ...errors import DeviceMismatchError, UsageError
from ..split import check_devices, place_parts, split_sizes

__all__ = ["DataParallel"]


def _skeleton(module: nn.Module, device: Device) -> nn.Module:
    """A copy of ``module`` on ``device`` whose parameter slots are plain attributes, set per forward."""
    rep = copy.deepcopy(module).to(device.torch_device)
    tag(rep, device)
    for sub in rep.modules():
        for name in list(sub._parameters):
            p = sub._parameters.pop(name)
            object.__setattr__(sub, name, None if p is None else p.detach())
    return rep


class DataParallel(nn.Module):
    """Wrap ``module`` so that ``dp(x)`` runs the parts of ``x`` on every device concurrently.

    Inputs may be tensors or tuples, lists and dicts of them, of any dtype (``dp(ids, mask)``,
    ``dp({"ids": ids})``): every tensor is split along dim 0, plain values go to every device. The
    output is the parts' outputs joined along dim 0 on ``devices[0]``, in the structure the module
    returns (:func:`dlperf.batch.gather_tree`: a dict of tensors comes back a dict). ``devices`` defaults,
    as in ``torch.nn.DataParallel``, to every GPU; on a machine without GPUs to the logical CPU
    device the module is on, alone (name ``try_all_gpus(k)`` to run on k devices anywhere). A batch
    that does not divide evenly is split as evenly as it can be. ``threads``: intra-op threads per
    CPU device (equal numbers: the engine gives every CPU worker one budget); ``engine``: run on this
    engine instead of one of its own (then ``threads`` must be left out).
    """

    def __init__(self, module: nn.Module, devices: Sequence[DeviceLike] | None = None,
                 threads: Sequence[int] | None = None, engine: Engine | None = None):
        super().__init__()
        if devices is None:
            devices = try_all_gpus() if num_gpus() else [device_of(module)]
        devs = check_devices(devices)
        have = device_of(module)
        if have != devs[0]:
            raise DeviceMismatchError(f"the module is on {have} but devices[0] is {devs[0]}; "
                                      f"move it first: module = dlperf.as_in(module, {devs[0]})")
        self.module = module
        self.devices = devs
        self._replicas = [None] + [_skeleton(module, d) for d in devs[1:]]
        self._names = [name for name, _ in module.named_parameters(remove_duplicate=False)]
        if engine is not None and threads is not None:
            raise UsageError("DataParallel got both threads= and engine=; the engine's workers have their own "
                             "thread budget: pass one of them")
        if threads is not None and (len(set(threads)) != 1 or len(threads) != len(devs)):
            raise UsageError(f"threads={list(threads)!r} is not valid; expected one equal integer per device "
                             f"({len(devs)} devices), e.g. threads=[1, 1]")
        self._own_engine = engine is None
        self.engine = engine if engine is not None else create_engine(
            "threaded", cpu_threads=None if threads is None else int(threads[0]))

    def _bind(self, i: int) -> nn.Module:
        if i == 0:
            return self.module
        rep, dev = self._replicas[i], self.devices[i]
        if rep is None:  # only the first slot is empty: the module itself
            raise RuntimeError(f"DataParallel has no replica {i}")
        for name, p in self.module.named_parameters(remove_duplicate=False):
            owner_name, _, attr = name.rpartition(".")
            owner = rep.get_submodule(owner_name) if owner_name else rep
            # same memory: use the parameter itself; else a copy whose backward returns to it
            value = p if p.device == dev.torch_device else p.to(dev.torch_device, non_blocking=True)
            object.__setattr__(owner, attr, value)
        rep.train(self.module.training)
        return rep

    def forward(self, *inputs: Any) -> Any:
        """``module(*inputs)``, each device on its part of every input (tensors or structures of them)."""
        # one tensor (the common case) is cut directly; a part that is a tensor is the replica's one input
        batch = inputs[0] if len(inputs) == 1 and isinstance(inputs[0], torch.Tensor) else inputs
        n = batch_size(batch, "input")
        k = min(len(self.devices), n)
        parts = place_parts(batch, self.devices[:k], split_sizes(n, k))
        grad_on = torch.is_grad_enabled()

        def run(i: int):
            def task() -> Any:
                with torch.set_grad_enabled(grad_on):  # grad mode is per thread
                    return call_model(self._bind(i), parts[i])
            return task

        ops = [self.engine.push(run(i), device=self.devices[i], name=f"forward {self.devices[i]}")
               for i in range(len(parts))]
        outs = wait_ops(ops)  # all of them, even after a failure: none may still run when we return
        first = self.devices[0].torch_device
        if all(isinstance(o, torch.Tensor) and o.dim() > 0 for o in outs):
            return tag(torch.cat([o.to(first, non_blocking=True) for o in outs], dim=0), self.devices[0])
        joined = gather_tree(outs, move=lambda t: t.to(first, non_blocking=True))
        return map_tensors(lambda t: tag(t, self.devices[0]), joined)

    def close(self) -> None:
        """Stop the engine's worker threads (an engine passed in is left to its owner)."""
        if self._own_engine:
            self.engine.close()

    def __enter__(self) -> DataParallel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
