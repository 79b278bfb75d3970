"""dlperf._io: the one atomic writer and the one safe torch loader, on every kind of target."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch

import dlperf._io as io_mod
from dlperf._io import (
    FileAccessError,
    atomic_open,
    atomic_write_bytes,
    atomic_write_text,
    check_writable,
    safe_torch_load,
    write_cache_file,
)
from dlperf.errors import DlperfError, UsageError

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temporaries(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


# -- regular files and new paths ------------------------------------------------------------------

def test_new_path_gets_the_mode_open_would_give_and_its_parents(tmp_path):
    target = tmp_path / "a" / "b" / "out.json"
    assert atomic_write_text(target, "{}") == target
    assert target.read_text() == "{}"
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~current_umask()
    assert _temporaries(target.parent) == []


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o644])
def test_replacing_a_regular_file_keeps_its_mode(tmp_path, mode):
    target = tmp_path / "run.pt"
    target.write_bytes(b"old")
    os.chmod(target, mode)
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == mode
    assert _temporaries(tmp_path) == []


def test_replacing_is_atomic_a_new_inode_takes_the_name(tmp_path):
    target = tmp_path / "f"
    target.write_bytes(b"old")
    with open(target, "rb") as reader:  # a reader that opened the old file keeps reading the old file
        atomic_write_bytes(target, b"new content")
        assert reader.read() == b"old"
    assert target.read_bytes() == b"new content"


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "f"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_open(target) as f:
            f.write(b"half")
            raise RuntimeError("boom")
    assert target.read_bytes() == b"old"
    assert _temporaries(tmp_path) == []


def test_text_mode_writes_utf8(tmp_path):
    with atomic_open(tmp_path / "t.txt", "w") as f:
        f.write("ü")
    assert (tmp_path / "t.txt").read_bytes() == "ü".encode()
    with pytest.raises(ValueError, match="mode"):
        with atomic_open(tmp_path / "t.txt", "ab"):
            pass


def test_symlink_to_a_file_replaces_the_file_and_keeps_the_link(tmp_path):
    real = tmp_path / "data" / "real.json"
    real.parent.mkdir()
    real.write_text("old")
    os.chmod(real, 0o600)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    atomic_write_text(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == "new" and stat.S_IMODE(real.stat().st_mode) == 0o600
    assert _temporaries(tmp_path) == [] and _temporaries(real.parent) == []


# -- targets that are not regular files -----------------------------------------------------------

def test_directory_target_is_one_clear_error(tmp_path):
    with pytest.raises(FileAccessError) as info:
        atomic_write_text(tmp_path, "x")
    err = info.value
    assert isinstance(err, DlperfError) and isinstance(err, OSError) and err.errno == errno.EISDIR
    assert str(err) == f"cannot write {tmp_path}: it is a directory; give the path of a file (inside it, or beside it)"
    with pytest.raises(FileAccessError, match="is a directory"):
        check_writable(tmp_path)
    assert tmp_path.is_dir()


@pytest.mark.timeout(20)
def test_fifo_is_written_in_place_not_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []

    def read() -> None:
        with open(fifo, "rb") as f:
            got.append(f.read())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        atomic_write_text(fifo, "through the pipe")
    finally:
        reader.join(10)
        if reader.is_alive():  # unblock the reader so the test cannot hang
            with open(fifo, "wb"):
                pass
            reader.join(5)
    assert got == [b"through the pipe"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert _temporaries(tmp_path) == []


@pytest.mark.timeout(10)
def test_check_writable_does_not_open_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    check_writable(fifo)  # no reader: opening it would block
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def _char_device(tmp_path, name: str, minor: int):
    """A private copy of /dev/null (minor 3) or /dev/full (minor 7): a bug can then only break the copy."""
    path = tmp_path / name
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, minor))
        with open(path, "wb"):
            pass
    except OSError:
        path.unlink(missing_ok=True)
        return None
    return path


def test_character_device_is_written_not_replaced(tmp_path):
    if IS_ROOT:
        null = _char_device(tmp_path, "null", 3)
        if null is None:
            pytest.skip("cannot create a device node here (nodev mount)")
    else:
        null = "/dev/null"  # without root, a replacing writer would fail instead of breaking it
    atomic_write_text(null, "discarded")
    assert stat.S_ISCHR(os.stat(null).st_mode)
    if IS_ROOT:
        assert _temporaries(tmp_path) == []


@pytest.mark.skipif(not IS_ROOT, reason="creating a device node needs root")
def test_full_device_gives_one_line_naming_it_and_survives(tmp_path):
    full = _char_device(tmp_path, "full", 7)
    if full is None:
        pytest.skip("cannot create a device node here (nodev mount)")
    check_writable(full)
    with pytest.raises(FileAccessError) as info:
        atomic_write_text(full, "x" * 100_000)
    assert str(info.value) == (f"cannot write {full}: no space left on the device for 100000 bytes; free some space "
                               "or write elsewhere")
    assert info.value.errno == errno.ENOSPC
    assert stat.S_ISCHR(os.stat(full).st_mode)
    assert _temporaries(tmp_path) == []


@pytest.mark.skipif(IS_ROOT, reason="root may write read-only files")
def test_read_only_file_is_refused_not_replaced(tmp_path):
    target = tmp_path / "ro"
    target.write_text("old")
    os.chmod(target, 0o444)
    with pytest.raises(FileAccessError, match="read-only"):
        atomic_write_text(target, "new")
    with pytest.raises(FileAccessError, match="read-only"):
        check_writable(target)
    assert target.read_text() == "old"


def test_unwritable_parent_is_one_error_naming_the_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(FileAccessError, match=f"cannot write {blocker}/out.json: "):
        atomic_write_text(blocker / "out.json", "x")
    with pytest.raises(FileAccessError, match="Not a directory"):
        check_writable(blocker / "out.json")


def test_check_writable_creates_no_file(tmp_path):
    target = tmp_path / "sub" / "out.csv"
    check_writable(target)
    assert not target.exists() and os.listdir(target.parent) == []


# -- temporaries and durability -------------------------------------------------------------------

def test_temporaries_of_dead_writers_are_removed_by_the_next_write(tmp_path):
    target = tmp_path / "run.pt"
    dead = tmp_path / f".run.pt.{_dead_pid()}.0a1b2c3d.tmp"
    dead.write_bytes(b"orphan")
    alive = tmp_path / f".run.pt.{os.getppid()}.0a1b2c3d.tmp"  # a live writer's: not ours to delete
    alive.write_bytes(b"in progress")
    other = tmp_path / f".other.pt.{_dead_pid()}.0a1b2c3d.tmp"  # another target's
    other.write_bytes(b"x")
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert not dead.exists() and alive.exists() and other.exists()


def test_file_and_directory_are_fsynced(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        mode = os.fstat(fd).st_mode
        synced.append("dir" if stat.S_ISDIR(mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(io_mod.os, "fsync", recording_fsync)
    atomic_write_bytes(tmp_path / "f", b"data")
    assert synced == ["file", "dir"]


def test_a_directory_that_cannot_be_fsynced_does_not_fail_the_write(tmp_path, monkeypatch):
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(io_mod.os, "fsync", fsync)
    atomic_write_bytes(tmp_path / "f", b"data")
    assert (tmp_path / "f").read_bytes() == b"data"


def test_a_failing_file_fsync_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "f"
    target.write_bytes(b"old")

    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(io_mod.os, "fsync", fsync)
    with pytest.raises(FileAccessError, match=f"cannot write {target}: Input/output error"):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old" and _temporaries(tmp_path) == []


# -- safe loading ---------------------------------------------------------------------------------

class _Opaque:
    """A picklable object that a weights-only load must refuse."""


def test_safe_torch_load_reads_tensors_onto_the_cpu(tmp_path):
    state = {"w": torch.arange(4.0), "meta": [1, "two", {"x": 3.0}]}
    torch.save(state, tmp_path / "s.pt")
    got = safe_torch_load(tmp_path / "s.pt")
    assert torch.equal(got["w"], state["w"]) and got["meta"] == state["meta"]


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind, match", [
    ("missing", "does not exist"),
    ("directory", "is a directory, not a file"),
    ("fifo", "is a FIFO, not a regular file"),
    ("garbage", r"is not a checkpoint saved with torch.save \(not a torch.save file\)"),
    ("truncated", r"is not a checkpoint saved with torch.save \("),
    ("empty", r"is not a checkpoint saved with torch.save \("),
    ("object", r"holds Python objects \(test_io._Opaque\) other than tensors"),
])
def test_safe_torch_load_gives_one_line_naming_the_file(tmp_path, kind, match):
    path = tmp_path / "ck.pt"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # no writer: a plain open would block forever
    elif kind == "garbage":
        path.write_bytes(b"\x00not a checkpoint" * 10)
    elif kind == "truncated":
        torch.save({"w": torch.zeros(1000)}, path)
        path.write_bytes(path.read_bytes()[:300])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "object":
        torch.save({"x": _Opaque()}, path)
    with pytest.raises(UsageError, match=match) as info:
        safe_torch_load(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message and len(message) < 300
    assert "weights_only" not in message  # never torch's advice to load untrusted code


# -- dlperf train checkpoints ---------------------------------------------------------------------

def _checkpoint(tmp_path):
    from dlperf.devices import cpu
    from dlperf.parallel.training.checkpoint import _CHECKPOINT_FORMAT
    from dlperf.parallel.training.trainer import Trainer

    with Trainer(torch.nn.Linear(3, 2), [cpu(0)], "sgd", {"lr": 0.1}) as trainer:
        trainer.train_step(torch.randn(4, 3), torch.randint(0, 2, (4,)))
        state = trainer.state_dict()
    config = {"model": "lenet", "devices": 1, "batch_size": 4, "lr": 0.1, "data": None, "train_size": 8,
              "test_size": 8, "seed": 0, "algorithm": "ring", "kvstore": None}
    history = [{"epoch": 1, "loss": 0.5, "test_acc": 0.25, "seconds": 1.0}]
    return {"format": _CHECKPOINT_FORMAT, "config": config, "history": history, "trainer": state}


def test_checkpoint_round_trip_and_mode(tmp_path):
    from dlperf.parallel.training.checkpoint import load_checkpoint, save_checkpoint

    path = tmp_path / "ck.pt"
    state = _checkpoint(tmp_path)
    save_checkpoint(path, state)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~current_umask()  # the same as every other output
    got = load_checkpoint(path)
    assert got["history"] == state["history"] and got["config"] == state["config"]
    assert _temporaries(tmp_path) == []


def test_a_flipped_bit_in_any_stored_tensor_or_value_is_caught_by_the_checksum(tmp_path):
    from dlperf.parallel.training.checkpoint import load_checkpoint, save_checkpoint, state_checksum

    path = tmp_path / "ck.pt"
    state = _checkpoint(tmp_path)
    save_checkpoint(path, state)
    saved = torch.load(path, weights_only=True)
    assert saved["checksum"] == state_checksum(state) == state_checksum(saved)
    tensors = [t for t in saved["trainer"]["model"].values()]
    for t in tensors:
        for i in (0, t.numel() - 1):
            damaged = torch.load(path, weights_only=True)
            flat = damaged["trainer"]["model"][next(k for k, v in saved["trainer"]["model"].items() if v is t)]
            flat.view(torch.int32).view(-1)[i] ^= 1 << (i % 31)
            torch.save(damaged, path.with_suffix(".bad"))
            with pytest.raises(UsageError, match="do not match the checksum written with them") as info:
                load_checkpoint(path.with_suffix(".bad"))
            assert "\n" not in str(info.value)
    unsigned = {k: v for k, v in saved.items() if k != "checksum"}  # written before checksums: still read
    torch.save(unsigned, path.with_suffix(".old"))
    assert load_checkpoint(path.with_suffix(".old"))["config"] == state["config"]


def test_the_checksum_covers_every_layout_and_dtype_without_a_dense_copy():
    from dlperf.parallel.training.checkpoint import state_checksum

    dense = torch.arange(12.0).reshape(3, 4)
    values = [dense, dense.to(torch.bfloat16), torch.tensor(3.0), torch.zeros(0), dense.to_sparse(),
              dense.to_sparse_csr(), torch.tensor([True, False])]
    sums = {state_checksum({"v": v}) for v in values}
    assert len(sums) == len(values)
    huge = torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([1.0]), (2**31, 2**31),
                                   check_invariants=True)
    assert state_checksum({"v": huge}) != state_checksum({"v": huge * 2})  # hashed as stored: no 2**62 elements
    assert state_checksum({"a": 1, "b": 2}) != state_checksum({"b": 1, "a": 2})
    assert state_checksum({"a": [1, 2]}) != state_checksum({"a": (1, 2)})


@pytest.mark.parametrize("damage, match", [
    (lambda s: s["history"][0].pop("loss"), r"history\[0\] has no 'loss'"),
    (lambda s: s["history"][0].update(extra=1), r"history\[0\] has unexpected keys \['extra'\]"),
    (lambda s: s["history"].append("epoch 2"), r"history\[1\] is a str, not a dict"),
    (lambda s: s["history"][0].update(epoch="1"), r"history\[0\]\['epoch'\] is a str, expected int"),
    (lambda s: s["config"].pop("lr"), "config has no 'lr'"),
    (lambda s: s.update(format=99), "format 99"),
    (lambda s: s.pop("trainer"), "the file has no 'trainer'"),
    (lambda s: s["trainer"].update(steps=1.5), r"trainer\['steps'\] is a float"),
    (lambda s: s["trainer"].pop("optimizer"), "no optimizer state"),
    (lambda s: s["trainer"]["model"].update(w=[1, 2]), "not dicts of tensors"),
])
def test_damaged_checkpoint_is_one_line(tmp_path, damage, match):
    from dlperf.parallel.training.checkpoint import load_checkpoint

    state = _checkpoint(tmp_path)
    damage(state)
    torch.save(state, tmp_path / "ck.pt")
    with pytest.raises(UsageError, match=match) as info:
        load_checkpoint(tmp_path / "ck.pt")
    assert "ck.pt" in str(info.value) and "\n" not in str(info.value)


def test_checkpoint_directory_is_refused_before_training(tmp_path, capsys, monkeypatch):
    from dlperf.cli import main
    from dlperf.parallel.training import run as run_module

    def must_not_train(*a, **k):
        raise AssertionError("trained although the checkpoint could not be written")

    monkeypatch.setattr(run_module, "train", must_not_train)
    rc = main(["train", "--checkpoint", str(tmp_path), "--epochs", "1", "--train-size", "10", "--test-size", "10",
               "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "--checkpoint" in err and str(tmp_path) in err and "is a directory" in err and ".tmp" not in err


def test_resume_from_a_directory_says_so(tmp_path, capsys):
    from dlperf.cli import main

    rc = main(["train", "--resume", str(tmp_path), "--epochs", "1", "--train-size", "10", "--test-size", "10"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "is a directory, not a file" in err and "does not exist" not in err


class _InterruptedFile:
    """A file whose writes stop with KeyboardInterrupt after ``limit`` bytes, as a Ctrl-C mid-write does."""

    def __init__(self, f, limit: int) -> None:
        self._f, self._left = f, limit

    def write(self, data) -> int:
        if self._left <= 0:
            raise KeyboardInterrupt
        self._left -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_save_torch_turns_a_ctrl_c_mid_write_into_keyboard_interrupt_and_keeps_the_old_file(tmp_path, monkeypatch):
    from contextlib import contextmanager

    from dlperf._io import safe_torch_load, save_torch

    path = tmp_path / "state.pt"
    save_torch(path, {"w": torch.arange(3.0)})
    real = io_mod.atomic_open

    @contextmanager
    def interrupted(target, mode, **options):
        with real(target, mode, **options) as f:
            yield _InterruptedFile(f, 4096)

    monkeypatch.setattr(io_mod, "atomic_open", interrupted)
    # torch's zip writer, unwinding from the interrupt, raises "unexpected pos" of its own
    with pytest.raises(KeyboardInterrupt):
        save_torch(path, {"a": torch.zeros(1 << 16)})
    monkeypatch.setattr(io_mod, "atomic_open", real)
    assert safe_torch_load(path)["w"].tolist() == [0.0, 1.0, 2.0]
    assert _temporaries(tmp_path) == []


# --- the process's own streams, devices and FIFOs: written in place, never replaced ---------------------
_WRITE_TO = """
import sys
from dlperf._io import atomic_write_text
print("table", flush=True)
for target in sys.argv[1:]:
    atomic_write_text(target, "json " + target + "\\n")
