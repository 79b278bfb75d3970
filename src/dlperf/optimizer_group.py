"""Several optimizers seen as one, so that one learning-rate scheduler drives them all.

A Trainer keeps one optimizer per replica, and a KVStore that updates keeps one per key (MXNet's
store keeps one optimizer for every key). A torch scheduler takes one optimizer and changes the
``lr`` of its ``param_groups``; :class:`OptimizerGroup` lists the members' groups (the same
dictionaries, looked up on every access), so a change made through it is a change of every member.

>>> import torch
>>> a, b = (torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0) for _ in range(2))
>>> group = OptimizerGroup(lambda: [a, b], "two replicas")
>>> scheduler = torch.optim.lr_scheduler.StepLR(group, step_size=1, gamma=0.5)
>>> group.mark_stepped()  # the owner stepped its members
>>> scheduler.step()
>>> a.param_groups[0]["lr"], b.param_groups[0]["lr"]
(0.5, 0.5)
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .errors import UsageError

__all__ = ["OptimizerGroup"]


class OptimizerGroup(torch.optim.Optimizer):
    """The members' ``param_groups`` as one optimizer's: for learning-rate schedulers and ``lr`` changes.

    Args:
        members: returns the member optimizers, asked on every access (a store adds one per key).
        what: what the members are, for ``repr`` and messages (``"the store's keys"``).

    ``step()`` steps every member; the owner (a Trainer, a store) steps them itself and calls
    :meth:`mark_stepped`, which is what a scheduler checks before its first step.
    """

    def __init__(self, members: Callable[[], Sequence[torch.optim.Optimizer]], what: str) -> None:
        # Optimizer.__init__ would make groups of its own: these are the members'. The hook tables are
        # what Optimizer's other methods expect to find.
        self._members = members
        self.what = what
        self.defaults: dict[str, Any] = {}
        for table in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                      "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                      "_optimizer_load_state_dict_post_hooks"):
            setattr(self, table, OrderedDict())

    @property
    def members(self) -> list[torch.optim.Optimizer]:
        """The optimizers this group stands for."""
        return list(self._members())

    @property  # a live view, not a list of its own
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for opt in self._members() for g in opt.param_groups]

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:  # type: ignore[override]
        merged: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        for opt in self._members():
            merged.update(opt.state)
        return merged

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Step every member (their owner usually does; see :meth:`mark_stepped`)."""
        for opt in self._members():
            opt.step()

    def mark_stepped(self) -> None:
        """Record that the members have stepped, as a scheduler's wrapper of ``step()`` would."""
        self._opt_called = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise UsageError(f"this optimizer stands for {self.what}; add parameters to the model or store itself, "
                         "not to the group of its optimizers")

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"members": [opt.state_dict() for opt in self._members()]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        members = self.members
        saved = state_dict.get("members") if isinstance(state_dict, dict) else None
        if not isinstance(saved, list) or len(saved) != len(members):
            count = len(saved) if isinstance(saved, list) else "no"
            raise UsageError(f"the state holds {count} member optimizers but {self.what} have {len(members)}; "
                             "load a state_dict() of an optimizer group over the same members")
        for opt, state in zip(members, saved):
            opt.load_state_dict(state)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"an optimizer group over {self.what} is a view; save its state_dict() instead")

    def __repr__(self) -> str:
        lrs = sorted({g["lr"] for g in self.param_groups if isinstance(g.get("lr"), (int, float))})
        shown = ", ".join(f"{lr:g}" for lr in lrs[:4]) + (", ..." if len(lrs) > 4 else "")
        return f"OptimizerGroup({self.what}: {len(self.members)} optimizers, lr {shown or '-'})"
