"""The user's own models through every verb: a Transformer on token ids, a model taking and returning dicts,
and a CNN with BatchNorm, written as an importable module in a temporary directory, through ``bench
--networks module:factory``, ``profile --input`` (dtypes, several inputs, a batch factory) and ``launch --
python script.py`` (2 processes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from dlperf.batch import describe
from dlperf.cli import main
from dlperf.errors import UsageError
from dlperf.models.inputs import (
    embedding_range,
    make_inputs,
    make_targets,
    parse_tensor_spec,
    resize_batch,
    structured_loss,
)

SRC = str(Path(__file__).resolve().parents[1] / "src")

USER_MODELS = textwrap.dedent('''
    import torch
    from torch import nn

    VOCAB = 50


    class TinyTransformer(nn.Module):
        """Token ids (and their lengths) to 4 classes."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 16)
            layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
            self.head = nn.Linear(16, 4)

        def forward(self, ids, lengths):
            h = self.encoder(self.embed(ids))
            steps = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
            pooled = (h * steps[..., None]).sum(1) / lengths[:, None].clamp(min=1)
            return self.head(pooled)


    class DictModel(nn.Module):
        """A dict of features in, a dict of outputs out."""

        def __init__(self):
            super().__init__()
            self.dense = nn.Linear(8, 6)
            self.cat = nn.Embedding(10, 6)
            self.out = nn.Linear(6, 3)

        def forward(self, batch):
            h = torch.relu(self.dense(batch["x"]) + self.cat(batch["cat"]))
            return {"logits": self.out(h), "score": h.sum(1)}


    def make_transformer():
        return TinyTransformer()


    def make_dict_model():
        return DictModel()


    def make_dict_batch():
        g = torch.Generator().manual_seed(3)
        return {"x": torch.randn(12, 8, generator=g), "cat": torch.randint(0, 10, (12,), generator=g)}


    def make_cnn():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(8 * 4 * 4, 5))