"""


@pytest.mark.parametrize("alias", ["-", "/dev/stdout", "/dev/fd/1", "/proc/self/fd/1", "SELF"])
def test_stdout_appended_to_a_file_keeps_what_the_file_held(tmp_path, alias):
    log = tmp_path / "log"
    log.write_text("OLD\n")
    target = str(log) if alias == "SELF" else alias
    with open(log, "a") as out:  # `>> log`
        subprocess.run([sys.executable, "-c", _WRITE_TO, target], stdout=out, check=True, timeout=60)
    assert log.read_text() == f"OLD\ntable\njson {target}\n"
    assert _temporaries(tmp_path) == []


def test_a_file_that_is_stderr_is_written_through_stderr_at_its_position(tmp_path):
    log = tmp_path / "log"
    log.write_text("OLD\n")
    with open(log, "r+") as err:  # `2<> log`: not O_APPEND, so the stream's own position counts
        err.seek(0, os.SEEK_END)
        subprocess.run([sys.executable, "-c", _WRITE_TO, "/dev/stderr", str(log)], stderr=err,
                       stdout=subprocess.DEVNULL, check=True, timeout=60)
    assert log.read_text() == f"OLD\njson /dev/stderr\njson {log}\n"


def test_stdout_as_a_pipe_receives_the_document():
    out = subprocess.run([sys.executable, "-c", _WRITE_TO, "/dev/stdout"], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout == "table\njson /dev/stdout\n"


def test_output_stream_matches_names_and_the_open_files_only(tmp_path):
    assert io_mod.output_stream("-") == 1 and io_mod.output_stream("/dev/stderr") == 2
    assert io_mod.output_stream(tmp_path / "other") is None
    (tmp_path / "exists").write_text("")
    assert io_mod.output_stream(tmp_path / "exists") is None


def test_fifo_without_a_reader_is_refused_after_a_bounded_wait(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code = ("import dlperf._io as io; io.FIFO_READER_WAIT_S = 0.3; "
            f"io.atomic_write_text({str(fifo)!r}, 'x')")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and time.monotonic() - start < 30
    assert (f"cannot write {fifo}: no process opened this FIFO for reading within 0.3 s; start its reader "
            "first") in out.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.skipif(not IS_ROOT, reason="creating a device node needs root")
def test_block_device_is_refused_never_written(tmp_path):
    node = tmp_path / "disk"
    try:
        os.mknod(node, stat.S_IFBLK | 0o600, os.makedev(7, 200))
    except OSError:
        pytest.skip("cannot create a device node here")
    with pytest.raises(FileAccessError, match="it is a block device; give a regular file, a character device"):
        atomic_write_text(node, "x")
    with pytest.raises(FileAccessError, match="block device"):
        check_writable(node)


# --- dlperf's own caches: only a regular file of this user is ever replaced ---------------------------------
def _foreign_targets(tmp_path):
    """What may stand where a cache is written, none of it a cache file dlperf wrote: (path, what, check)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's")
    link = tmp_path / "link"
    link.symlink_to(victim)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "adir").mkdir()
    targets = [(link, "a symbolic link",
                lambda: os.readlink(link) == str(victim) and victim.read_text() == "the user's"),
               (fifo, "a FIFO", lambda: stat.S_ISFIFO(os.lstat(fifo).st_mode)),
               (tmp_path / "adir", "a directory", lambda: os.listdir(tmp_path / "adir") == [])]
    if IS_ROOT:
        null = _char_device(tmp_path, "null", 3)
        if null is not None:
            targets.append((null, "a character device", lambda: stat.S_ISCHR(os.lstat(null).st_mode)))
        theirs = tmp_path / "theirs.json"
        theirs.write_text("their plans")
        os.chown(theirs, 54321, 54321)
        targets.append((theirs, "a file of uid 54321", lambda: theirs.read_text() == "their plans"
                        and theirs.stat().st_uid == 54321))
    return targets


