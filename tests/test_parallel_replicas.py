"""broadcast_parameters and broadcast_buffers: the first replica's tensors copied into every other one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dlperf.devices import cpu
from dlperf.errors import UsageError
from dlperf.parallel import broadcast_buffers, broadcast_parameters, max_replica_difference, replicate


def _replicas():
    torch.manual_seed(0)
    reps = replicate(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)), [cpu(0), cpu(1), cpu(0)])
    with torch.no_grad():
        for r in reps[1:]:
            for t in [*r.parameters(), *r.buffers()]:
                t.copy_(torch.randn(t.shape).to(t.dtype) if t.is_floating_point() else t + 5)
    return reps


def test_broadcast_parameters_copies_parameters_only():
    reps = _replicas()
    broadcast_parameters(reps)
    assert max_replica_difference(reps) == 0.0
    for r in reps[1:]:
        assert all(a is not b for a, b in zip(reps[0].parameters(), r.parameters()))
        assert not torch.equal(reps[0][1].running_mean, r[1].running_mean)


def test_broadcast_buffers_copies_buffers_only():
    reps = _replicas()
    broadcast_buffers(reps)
    for r in reps[1:]:
        for a, b in zip(reps[0].buffers(), r.buffers()):
            assert torch.equal(a, b) and a is not b
    assert max_replica_difference(reps) > 0.0


@pytest.mark.parametrize("broadcast", [broadcast_parameters, broadcast_buffers])
def test_replicas_of_different_structure_are_refused(broadcast):
    reps = [nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)), nn.Sequential(nn.Linear(4, 3))]
    with pytest.raises(UsageError, match="replicas differ in structure"):
        broadcast(reps)