''')


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    (tmp_path / "my_models_e2e.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("my_models_e2e", None)


# --- specs, ranges, targets: checked against plain PyTorch -------------------------------------------------

def test_tensor_specs_parse_dtypes_and_ranges():
    assert parse_tensor_spec("64x3x32x32") == parse_tensor_spec("64x3x32x32:float32")
    spec = parse_tensor_spec("8x5:int64:3-9")
    assert (spec.shape, spec.dtype, spec.low, spec.high) == ((8, 5), torch.int64, 3, 9)
    t = spec.make(torch.Generator().manual_seed(0))
    assert t.dtype == torch.int64 and int(t.min()) >= 3 and int(t.max()) < 9
    assert parse_tensor_spec("4:bool").make(None).dtype == torch.bool
    assert parse_tensor_spec("4x2:bfloat16").make(None).dtype == torch.bfloat16
    for bad, needle in (("4x", "not a shape"), ("4:int65", "names dtype"), ("4:float32:0-3", "ranges are for"),
                        ("4:int8:0-300", "does not fit int8"), ("4:int64:5-5", "LOW < HIGH"), ("0x3", "outside"),
                        ("4:int64:0-1:2", "not a tensor spec")):
        with pytest.raises(UsageError, match=needle):
            parse_tensor_spec(bad)


def test_integer_inputs_stay_below_the_smallest_embedding():
    model = nn.ModuleList([nn.Embedding(7, 2), nn.Embedding(100, 2)])
    assert embedding_range(model) == 7 and embedding_range(nn.Linear(2, 2)) is None
    ids, lengths = make_inputs([parse_tensor_spec("64x9:int64"), parse_tensor_spec("64:int64:1-10")], model,
                               torch.Generator().manual_seed(0))
    assert int(ids.max()) < 7 and int(ids.min()) >= 0 and int(lengths.min()) >= 1
    with pytest.raises(UsageError, match="batch sizes 3, 4"):
        make_inputs([parse_tensor_spec("4x2"), parse_tensor_spec("3x2")], model)


def test_resize_repeats_rows_and_targets_follow_the_output_structure():
    batch = {"x": torch.arange(6.0).reshape(3, 2), "n": torch.tensor(7), "tag": "en"}
    big = resize_batch(batch, 5)
    assert big["x"][:, 0].tolist() == [0.0, 2.0, 4.0, 0.0, 2.0] and big["n"].item() == 7 and big["tag"] == "en"
    # a mapping output with logits: the loss is on the logits (its predictions), class labels for class scores
    out = {"logits": torch.randn(5, 3), "score": torch.randn(5), "ids": torch.zeros(5, dtype=torch.int64)}
    targets = make_targets(out, 5, torch.Generator().manual_seed(0))
    assert targets.dtype == torch.int64 and targets.shape == (5,)
    assert torch.allclose(structured_loss(out, targets), nn.functional.cross_entropy(out["logits"], targets))
    # without logits every floating output takes its own loss, and one that is not class scores needs a name
    with pytest.raises(UsageError, match="name the loss"):
        make_targets({"a": torch.randn(5, 3), "score": torch.randn(5)}, 5)
    # a model's own loss needs no targets
    assert make_targets({"logits": torch.randn(5, 3), "loss": torch.tensor(1.0)}, 5) is None


# --- bench --networks module:factory ------------------------------------------------------------------------

def _bench_json(capsys, *argv) -> dict:
    assert main(["bench", "--devices", "cpu", "--threads", "1", "--steps", "2", "--warmup", "1", "--json",
                 *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.timeout(240)
def test_bench_times_user_models_from_specs_and_factories(user_models, capsys):
    doc = _bench_json(capsys, "--networks", "my_models_e2e:make_transformer,mlp", "--input", "6x7:int64",
                      "--input", "6:int64:1-8", "--explain")
    cells = {c["network"]: c for c in doc["cells"]}
    transformer = cells["my_models_e2e:make_transformer"]
    assert transformer["error"] is None and transformer["median_s"] > 0 and transformer["batch_size"] == 6
    assert transformer["floor_s"] and transformer["floor_s"] > 0
    assert cells["mlp"]["error"] is None  # a zoo network beside it makes its own batch

    doc = _bench_json(capsys, "--networks", "my_models_e2e:make_dict_model", "--input",
                      "my_models_e2e:make_dict_batch", "--batch-size", "20")
    (cell,) = doc["cells"]
    assert cell["error"] is None and cell["batch_size"] == 20 and cell["median_s"] > 0

    doc = _bench_json(capsys, "--networks", "my_models_e2e:make_cnn", "--input", "4x3x8x8", "--mode", "auto")
    (cell,) = doc["cells"]
    assert cell["error"] is None and cell["mode_chosen"]


def test_a_user_network_step_is_the_plain_pytorch_step(user_models):
    """One bench step of a user network leaves the weights plain PyTorch's SGD step leaves."""
    from dlperf.bench.runner import user_networks
    from dlperf.models import get_spec
    from dlperf.steps import eager_step

    with user_networks(["my_models_e2e:make_dict_model"], "my_models_e2e:make_dict_batch"):
        spec = get_spec("my_models_e2e:make_dict_model")
    torch.manual_seed(5)
    model = spec.build()
    x, y = spec.input.make_batch(12, generator=torch.Generator().manual_seed(1))
    reference = {k: v.clone() for k, v in model.inner.state_dict().items()}
    eager_step(model, spec.loss, torch.optim.SGD(model.parameters(), lr=0.1))(x, y)

    import my_models_e2e

    plain = my_models_e2e.make_dict_model()
    plain.load_state_dict(reference)
    out = plain(x)
    loss = nn.functional.cross_entropy(out["logits"], y)  # the dict's logits are its predictions
    loss.backward()
    with torch.no_grad():
        for p in plain.parameters():
            p -= 0.1 * p.grad
    for (name, mine), theirs in zip(model.inner.state_dict().items(), plain.state_dict().values()):
        assert torch.allclose(mine, theirs, atol=1e-6), name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,needle", [
    (["--networks", "my_models_e2e:make_cnn"], "needs its batch"),
    (["--networks", "mlp", "--input", "4x3"], "none is"),
    (["--networks", "my_models_e2e:missing", "--input", "4x3"], "has no attribute 'missing'"),
    (["--networks", "my_models_e2e:make_cnn", "--input", "4x3"], "failed on the batch float32[4,3]"),
    (["--networks", "my_models_e2e:make_cnn", "--input", "4x3:nope"], "names dtype 'nope'"),
    (["--networks", "my_models_e2e:make_cnn", "--input", "4x3", "--input", "my_models_e2e:make_dict_batch"],
     "a batch factory makes the whole batch"),
    (["--networks", "bad module:x", "--input", "4x3"], "is not MODULE:FACTORY"),
])
def test_bench_bad_user_network_options_are_one_line(user_models, capsys, argv, needle):
    assert main(["bench", "--devices", "cpu", "--threads", "1", "--steps", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


# --- profile --------------------------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_profile_cli_on_token_ids_dicts_and_batchnorm(user_models, capfd):
    rc = main(["profile", "my_models_e2e:make_transformer", "--input", "8x6:int64", "--input", "8:int64:1-7",
               "--steps", "2", "--threads", "1", "--json"])
    captured = capfd.readouterr()
    assert rc == 0 and "USDT" not in captured.err and "profiler_start" not in captured.err
    doc = json.loads(captured.out.strip().splitlines()[-1])
    assert doc["inputs"] == "tuple(int64[8,6], int64[8])" and doc["batch_size"] == 8
    groups = {g["group"]: g for g in doc["groups"]}
    assert groups["attention"]["time_s"] > 0 and groups["attention"]["ops"] > 0
    names = [s["name"] for s in doc["suggestions"]]
    # the planner's candidates carry the core count (replicas x threads): some use other than the 1 thread profiled
    cores_of = [int(m[1]) * int(m[2]) for n in names if (m := re.match(r"plan (\d+)x(\d+)", n))]
    assert any(c != 1 for c in cores_of) or os.cpu_count() == 1, names
    measured = [s for s in doc["suggestions"] if s["baseline_s"]]
    # one baseline per measurement: the planner's candidates against its reference (the whole machine), the
    # profile's own variants against the step as profiled, each timed in its own alternating rounds
    for own in (True, False):
        steps = [s for s in measured if s["unit"] == "step" and s["name"].startswith("plan ") is own]
        assert len({s["baseline_s"] for s in steps}) <= 1, steps
    assert measured

    rc = main(["profile", "my_models_e2e:make_dict_model", "--input", "my_models_e2e:make_dict_batch", "--steps",
               "1", "--no-suggest"])
    out = capfd.readouterr().out
    assert rc == 0 and "dict{x: float32[12,8], cat: int64[12]}" in out

    rc = main(["profile", "my_models_e2e:make_cnn", "--input", "4x3x8x8", "--steps", "1", "--no-suggest"])
    assert rc == 0 and "norm" in capfd.readouterr().out

    assert main(["profile", "my_models_e2e:make_transformer", "--input", "8x6:int64:0-500", "--input", "8:int64",
                 "--steps", "1", "--no-suggest"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "IndexError" in err[0] and "range below the embedding size" in err[0]


def test_softmax_is_attention_and_log_softmax_is_loss():
    from dlperf.probe.cost import GROUPS, classify_op

    assert "attention" in GROUPS
    for name in ("aten::_softmax", "aten::_softmax_backward_data", "aten::_scaled_dot_product_flash_attention",
                 "aten.softmax.int"):
        assert classify_op(name) == "attention", name
    for name in ("aten::log_softmax", "aten::_log_softmax_backward_data", "aten::nll_loss_forward"):
        assert classify_op(name) == "loss", name


def test_profile_report_marks_contention_with_its_reason():
    from dlperf.probe.profile import CONTENDED_MARK, profile
    from dlperf.timing import Contention, ContentionSignals, Timing

    report = profile(nn.Linear(4, 3), torch.randn(8, 4), steps=1, suggest=False)
    signals = ContentionSignals(wall_s=1.0, cpu_s=0.5, threads=2, cores=2, run_s=0.5, wait_s=0.5,
                                others_mean=2.0, others_max=3, load1=4.0, steal_ticks=None, total_ticks=None)
    busy = Contention(True, "threads waited for a CPU 50% of the time", signals)
    report.step = Timing.from_samples(list(report.step.samples), contention=busy)
    text = str(report)
    assert f"ms median {CONTENDED_MARK}" in text.splitlines()[1]
    assert "threads waited for a CPU 50% of the time" in text and report.contended
    assert report.to_dict()["contended"] is True


def test_profile_python_api_takes_tuples_and_dict_outputs():
    from dlperf.probe.cost import TrainingStep
    from dlperf.probe.profile import profile

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(9, 4)
            self.lin = nn.Linear(4, 3)

        def forward(self, ids, scale):
            h = self.embed(ids).mean(1) * scale[:, None]
            return {"logits": self.lin(h), "aux": h}

    torch.manual_seed(0)
    model = Two()
    batch = (torch.randint(0, 9, (6, 5)), torch.rand(6))
    report = profile(model, batch, steps=1, suggest=False)
    assert report.inputs == describe(batch) and report.batch == 6 and report.input_shape == (6,)
    # the profiled step's loss: cross-entropy on the dict's logits (its predictions), made-up class labels
    step = TrainingStep(model, batch, lr=0.0)
    out = model(*batch)
    labels = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(step(), nn.functional.cross_entropy(out["logits"], labels))
    assert step.loss is not None and step.loss.name.startswith("cross-entropy (the default")


# --- launch -- python script.py --------------------------------------------------------------------------

KV_SCRIPT = textwrap.dedent('''
    import os
    import sys

    import torch

    from dlperf.kvstore import create_kvstore

    import my_models_e2e

    torch.manual_seed(0)
    model = my_models_e2e.make_transformer()
    rank = int(os.environ["RANK"])
    kv = create_kvstore("dist_sync")  # no process group opened here: the store joins by itself
    for i, p in enumerate(model.parameters()):
        kv.init(i, p.detach().clone())
    grads = [torch.full_like(p, float(rank + 1)) for p in model.parameters()]
    outs = [torch.empty_like(p) for p in model.parameters()]
    for i, (g, o) in enumerate(zip(grads, outs)):
        kv.push(i, g)
        kv.pull(i, out=o)
    torch.save({"rank": rank, "args": sys.argv[1:], "first": outs[0].clone()}, f"{sys.argv[1]}.{rank}")
    kv.close()