@pytest.mark.timeout(10)
def test_a_cache_file_replaces_only_a_regular_file_of_this_user(tmp_path):
    for path, what, unharmed in _foreign_targets(tmp_path):
        with pytest.raises(FileAccessError) as info:
            write_cache_file(path, b"{}")
        assert f"it is {what}, not a cache file dlperf wrote, and is left as it is" in str(info.value)
        assert str(path) in str(info.value) and "\n" not in str(info.value)
        assert unharmed(), what
    assert _temporaries(tmp_path) == []
    mine = tmp_path / "plans.json"
    old = os.umask(0o002)
    try:
        write_cache_file(mine, b"one")
        os.chmod(mine, 0o664)
        write_cache_file(mine, b"two")  # a file of this user, even one others could write, is replaced privately
    finally:
        os.umask(old)
    assert mine.read_bytes() == b"two" and stat.S_IMODE(mine.stat().st_mode) == 0o600


def test_a_cache_file_is_never_the_file_stdout_goes_to(tmp_path):
    out = tmp_path / "log"
    out.write_text("kept\n")
    with open(out, "a") as f:
        proc = subprocess.run([sys.executable, "-c", "import sys; from dlperf._io import write_cache_file\n"
                               "try:\n    write_cache_file(sys.argv[1], b'cache')\nexcept OSError as e:\n"
                               "    print(e, file=sys.stderr)", str(out)], stdout=f, stderr=subprocess.PIPE,
                              text=True, timeout=60)
    assert "the file this process's output goes to" in proc.stderr
    assert out.read_text() == "kept\n"


