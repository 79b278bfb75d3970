"""export()/load(): round trips for every zoo model, and one clear error for any damaged export."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from dlperf.errors import DlperfError
from dlperf.hybrid import FORMAT_VERSION, ExportedModule, export, hybridize, load
from dlperf.hybrid.export import ExportFormatError
from dlperf.models import get_spec, model_names

HEAVY = {"fcn-s", "alexnet-s", "resnet-50"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n
                                  for n in model_names()])
def test_round_trip_every_zoo_model(name, tmp_path):
    torch.manual_seed(0)
    spec = get_spec(name)
    model = spec.build().eval()
    g = torch.Generator().manual_seed(1)
    x, _ = spec.input.make_batch(2, generator=g)
    export(model, tmp_path, (x,))
    loaded = load(tmp_path)
    assert isinstance(loaded, ExportedModule)
    with torch.no_grad():
        for n in (2, 3):  # another batch size too: the batch dimension is exported as dynamic
            fresh, _ = spec.input.make_batch(n, generator=g)
            torch.testing.assert_close(loaded(fresh), model(fresh), rtol=1e-5, atol=1e-6)


@pytest.fixture()
def mlp_export(tmp_path):
    torch.manual_seed(0)
    model = get_spec("mlp").build().eval()
    export(model, tmp_path, (torch.randn(1, 512),))
    return model, tmp_path


def test_graph_json_is_human_readable(mlp_export):
    _, path = mlp_export
    doc = json.loads((path / "graph.json").read_text())
    assert doc["format"] == "dlperf-graph" and doc["format_version"] == FORMAT_VERSION
    assert doc["inputs"] == [{"name": "input", "shape": [None, 512], "dtype": "float32"}]
    ops = [n["op"] for n in doc["nodes"]]
    assert ops == ["aten.linear.default", "aten.relu.default"] * 2 + ["aten.linear.default"]
    first = doc["nodes"][0]
    assert first["shape"] == [None, 256] and first["dtype"] == "float32"
    assert {"node": doc["inputs"][0]["name"]} in first["inputs"]
    assert sorted(os.listdir(path)) == ["graph.json", "params.safetensors"]  # no temp files left


def test_load_runs_without_the_model_code(mlp_export):
    model, path = mlp_export
    x = torch.randn(4, 512)
    torch.save(x, path / "x.pt")
    with torch.no_grad():
        torch.save(model(x), path / "y.pt")
    script = (
        "import sys, torch\n"
        "from dlperf.hybrid import load\n"
        f"m = load({str(path)!r})\n"
        f"x = torch.load({str(path / 'x.pt')!r}); y = torch.load({str(path / 'y.pt')!r})\n"
        "assert 'dlperf.models' not in sys.modules\n"
        "with torch.no_grad(): torch.testing.assert_close(m(x), y)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_hybridized_module_exports_and_loaded_module_hybridizes(tmp_path):
    model = get_spec("lenet").build().eval()
    net = hybridize(model, backend="graph")
    x = torch.randn(2, 1, 28, 28)
    export(net, tmp_path, (x,))
    again = hybridize(load(tmp_path), backend="graph")
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x))


def test_export_keeps_the_training_mode(tmp_path):
    model = get_spec("resnet-56").build().train()
    export(model, tmp_path, (torch.randn(2, 3, 32, 32),))
    assert model.training


def _damage(path, name, how):
    f = path / name
    data = f.read_bytes()
    if how == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        pos = len(data) - 10
        f.write_bytes(data[:pos] + bytes([data[pos] ^ 1]) + data[pos + 1:])
    elif how == "delete":
        f.unlink()


@pytest.mark.parametrize("name,how,match", [
    ("params.safetensors", "truncate", "checksum"),
    ("params.safetensors", "flip", "checksum"),
    ("params.safetensors", "delete", "missing params.safetensors"),
    ("graph.json", "truncate", "not a readable JSON graph"),
    ("graph.json", "delete", "missing graph.json"),
])
def test_damaged_export_gives_one_clear_error(mlp_export, name, how, match):
    _, path = mlp_export
    _damage(path, name, how)
    with pytest.raises(ExportFormatError, match=match):
        load(path)


def test_edited_graph_is_refused(mlp_export):
    _, path = mlp_export
    doc = json.loads((path / "graph.json").read_text())
    doc["nodes"][1]["op"] = "aten.sigmoid.default"
    (path / "graph.json").write_text(json.dumps(doc))
    with pytest.raises(ExportFormatError, match="content checksum"):
        load(path)


def test_unknown_version_is_refused(mlp_export):
    _, path = mlp_export
    doc = json.loads((path / "graph.json").read_text())
    doc["format_version"] = FORMAT_VERSION + 1
    (path / "graph.json").write_text(json.dumps(doc))
    with pytest.raises(ExportFormatError, match=f"format_version {FORMAT_VERSION + 1} is not supported"):
        load(path)


def test_non_aten_operator_is_refused(mlp_export):
    from dlperf.hybrid.export import _content_hash

    _, path = mlp_export
    doc = json.loads((path / "graph.json").read_text())
    doc["nodes"][1]["op"] = "os.system.default"
    doc["content_sha256"] = _content_hash(doc)  # a deliberate, consistent edit
    (path / "graph.json").write_text(json.dumps(doc))
    with pytest.raises(ExportFormatError, match="not an ATen operator"):
        load(path)


def test_wrong_input_is_a_clear_error(mlp_export):
    _, path = mlp_export
    loaded = load(path)
    with pytest.raises(DlperfError, match=r"expected float32\['N', 512\], got float32\[2, 7\]"):
        loaded(torch.randn(2, 7))


def test_missing_directory(tmp_path):
    with pytest.raises(ExportFormatError, match="missing graph.json"):
        load(tmp_path / "nope")


def test_unexportable_model_is_a_dlperf_error(tmp_path):
    class Branchy(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.raises(DlperfError, match="cannot export Branchy"):
        export(Branchy(), tmp_path, (torch.randn(2),))
    assert not os.listdir(tmp_path)


def test_optional_pt2_program(tmp_path):
    from dlperf.hybrid.export import load_pt2

    model = get_spec("lenet").build().eval()
    x = torch.randn(2, 1, 28, 28)
    paths = export(model, tmp_path, (x,), pt2=True)
    assert set(paths) == {"graph", "params", "pt2"}
    with pytest.raises(ExportFormatError, match="can run code embedded.*trusted=True"):
        load_pt2(tmp_path)  # torch.export.load unpickles: never on a file of unknown origin
    program = load_pt2(tmp_path, trusted=True)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), model(x))
    _damage(tmp_path, "model.pt2", "truncate")
    with pytest.raises(ExportFormatError, match="checksum"):
        load_pt2(tmp_path, trusted=True)
    torch.testing.assert_close(load(tmp_path)(x), model(x))  # the JSON graph does not need it


def test_export_into_a_regular_file_is_a_clear_error(tmp_path):
    target = tmp_path / "taken.json"
    target.write_text("{}")
    with pytest.raises(ExportFormatError, match="exists and is not a directory"):
        export(nn.Linear(3, 2), target, (torch.randn(2, 3),))
    assert target.read_text() == "{}"


def test_a_failed_export_leaves_the_previous_export(tmp_path, monkeypatch):
    """The files are written into a temporary directory that replaces the export in one rename:
    a crash anywhere before it leaves the previous export whole, and no temporary behind."""
    import importlib

    import safetensors.torch

    export_mod = importlib.import_module("dlperf.hybrid.export")
    target = tmp_path / "net"
    old, new = nn.Linear(3, 2).eval(), nn.Linear(3, 2).eval()
    x = torch.randn(2, 3)
    export(old, target, (x,))
    before = {p: (target / p).read_bytes() for p in os.listdir(target)}
    real_save = safetensors.torch.save_file

    def crash_mid_write(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(10)  # half-written
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash_mid_write)
    with pytest.raises(OSError, match="disk full"):
        export(new, target, (x,))
    monkeypatch.undo()

    def crash_before_graph(doc):
        raise OSError("killed")

    monkeypatch.setattr(export_mod, "_layout", crash_before_graph)
    with pytest.raises(OSError, match="killed"):
        export(new, target, (x,))
    assert {p: (target / p).read_bytes() for p in os.listdir(target)} == before
    assert os.listdir(tmp_path) == ["net"]  # no temporary directory left
    with torch.no_grad():
        torch.testing.assert_close(load(target)(x), old(x))