''')


def _check_kv_outputs(prefix: Path, args: list[str]) -> None:
    for rank in (0, 1):
        saved = torch.load(f"{prefix}.{rank}")
        assert saved["rank"] == rank and saved["args"] == [str(prefix), *args]
        assert torch.equal(saved["first"], torch.full_like(saved["first"], 3.0))  # 1 + 2, the pushes' sum


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("python", ["python", "python3", sys.executable, "-m"])
def test_launch_python_script_with_a_kvstore_that_joins_by_itself(user_models, capfd, python):
    (user_models / "kv_script.py").write_text(KV_SCRIPT)
    (user_models / "kvpkg").mkdir()
    (user_models / "kvpkg" / "__init__.py").write_text("")
    (user_models / "kvpkg" / "run.py").write_text(KV_SCRIPT)
    out = user_models / "kv"
    command = ["python", "-m", "kvpkg.run"] if python == "-m" else [python, "kv_script.py"]
    assert main(["launch", "--nproc-per-node", "2", "--timeout", "120", "--", *command, str(out), "--lr",
                 "0.1"]) == 0, capfd.readouterr().err
    _check_kv_outputs(out, ["--lr", "0.1"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_kvstore_joins_under_plain_torchrun(user_models):
    (user_models / "kv_script.py").write_text(KV_SCRIPT)
    out = user_models / "kv"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(user_models)])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "kv_script.py", str(out), "x"], env=env, cwd=user_models, capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_kv_outputs(out, ["x"])


FAILING = textwrap.dedent('''
    import os


    def deep_inside():
        raise ValueError("rank one is broken")


    if os.environ["RANK"] == "1":
        deep_inside()