# --- full disks ------------------------------------------------------------------------------------------
def _enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_at_fsync_names_the_path_and_bytes_and_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "out.json"
    target.write_text("old")
    monkeypatch.setattr(io_mod.os, "fsync", _enospc)
    with pytest.raises(FileAccessError) as info:
        atomic_write_text(target, "new" * 10)
    assert str(info.value) == (f"cannot write {target}: no space left on the device for 30 bytes (any previous file "
                               "is kept); free some space or write elsewhere")
    assert target.read_text() == "old"
    assert _temporaries(tmp_path) == []


class _FullAfter:
    """A file whose writes fail with ENOSPC once ``room`` bytes have gone through."""

    def __init__(self, f, room):
        self._f, self._room = f, room

    def write(self, data):
        if len(data) > self._room:
            _enospc()
        self._room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def test_save_torch_on_a_full_disk_is_one_line_not_torchs_unexpected_pos(tmp_path, monkeypatch):
    from contextlib import contextmanager

    from dlperf._io import save_torch

    path = tmp_path / "state.pt"
    save_torch(path, {"w": torch.arange(3.0)})
    real = io_mod.atomic_open

    @contextmanager
    def full(target, mode, **options):
        with real(target, mode, **options) as f:
            yield _FullAfter(f, 4096)

    monkeypatch.setattr(io_mod, "atomic_open", full)
    with pytest.raises(FileAccessError) as info:
        save_torch(path, {"a": torch.zeros(1 << 16)})
    assert str(info.value) == (f"cannot write {path}: no space left on the device for 262144 bytes (any previous "
                               "file is kept); free some space or write elsewhere")
    monkeypatch.setattr(io_mod, "atomic_open", real)
    assert safe_torch_load(path)["w"].tolist() == [0.0, 1.0, 2.0]
    assert _temporaries(tmp_path) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs mounted on a fresh directory (root only; skipped where mounting is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if not IS_ROOT:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True,
                          timeout=30, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()[:100]}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=30, check=False)


