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


@pytest.mark.subprocess
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
    from dlperf.hybrid.export_format import content_hash

    _, path = mlp_export
    doc = json.loads((path / "graph.json").read_text())
    doc["nodes"][1]["op"] = "os.system.default"
    doc["content_sha256"] = content_hash(doc)  # a deliberate, consistent edit
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

    monkeypatch.setattr(export_mod, "layout_of", crash_before_graph)
    with pytest.raises(OSError, match="killed"):
        export(new, target, (x,))
    assert {p: (target / p).read_bytes() for p in os.listdir(target)} == before
    assert os.listdir(tmp_path) == ["net"]  # no temporary directory left
    with torch.no_grad():
        torch.testing.assert_close(load(target)(x), old(x))


# --- hostile exports: the attacker recomputes every checksum -------------------------------------

def _rewrite(path, edit):
    """Apply ``edit`` to graph.json as an attacker would: checksums recomputed, so only validation stops it."""
    from dlperf.hybrid.export_format import content_hash

    doc = json.loads((path / "graph.json").read_text())
    edit(doc)
    if isinstance(doc, dict):
        doc["content_sha256"] = content_hash(doc)
    (path / "graph.json").write_text(json.dumps(doc))


def _aten_snapshot():
    return set(vars(torch.ops.aten)), torch.ops.aten.add, torch.ops.aten.linear.default, torch.ops.aten.relu


def _set_node(i, key, value):
    def edit(doc):
        doc["nodes"][i][key] = value
    return edit


@pytest.mark.parametrize("edit", [
    # the two payloads that used to run: overwrite an attribute of torch.ops.aten with a module, then call it
    _set_node(1, "op", "aten.__setattr__.__call__"),
    lambda d: d["nodes"][1].update(op="aten.__setattr__.__call__",
                                   inputs=["relu", {"dtype": "os"}], kwargs={}),
    lambda d: d["nodes"][1].update(op="aten.relu.system", inputs=["touch CANARY"]),
    _set_node(1, "op", "aten.relu.__call__"),
    _set_node(1, "op", "aten._ops.default"),
    _set_node(1, "op", "aten.save.default"),  # a TorchScript builtin that writes files
    _set_node(1, "op", "aten.from_file.default"),  # a dispatcher op that reads files
    _set_node(1, "op", "aten.relu.default.__globals__"),
    _set_node(1, "op", "operator.attrgetter"),
    lambda d: d["nodes"][1]["inputs"].append({"dtype": "__builtins__"}),
    lambda d: d["nodes"][1]["inputs"].append({"layout": "os"}),
    lambda d: d["nodes"][1]["inputs"].append({"memory_format": "__class__"}),
    lambda d: d["nodes"][1]["inputs"].append({"device": "cpu; rm -rf /"}),
    lambda d: d["inputs"][0].update(dtype="os"),
], ids=["setattr", "setattr-os", "system", "dunder-overload", "private-op", "jit-save", "from-file",
        "attr-path", "operator-table", "dtype-builtins", "layout-os", "memory-format-dunder", "device-string",
        "input-dtype"])
