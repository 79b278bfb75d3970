"""What MXNet 1.9.1's test_gluon.py expects of ``gluon.utils.split_data`` and ``split_and_load``, asked of dlperf.

MXNet's check: the slices are as many as asked, and joined along the batch axis they are the data again;
an uneven split with ``even_split=True`` is a ``ValueError``. Uneven parts differ in where the extra rows
go (MXNet: all to the last part; dlperf: one each to the first parts, see docs/mxnet-differences.md).
"""

from __future__ import annotations

import pytest
import torch

from dlperf.devices import cpu, device_of
from dlperf.parallel import split_and_load, split_data


def _check_split_data(x: torch.Tensor, num_slice: int, batch_axis: int, **kwargs) -> list[torch.Tensor]:
    res = split_data(x, num_slice, batch_axis, **kwargs)
    assert len(res) == num_slice
    torch.testing.assert_close(torch.cat(res, dim=batch_axis), x)
    return res


def test_split_data():
    x = torch.rand(128, 33, 64)
    _check_split_data(x, 8, 0)
    _check_split_data(x, 3, 1)
    _check_split_data(x, 4, 1, even_split=False)
    _check_split_data(x, 15, 1, even_split=False)
    with pytest.raises(ValueError, match="cannot split 33 examples evenly across 4 devices"):
        _check_split_data(x, 4, 1)


def test_uneven_parts_differ_by_one_row_at_most():
    sizes = [p.shape[1] for p in _check_split_data(torch.rand(2, 33), 15, 1, even_split=False)]
    assert max(sizes) - min(sizes) == 1 and sum(sizes) == 33  # MXNet's last slice would hold 5 of them


def test_more_slices_than_rows_is_an_error():
    with pytest.raises(ValueError, match="a batch of 3 examples cannot be split across 4 devices"):
        split_data(torch.rand(3, 2), 4, even_split=False)


@pytest.mark.parametrize("batch_axis", [1, -1])
def test_split_and_load_along_another_axis(batch_axis):
    x = torch.arange(24.0).reshape(3, 8)
    devices = [cpu(0), cpu(1)]
    parts = split_and_load(x, devices, batch_axis=batch_axis)
    assert [tuple(p.shape) for p in parts] == [(3, 4), (3, 4)]
    assert [device_of(p) for p in parts] == devices
    torch.testing.assert_close(torch.cat(parts, dim=1), x)


def test_split_and_load_along_another_axis_takes_a_tensor():
    with pytest.raises(ValueError, match="batch_axis=1\\) cuts a tensor, got dict"):
        split_and_load({"x": torch.zeros(2, 4)}, [cpu(0), cpu(1)], batch_axis=1)
    with pytest.raises(ValueError, match="batch_axis=2 is not an axis of a 2-d tensor"):
        split_and_load(torch.zeros(2, 4), [cpu(0), cpu(1)], batch_axis=2)