''')


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_failed_rank_is_one_line_naming_the_log_with_its_traceback(user_models, capfd):
    (user_models / "fails.py").write_text(FAILING)
    assert main(["launch", "--nproc-per-node", "2", "--timeout", "60", "--", "python", "fails.py"]) == 1
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "rank 1 failed: ValueError: rank one is broken" in lines[0], err
    log = Path(lines[0].split("torch's log: ")[1].rstrip(")"))
    text = log.read_text()
    assert "Traceback" in text and "deep_inside" in text and "rank one is broken" in text
    log.unlink()

    assert main(["launch", "--nproc-per-node", "2", "--timeout", "60", "--verbose", "--", "python", "fails.py"]) == 1
    err = capfd.readouterr().err
    assert "deep_inside" in err and err.strip().splitlines()[-1].startswith("dlperf launch: error: rank 1 failed")
    Path(err.strip().splitlines()[-1].split("torch's log: ")[1].rstrip(")")).unlink()


@pytest.mark.parametrize("command,needle", [
    (["python"], "python with no script"),
    (["python", "-c", "print(1)"], "python option '-c' is not supported"),
    (["python3", "-m"], "expected a module name"),
    (["python", "-m", "no_such_module_for_launch"], "no module named 'no_such_module_for_launch'"),
    (["python", "missing.py"], "'missing.py' does not exist"),
])
def test_launch_python_bad_commands_are_one_line(user_models, capfd, command, needle):
    assert main(["launch", "--nproc-per-node", "2", "--", *command]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_user_networks_are_known_only_while_their_sweep_runs(user_models, capsys):
    from dlperf.bench import run
    from dlperf.models import model_names

    zoo = model_names()
    assert main(["bench", "--networks", "my_models_e2e:make_cnn", "--input", "4x3x8x8", "--devices", "cpu",
                 "--threads", "1", "--steps", "1", "--warmup", "1"]) == 0
    run(networks="my_models_e2e:make_cnn", inputs=["4x3x8x8"], devices="cpu", threads=1, steps=1, warmup=1)
    assert model_names() == zoo