def test_crafted_names_are_refused_without_side_effects(mlp_export, monkeypatch, edit):
    _, path = mlp_export
    monkeypatch.chdir(path)  # where a "touch CANARY" payload would write
    before = _aten_snapshot()
    _rewrite(path, edit)
    with pytest.raises(ExportFormatError):
        load(path)
    assert not (path / "CANARY").exists()
    assert _aten_snapshot() == before


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["nodes"][1]["inputs"].__setitem__(0, {"node": "nowhere"}),
     r"nodes\[1\] \(relu\)\.inputs\[0\].*'nowhere'"),
    (lambda d: d["nodes"][0]["inputs"].__setitem__(0, {"node": d["nodes"][2]["name"]}),
     "not an input, parameter or earlier"),
    (lambda d: d["files"].pop("params.safetensors"), "files"),
    (lambda d: d["files"]["params.safetensors"].update(bytes="12"), "bytes"),
    (lambda d: d["nodes"][0].update(shape="[null, 256]"), r"nodes\[0\].*shape"),
    (lambda d: d["nodes"][0].update(inputs={"0": 1}), r"inputs.*expected an array"),
    (lambda d: d["nodes"][0].update(kwargs=[]), "kwargs"),
    (lambda d: d["inputs"][0].update(shape=[None, 1 << 40]), "inputs.*dimension"),
    (lambda d: d["inputs"][0].update(shape=[None, 1 << 20, 1 << 20]), "more than"),
    (lambda d: next(iter(d["state"].values())).update(tensor="ghost"), "tensor 'ghost' is missing"),
    (lambda d: next(iter(d["state"].values())).update(shape=[3, 3]), "parameter file.*graph.json says"),
    (lambda d: d["nodes"][0].update(shape=[None, 255]),
     r"node 'linear' \(aten.linear.default\) gives float32\[2, 256\]"),
    (lambda d: d["nodes"][0].update(dtype="float64"), "trial run|graph.json records"),
    (lambda d: d["nodes"][1].update(op="aten.conv2d.default"), "node 'relu' .* fails in the trial run"),
    (lambda d: d["nodes"].append(d["nodes"][0]), "defined twice"),
    (lambda d: d["nodes"].__setitem__(slice(None), [{}] * 200_000), "nodes"),
    (lambda d: d.update(extra=1), "unknown"),
    (lambda d: d["outputs"].__setitem__(0, {"node": "linear_2", "dtype": "float32"}), "outputs"),
    (lambda d: d["nodes"][1]["inputs"].append([[[[[[[[1]]]]]]]]), "nests deeper"),
    (lambda d: d["nodes"][1]["inputs"].append(1 << 70), "64 bits"),
], ids=["dangling", "forward-ref", "no-file-entry", "bytes-type", "shape-type", "inputs-type", "kwargs-type",
        "huge-dim", "huge-product", "missing-tensor", "param-shape", "recorded-shape", "recorded-dtype",
        "wrong-op", "duplicate-node", "node-count", "unknown-field", "bad-encoding", "deep-nesting", "huge-int"])
def test_malformed_graph_is_refused_at_load(mlp_export, edit, match):
    _, path = mlp_export
    _rewrite(path, edit)
    with pytest.raises(ExportFormatError, match=match):
        load(path)


def test_params_with_other_shapes_are_refused_even_with_matching_checksums(mlp_export):
    from safetensors.torch import save_file

    from dlperf.hybrid.export_format import sha256_file

    _, path = mlp_export
    names = [v["tensor"] for v in json.loads((path / "graph.json").read_text())["state"].values()]
    save_file({name: torch.zeros(2, 2) for name in names}, str(path / "params.safetensors"))
    digest, size = sha256_file(str(path / "params.safetensors")), (path / "params.safetensors").stat().st_size
    _rewrite(path, lambda d: d["files"]["params.safetensors"].update(sha256=digest, bytes=size))
    with pytest.raises(ExportFormatError,
                       match=r"tensor '0.weight' is float32\[2, 2\], graph.json says float32\[256, 512\]"):
        load(path)


def test_special_files_are_refused_without_reading(mlp_export):
    _, path = mlp_export
    (path / "params.safetensors").unlink()
    os.symlink("/dev/zero", path / "params.safetensors")  # would hash forever
    with pytest.raises(ExportFormatError, match="missing params.safetensors|not a regular file"):
        load(path)


def test_json_edge_cases_are_one_error(mlp_export):
    _, path = mlp_export
    graph = path / "graph.json"
    for text in ["[" * 100_000, '{"format": "dlperf-graph", "format": "x"}', '{"a": NaN}', "1" * 5000, "[]"]:
        graph.write_text(text)
        with pytest.raises(ExportFormatError):
            load(path)


def test_a_graph_that_passes_gives_the_model_results(mlp_export):
    """A semantic-preserving edit (another spelling of the same computation) loads and runs correctly."""
    model, path = mlp_export
    _rewrite(path, _set_node(1, "op", "aten.relu_.default"))
    x = torch.randn(3, 512)
    with torch.no_grad():
        torch.testing.assert_close(load(path)(x), model(x))