def test_real_full_tmpfs_keeps_the_old_files_and_leaves_no_temporary(small_tmpfs):
    from dlperf._io import save_torch

    text, state = small_tmpfs / "out.json", small_tmpfs / "state.pt"
    text.write_text("old")
    save_torch(state, {"w": torch.arange(3.0)})
    with pytest.raises(FileAccessError, match=f"cannot write {text}: no space left on the device for 200000 bytes"):
        atomic_write_text(text, "x" * 200_000)
    with pytest.raises(FileAccessError, match=f"cannot write {state}: no space left on the device for 400000 bytes"):
        save_torch(state, {"a": torch.zeros(100_000)})
    assert text.read_text() == "old"
    assert safe_torch_load(state)["w"].tolist() == [0.0, 1.0, 2.0]
    assert _temporaries(small_tmpfs) == []


# --- the one JSON decoder and the one liveness check ---------------------------------------------------
def _fail(where, why):
    return ValueError(f"{where}: {why}")


def test_decode_json_policies():
    from dlperf._io import decode_json

    assert decode_json(b'{"a": NaN}', "f", _fail)["a"] != 0  # NaN allowed by default
    with pytest.raises(ValueError, match="f: not valid JSON .*NaN is not a number"):
        decode_json(b'{"a": NaN}', "f", _fail, allow_nan=False)
    with pytest.raises(ValueError, match="Infinity is not a number"):
        decode_json(b'[-Infinity]', "f", _fail, allow_nan=False)
    assert decode_json(b'{"a": 1, "a": 2}', "f", _fail) == {"a": 2}
    with pytest.raises(ValueError, match="key 'a' appears twice"):
        decode_json(b'{"b": {"a": 1, "a": 2}}', "f", _fail, unique_keys=True)
    with pytest.raises(ValueError, match="f: larger than 4 bytes"):
        decode_json(b'[1, 2]', "f", _fail, max_bytes=4)
    with pytest.raises(ValueError, match="not valid JSON"):
        decode_json(b"[" * 100_000, "f", _fail)


