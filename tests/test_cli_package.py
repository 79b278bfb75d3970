"""The CLI package's shape: verbs are thin over library configs, and the library never imports the CLI."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

import dlperf
from dlperf.devices import cpu
from dlperf.errors import UsageError

SRC = Path(dlperf.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports, relative imports resolved."""
    package = ".".join(("dlperf", *path.relative_to(SRC).parent.parts))
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_the_import_scan_resolves_relative_imports():
    # the scan below must be able to fail: an import written relatively is named absolutely
    assert {"dlperf._io.check_writable", "dlperf.parallel.training.checkpoint"} <= _imported_modules(
        SRC / "parallel" / "training" / "run_config.py")
    assert "dlperf.cli.options" in _imported_modules(SRC / "cli" / "bench.py")
    assert "dlperf.cli.options.one_line" in _imported_modules(SRC / "cli" / "__init__.py")


def test_no_library_module_imports_the_cli_package():
    offenders = {}
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).parts[0] == "cli":
            continue
        bad = sorted(n for n in _imported_modules(path) if n == "dlperf.cli" or n.startswith("dlperf.cli."))
        if bad:
            offenders[str(path.relative_to(SRC))] = bad
    assert offenders == {}


def test_the_old_verb_modules_are_gone():
    for old in ("cli.py", "cli_devices.py", "bench/cli.py", "parallel/cli.py", "hybrid/cli.py", "engine/cli.py",
                "probe/cli.py", "probe/profile_cli.py"):
        assert not (SRC / old).exists(), old


@pytest.mark.parametrize("kwargs, library, cli", [
    ({"lr": 0.0}, "lr=0.0: expected a number > 0 and <= 100", "--lr 0.0: expected a number > 0 and <= 100"),
    ({"epochs": 0}, "epochs=0: expected an integer >= 1", "--epochs 0: expected an integer >= 1"),
    ({"download": True}, "download=True needs data=DIR to download into",
     "--download needs --data DIR to download into"),
    ({"devices": "cpu:0,cpu:1", "batch_size": 1}, "batch_size=1 is smaller than the 2 devices",
     "--batch-size 1 is smaller than the 2 devices"),
    ({"algorithm": "tree"}, "unknown allreduce algorithm 'tree'", "unknown allreduce algorithm 'tree'"),
])
def test_a_run_config_names_its_parameters_and_the_cli_its_flags(kwargs, library, cli):
    from dlperf.cli.options import flag_words
    from dlperf.parallel.training.run_config import RunConfig, RunSection
    from dlperf.parallel.training.trainer_config import TrainerConfig

    trainer = {k: kwargs.pop(k) for k in ("algorithm",) if k in kwargs}
    lr = kwargs.pop("lr", 0.2)
    with pytest.raises(UsageError) as info:
        RunConfig(RunSection(**kwargs), TrainerConfig("sgd", {"lr": lr}, **trainer))
    assert library in str(info.value) and "\n" not in str(info.value) and "--" not in str(info.value)
    assert cli in flag_words(str(info.value))


def test_train_verb_passes_every_option_to_the_config():
    from dlperf.cli import train as train_cli

    parser = argparse.ArgumentParser()
    train_cli.register(parser.add_subparsers())
    args = parser.parse_args(["train", "--devices", "cpu:0,cpu:1", "--lr", "0.5", "--seed", "7", "--epochs", "3",
                              "--batch-size", "64", "--check-finite", "--kvstore", "local", "--loss", "mse"])
    config = train_cli.run_config(args)
    assert (config.devices, config.lr, config.run.seed, config.run.epochs, config.run.batch_size,
            config.trainer.check_finite, config.trainer.kvstore, config.trainer.loss) == (
        [cpu(0), cpu(1)], 0.5, 7, 3, 64, True, "local", "mse")


@pytest.mark.timeout(120)
def test_library_training_records_every_epoch_without_the_cli(tmp_path):
    from dlperf.parallel.training.checkpoint import load_checkpoint
    from dlperf.parallel.training.run import RunHooks, train
    from dlperf.parallel.training.run_config import RunConfig, RunSection, prepare

    config = RunConfig(RunSection(devices="cpu:0,cpu:1", batch_size=50, epochs=2, train_size=200, test_size=50,
                                  checkpoint=str(tmp_path / "ck.pt")))
    state = prepare(config)
    seen: list[dict] = []
    kept_when_reported: list[list[int]] = []

    def reported(rec: dict) -> None:
        # an epoch is reported once it is kept: a Ctrl-C right after its line keeps it
        kept_when_reported.append(list(state.saved))
        assert load_checkpoint(tmp_path / "ck.pt")["history"][-1]["epoch"] == rec["epoch"]
        seen.append(rec)

    result = train(config, state, None, RunHooks(on_epoch=reported))
    assert [r["epoch"] for r in seen] == [1, 2] and seen == state.history and state.saved == [1, 2]
    assert kept_when_reported == [[1], [1, 2]]
    assert load_checkpoint(tmp_path / "ck.pt")["history"] == state.history
    assert result.devices == [cpu(0), cpu(1)] and result.history == state.history


def test_scaling_config_checks_and_defaults():
    from dlperf.bench.scaling import ScalingConfig

    with pytest.raises(UsageError, match="Table 8 has no network 'lenet'"):
        ScalingConfig(networks=["lenet"])
    with pytest.raises(UsageError, match="at least the 2 devices"):
        ScalingConfig(networks=["fcn-r"], devices=[cpu(0), cpu(1)], batch_size=1)
    quick = ScalingConfig(networks=["fcn-r"], devices=[cpu(0)], quick=True)
    assert (quick.steps, quick.warmup) == (3, 1)
    full = ScalingConfig(networks=["fcn-r"], devices=[cpu(0)], steps=4, warmup=0)
    assert (full.steps, full.warmup) == (4, 0)


def test_two_outputs_to_one_file_are_refused(tmp_path):
    from dlperf.bench.sweep import Outputs

    Outputs(json="-", csv="-")  # stdout twice is fine: CSV replaces the table, JSON is the last line
    with pytest.raises(UsageError, match="--json and --csv both write"):
        Outputs(json=str(tmp_path / "a"), csv=str(tmp_path / "." / "a"))


def test_zoo_export_config_checks_before_building(tmp_path):
    from dlperf.hybrid.zoo_export import ZooExportConfig

    with pytest.raises(UsageError, match="unknown"):
        ZooExportConfig("no-such-net", str(tmp_path / "out"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is not a directory"):
        ZooExportConfig("mlp", str(tmp_path / "file"))
    with pytest.raises(UsageError, match="batch=0: expected >= 1"):
        ZooExportConfig("mlp", str(tmp_path / "out"), batch=0)


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_python_dash_m_runs_the_package():
    done = subprocess.run([sys.executable, "-m", "dlperf.cli", "--version"], capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0 and done.stdout.startswith("dlperf ")