# --- atomic export ------------------------------------------------------------------------------

def test_export_files_have_the_usual_mode(tmp_path):
    umask = os.umask(0o022)
    try:
        export(nn.Linear(3, 2), tmp_path / "net", (torch.randn(2, 3),), pt2=True)
    finally:
        os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [tmp_path / "net", *(tmp_path / "net").iterdir()]}
    assert modes == {"net": 0o755, "graph.json": 0o644, "params.safetensors": 0o644, "model.pt2": 0o644}


def test_export_refuses_a_directory_with_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ExportFormatError, match="holds 'notes.txt'.*new or empty directory"):
        export(nn.Linear(3, 2), tmp_path, (torch.randn(2, 3),))
    assert os.listdir(tmp_path) == ["notes.txt"]


_KILLER = r"""
import importlib, os, signal, sys
import torch
from torch import nn
from dlperf.hybrid import export

import dlperf._io as io

target, point = sys.argv[1], sys.argv[2]


def die(*_):
    os.kill(os.getpid(), signal.SIGKILL)


def after(fn):
    def wrapped(*a, **kw):
        result = fn(*a, **kw)
        die()
    return wrapped


if point == "before-swap":
    io._swap_directory = die
elif point == "after-exchange":
    io._exchange = after(io._exchange)
elif point == "between-renames":  # the fallback for systems without renameat2(RENAME_EXCHANGE)
    io._renameat2 = None
    real_rename, calls = os.rename, []

    def rename(a, b):
        calls.append(b)
        if len(calls) == 2:
            die()
        real_rename(a, b)

    os.rename = rename
torch.manual_seed(1)
model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
print("ready", flush=True)
while True:
    export(model, target, (torch.randn(2, 3),))
"""


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).eval()


