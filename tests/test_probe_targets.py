"""Hardware files (``--hardware``): figures a machine can show are used as given; the name is shown escaped."""

from __future__ import annotations

import json
import re

import pytest

from dlperf.errors import UsageError
from dlperf.probe.targets import read_hardware

GOOD = {"name": "lab box", "flops": {"float32": 1e11}, "memory_bandwidth": 2e10, "dispatch_s": 1e-5,
        "links": {"copy": {"alpha_s": 0, "bandwidth": 1e10}}}


def test_plausible_figures_are_read_as_given(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(GOOD))
    hw = read_hardware(str(path))
    assert hw.name == "lab box" and hw.peak_flops() == 1e11 and hw.memory_bandwidth == 2e10
    assert hw.link("copy").alpha_s == 0 and hw.dispatch_s == 1e-5


def test_the_name_is_escaped(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({**GOOD, "name": "\x1b]0;owned\x07box\nforged"}))
    assert read_hardware(str(path)).name == "\\x1b]0;owned\\x07box\\nforged"


@pytest.mark.parametrize("field, value", [("dispatch_s", 5e-324), ("dispatch_s", 1e6), ("memory_bandwidth", 1e308),
                                          ("memory_bandwidth", 1.0)])
def test_an_implausible_figure_names_its_field(tmp_path, field, value):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({**GOOD, field: value}))
    expected = re.escape(f"hardware='{path}': {field} is {value!r} ") + "[^;]*outside what any machine"
    with pytest.raises(UsageError, match=expected):
        read_hardware(str(path))