def test_process_alive():
    from dlperf._io import process_alive

    assert process_alive(os.getpid())
    assert not process_alive(_dead_pid())
    assert not process_alive(0) and not process_alive(-1) and not process_alive(2**80)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_proc_stat_reads_a_name_with_spaces_and_parentheses_and_sees_a_zombie():
    """One parser of /proc/<pid>/stat: the launcher's fault handling and process_alive read it alike."""
    from dlperf._io import proc_stat, process_alive
    from dlperf.parallel.launchers.faults import _group_and_session

    fields = proc_stat(os.getpid())
    assert fields is not None and fields[0] in "RS"
    assert (int(fields[2]), int(fields[3])) == (os.getpgrp(), os.getsid(0)) == _group_and_session(str(os.getpid()))
    # the command name, in parentheses, may hold both and spaces: "(a) 1 (b)"
    renamed = "import sys; open('/proc/self/comm', 'w').write('a) 1 (b'); print(flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", renamed], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        with open(f"/proc/{child.pid}/stat") as f:
            assert "(a) 1 (b)" in f.read()
        fields = proc_stat(child.pid)
        assert fields is not None and fields[0] in "RS" and process_alive(child.pid)
        assert _group_and_session(str(child.pid)) == (os.getpgrp(), os.getsid(0))
        child.stdin.close()
        deadline = time.monotonic() + 10
        while proc_stat(child.pid)[0] != "Z" and time.monotonic() < deadline:  # exited, not yet reaped
            time.sleep(0.01)
        assert proc_stat(child.pid)[0] == "Z" and not process_alive(child.pid)
        assert _group_and_session(str(child.pid)) is None
    finally:
        child.wait(timeout=10)
    assert proc_stat(child.pid) is None and proc_stat(_dead_pid()) is None