def _kill_during_export(tmp_path, point, delay=0.0):
    import random
    import time

    target = tmp_path / "net"
    proc = subprocess.Popen([sys.executable, "-c", _KILLER, str(target), point], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"ready\n"
        if point == "random":
            time.sleep(random.uniform(0, delay))
            proc.kill()
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == -9


@pytest.mark.subprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("point", ["before-swap", "after-exchange", "between-renames"])
def test_sigkill_at_each_step_of_the_swap_leaves_a_loadable_export(tmp_path, point):
    target = tmp_path / "net"
    old, new = _model(0), _model(1)
    x = torch.randn(5, 3)
    export(old, target, (x,))
    _kill_during_export(tmp_path, point)
    with torch.no_grad():
        got = load(target)(x)  # the previous export, or the complete new one
        want = new(x) if point == "after-exchange" else old(x)
        torch.testing.assert_close(got, want)
        export(old, target, (x,))  # the next export cleans up after the dead one
        assert os.listdir(tmp_path) == ["net"]
        torch.testing.assert_close(load(target)(x), old(x))


def _random_kills(tmp_path, rounds):
    target = tmp_path / "net"
    old, new = _model(0), _model(1)
    x = torch.randn(5, 3)
    export(old, target, (x,))
    for _ in range(rounds):
        _kill_during_export(tmp_path, "random", delay=0.5)
        with torch.no_grad():
            got = load(target)(x)
            assert torch.equal(got, old(x)) or torch.equal(got, new(x))
    export(old, target, (x,))
    assert os.listdir(tmp_path) == ["net"]


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_sigkill_at_random_moments_leaves_a_loadable_export(tmp_path):
    _random_kills(tmp_path, 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_at_random_moments_many_times(tmp_path):
    _random_kills(tmp_path, 15)


class _AddBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x + self.b


@pytest.mark.parametrize("inputs, written", [(None, "x"), ("swap", "p_b")], ids=["input", "parameter"])
def test_a_graph_that_writes_into_its_inputs_or_parameters_is_refused(tmp_path, inputs, written):
    export(_AddBias(), tmp_path, (torch.zeros(4),), dynamic_batch=False)

    def in_place(doc):
        node = doc["nodes"][0]
        node["op"] = "aten.add_.Tensor"
        if inputs == "swap":
            node["inputs"].reverse()

    _rewrite(tmp_path, in_place)
    with pytest.raises(ExportFormatError, match=f"write into '{written}'"):
        load(tmp_path)


def test_a_graph_that_only_works_when_the_batch_equals_a_fixed_size_is_refused(mlp_export):
    """linear with the batch-sized linear_1 as its weight and a bias of [2] broadcasts only when
    N == 2, the output size: the trial also runs at a batch size equal to no fixed dimension."""
    _, path = mlp_export
    _rewrite(path, lambda d: d["nodes"][-1]["inputs"].__setitem__(1, {"node": "linear_1"}))
    with pytest.raises(ExportFormatError, match=r"node 'linear_2' .* fails in the trial run.*dynamic dimensions "
                                                r"of size 11"):
        load(path)


def test_decoded_values_come_from_tables_of_torch_values():
    import importlib

    ex = importlib.import_module("dlperf.hybrid.export_format")
    assert ex.DTYPES_BY_NAME["float32"] is torch.float32 and ex.DTYPES_BY_NAME["int64"] is torch.int64
    assert all(isinstance(v, torch.dtype) for v in ex.DTYPES_BY_NAME.values())
    assert ex._LAYOUTS == {"strided": torch.strided}
    assert ex._MEMORY_FORMATS["channels_last"] is torch.channels_last
    assert all(isinstance(v, torch.memory_format) for v in ex._MEMORY_FORMATS.values())
    assert not {"os", "__builtins__", "__class__", "Tensor"} & (set(ex.DTYPES_BY_NAME) | set(ex._MEMORY_FORMATS))


# --- non-finite weights and full disks -------------------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_parameters_are_refused_before_anything_is_written(tmp_path, value):
    model = nn.Linear(3, 2)
    with torch.no_grad():
        model.weight[1, 2] = value
    with pytest.raises(DlperfError, match=r"parameter 'weight' holds 1 non-finite value \(of 6\)"):
        export(model, tmp_path / "net", (torch.randn(2, 3),))
    assert os.listdir(tmp_path) == []


def test_nan_buffers_are_refused_and_infinite_masks_kept(tmp_path):
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mask", torch.tensor([0.0, float("-inf"), 0.0]))

        def forward(self, x):
            return torch.softmax(x + self.mask, dim=-1)

    model = Masked().eval()
    x = torch.randn(2, 3)
    export(model, tmp_path / "ok", (x,))
    torch.testing.assert_close(load(tmp_path / "ok")(x), model(x))
    model.mask[0] = float("nan")
    with pytest.raises(DlperfError, match="buffer 'mask' holds 1 NaN value"):
        export(model, tmp_path / "nan", (x,))


class _DiskFull(Exception):
    """What safetensors raises on ENOSPC: not an OSError, only the text says it."""


def _previous_export(tmp_path):
    target = tmp_path / "net"
    old = nn.Linear(3, 2).eval()
    x = torch.randn(2, 3)
    export(old, target, (x,))
    return target, old, x, {p: (target / p).read_bytes() for p in os.listdir(target)}


def _assert_kept(tmp_path, target, old, x, before):
    assert {p: (target / p).read_bytes() for p in os.listdir(target)} == before
    assert os.listdir(tmp_path) == ["net"]  # no temporary directory left
    with torch.no_grad():
        torch.testing.assert_close(load(target)(x), old(x))


def _fail_with(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


@pytest.mark.parametrize("where", ["params", "graph", "pt2"])
def test_a_full_disk_is_one_line_with_the_space_needed(tmp_path, monkeypatch, where):
    import errno
    import importlib

    import safetensors.torch

    from dlperf._io import FileAccessError

    export_mod = importlib.import_module("dlperf.hybrid.export")
    target, old, x, before = _previous_export(tmp_path)
    if where == "params":
        text = 'IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        monkeypatch.setattr(safetensors.torch, "save_file", _fail_with(_DiskFull(text)))
    elif where == "graph":
        monkeypatch.setattr(export_mod, "layout_of", _fail_with(OSError(errno.ENOSPC, "No space left on device")))
    else:  # torch's zip writer says only "unexpected pos": the free space tells
        monkeypatch.setattr(torch.export, "save", _fail_with(RuntimeError("[enforce fail] unexpected pos 64")))
        monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((4096, 4096, 100, 10, 10, 0, 0, 0, 0, 255)))
    with pytest.raises(FileAccessError) as info:
        export(nn.Linear(3, 2), target, (x,), pt2=where == "pt2")
    message = str(info.value)
    assert "\n" not in message and info.value.errno == errno.ENOSPC
    assert message.startswith(f"cannot write {target}: no space left on the device for about ")
    assert "the previous export is kept); free some space or write elsewhere" in message
    if where == "pt2":  # the free space it was judged by is named
        assert "(40960 bytes free there, the previous export is kept)" in message
    monkeypatch.undo()
    _assert_kept(tmp_path, target, old, x, before)


def test_other_write_failures_are_not_called_a_full_disk(tmp_path, monkeypatch):
    import safetensors.torch

    target, old, x, before = _previous_export(tmp_path)
    monkeypatch.setattr(safetensors.torch, "save_file", _fail_with(_DiskFull("permission denied")))
    with pytest.raises(_DiskFull):
        export(nn.Linear(3, 2), target, (x,))
    monkeypatch.undo()
    _assert_kept(tmp_path, target, old, x, before)


@pytest.fixture()
def small_filesystem(tmp_path):
    """A 1 MB tmpfs (needs root and a kernel that lets this process mount; skipped otherwise)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True,
                          timeout=30) if os.geteuid() == 0 else None
    if done is None or done.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root and mount permission)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=30)


@pytest.mark.parametrize("pt2", [False, True])
def test_a_real_full_file_system_keeps_the_previous_export(small_filesystem, pt2):
    from dlperf._io import FileAccessError

    target, old, x, before = _previous_export(small_filesystem)
    big = nn.Linear(3, 200_000)  # 3.2 MB of parameters on a 1 MB file system
    with pytest.raises(FileAccessError, match=r"no space left on the device for about \d+ bytes \(\d+ bytes free"):
        export(big, target, (x,), pt2=pt2)
    _assert_kept(small_filesystem, target, old, x, before)


# --- export writes only what load takes back: the check `dlperf export` makes, made by the API too -----------
class _PinsTheBatch(nn.Module):
    """Traces with a dynamic batch, but ``expand`` to a fixed size pins it: a dynamic export would not load."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x.expand(2, 4))


class _Noisy(nn.Module):
    """A forward no export can reproduce: fresh noise on every call."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x) + torch.rand(x.shape[0], 3)


def test_a_batch_the_graph_pins_is_exported_fixed_and_loads(tmp_path):
    model, x = _PinsTheBatch(), torch.randn(2, 4)
    export(model, tmp_path / "e", (x,))
    loaded = load(tmp_path / "e")
    assert loaded.doc["inputs"][0]["shape"] == [2, 4]
    torch.testing.assert_close(loaded(x), model(x))


@pytest.mark.parametrize("model, named", [(_Noisy(), "its export does not reproduce the model on the example"),
                                          (None, "its export would not load back")])
def test_an_export_load_would_refuse_is_never_written(model, named, tmp_path, monkeypatch):
    import importlib

    export_module = importlib.import_module("dlperf.hybrid.export")  # (the package's `export` is the function)
    x = torch.randn(2, 4)
    export(nn.Linear(4, 3), tmp_path / "e", (x,))
    before = {p.name: p.read_bytes() for p in (tmp_path / "e").iterdir()}
    if model is None:  # whatever load refuses: here, every export
        def refuse(path, device="cpu"):
            raise ExportFormatError(f"{path}: refused in this test")
        monkeypatch.setattr(export_module, "load", refuse)
        model = nn.Linear(4, 3)
    with pytest.raises(DlperfError, match=named) as info:
        export(model, tmp_path / "e", (x,))
    assert "nothing was written" in str(info.value) and "\n" not in str(info.value)
    assert {p.name: p.read_bytes() for p in (tmp_path / "e").iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["e"]  # no staging directory left
