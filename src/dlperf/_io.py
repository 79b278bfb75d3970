"""The one way dlperf writes and reads the files a user names.

Writes are atomic for regular files: the data goes to a temporary file beside the target, is flushed
to disk, then renamed over it, so a reader (or a crash, or SIGKILL) sees the old file or the new one,
never half of one. Three kinds of target are written in place instead, never replaced:

* the process's own output streams: ``-``, ``/dev/stdout``, ``/dev/stderr`` (and their
  ``/dev/fd``/``/proc/self/fd`` names), and any path that is the file stdout or stderr is open on
  (``dlperf bench --json log >> log``): the data goes through that stream, at its position;
* character devices (``/dev/null``, ``/dev/full``, a terminal);
* FIFOs, opened without blocking: a FIFO no process opens for reading within
  :data:`FIFO_READER_WAIT_S` is refused, never waited on forever.

Block devices and sockets are refused. A full disk is one error naming the path and the bytes that
did not fit; the previous file stays and no temporary is left.

dlperf's own caches (plans, probe figures, compiled libraries) are written by :func:`write_cache_file`,
which is stricter: it replaces only a regular file of this user (mode 0600) and leaves anything else at
the path (a device, a FIFO, a link, a directory, another user's file) as it is, raising one error that
says so; the caller goes on without its cache.

Reads of torch files go through :func:`safe_torch_load`, which unpickles tensors and plain containers
only and turns every failure into one line naming the file. Small files of data (JSON documents, cache
entries, manifests) are read with :func:`read_bounded`: a regular file of bounded size, checked through
the descriptor that is read, never blocking on a FIFO.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import stat
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from .errors import DlperfError, UsageError

__all__ = ["FileAccessError", "decode_json", "atomic_open", "atomic_write_bytes", "atomic_write_text", "check_writable",
           "foreign_file", "no_space_error", "output_stream", "process_alive", "proc_stat", "read_bounded",
           "safe_torch_load", "save_torch", "tensor_bytes", "write_cache_file"]

_TMP_SUFFIX = ".tmp"
FIFO_READER_WAIT_S = 10.0
"""How long a write to a FIFO waits for a process to open it for reading before it is refused."""
# Room for ".", ".<pid>.<token>.tmp" within the usual 255-byte NAME_MAX.
_MAX_STEM = 200


class FileAccessError(DlperfError, OSError):
    """A path the user named cannot be written or read; the message names it, says why and what to do.

    It is an :class:`OSError` too (``errno`` and ``filename`` are kept), so callers that handle
    file-system errors keep working.
    """

    def __init__(self, path: str | os.PathLike, reason: str, err: int | None = None,
                 action: str = "write") -> None:
        super().__init__(err, reason, os.fspath(path))
        self.action = action

    def __str__(self) -> str:
        return f"cannot {self.action} {self.filename}: {self.strerror}"


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def _wrap(path: Path, exc: OSError, action: str = "write", size: int | None = None,
          replacing: bool = True) -> FileAccessError:
    if isinstance(exc, FileAccessError):
        return exc
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return no_space_error(path, size, exc.errno, kept="any previous file" if replacing else None, action=action)
    if exc.errno == errno.ENXIO:
        return FileAccessError(path, f"no process opened this FIFO for reading within {FIFO_READER_WAIT_S:g} s; "
                                     "start its reader first", exc.errno, action)
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is not None and os.fspath(exc.filename) != os.fspath(path):
        reason = f"{reason}: {exc.filename}"  # e.g. the parent directory could not be created
    return FileAccessError(path, reason, exc.errno, action)


def no_space_error(path: str | os.PathLike, size: int | None, err: int = errno.ENOSPC, *,
                   kept: str | None = "any previous file", free: int | None = None, estimated: bool = False,
                   action: str = "write") -> FileAccessError:
    """The one message for a write that did not fit: the path, the bytes it needed (``estimated``: about
    that many), what is still there (``kept``), the room left (``free``) when known, and the fix."""
    need = "the data" if size is None else f"{'about ' if estimated else ''}{size} bytes"
    where = "quota" if err == errno.EDQUOT else "device"
    notes = ([f"{free} bytes free there"] if free is not None else []) + ([f"{kept} is kept"] if kept else [])
    shown = f" ({', '.join(notes)})" if notes else ""
    return FileAccessError(path, f"no space left on the {where} for {need}{shown}; free some space or write "
                                 "elsewhere", err, action)


def _inspect(path: Path) -> tuple[Path, os.stat_result | None]:
    """The file a write to ``path`` lands in (symlinks followed) and its status, or None if it is new."""
    real = Path(os.path.realpath(path))
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return real, None
    refuse_output_kind(path, st)
    return real, st


def refuse_output_kind(path: str | os.PathLike, st: os.stat_result) -> None:
    """Raise FileAccessError if a file of ``st``'s kind is never written: a directory, block device or socket."""
    if stat.S_ISDIR(st.st_mode):
        raise FileAccessError(path, "it is a directory; give the path of a file (inside it, or beside it)",
                              errno.EISDIR)
    if stat.S_ISBLK(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        raise FileAccessError(path, f"it is a {_kind(st.st_mode)}; give a regular file, a character device "
                                    "or a FIFO", errno.EINVAL)


_STREAM_NAMES = {"-": 1, "/dev/stdout": 1, "/dev/stderr": 2, "/dev/fd/1": 1, "/dev/fd/2": 2,
                 "/proc/self/fd/1": 1, "/proc/self/fd/2": 2}


def output_stream(path: str | os.PathLike) -> int | None:
    """1 or 2 when a write to ``path`` must go through stdout's or stderr's descriptor, else None.

    So for ``-`` and the names of those streams, and for any path that is the very file either is
    open on (same device and inode): replacing that file would throw away what the stream holds.
    """
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if text in _STREAM_NAMES:
        return _STREAM_NAMES[text]
    try:
        st = os.stat(text)
    except (OSError, ValueError):
        return None
    for fd in (1, 2):
        try:
            open_on = os.fstat(fd)
        except OSError:
            continue  # closed
        if (open_on.st_dev, open_on.st_ino) == (st.st_dev, st.st_ino):
            return fd
    return None


@contextmanager
def _in_place(path: Path, fd: int, mode: str, size: int | None) -> Iterator[IO[Any]]:
    """Write through ``fd``, which this function closes; an OSError names ``path``."""
    try:
        with _fdopen(fd, mode) as f:
            yield f
            f.flush()
    except OSError as exc:
        raise _wrap(path, exc, size=size, replacing=False) from None


def _fdopen(fd: int, mode: str) -> IO[Any]:
    return os.fdopen(fd, "w", encoding="utf-8") if mode == "w" else os.fdopen(fd, "wb")


def _open_in_place(real: Path) -> int:
    """A write descriptor on a character device or FIFO; a FIFO no process opens for reading within
    FIFO_READER_WAIT_S fails (ENXIO) instead of blocking the open forever."""
    flags = os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
    deadline = time.monotonic() + FIFO_READER_WAIT_S
    while True:
        try:
            fd = os.open(real, flags)
            break
        except OSError as exc:
            # a reader started beside us (`dlperf ... --json f & cat f`) may open it a moment later
            if exc.errno != errno.ENXIO or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)
    # With a reader present, writes may wait for it to drain the pipe like any other writer's.
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def _tmp_prefix(target: Path) -> str:
    return f".{target.name[:_MAX_STEM]}."


def _remove_orphans(target: Path) -> None:
    """Delete temporaries of ``target`` whose writer process no longer exists (it was killed mid-write)."""
    prefix = _tmp_prefix(target)
    try:
        names = os.listdir(target.parent)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(_TMP_SUFFIX)):
            continue
        pid_text = name[len(prefix):-len(_TMP_SUFFIX)].split(".", 1)[0]
        if not pid_text.isdigit() or process_alive(int(pid_text)):
            continue
        try:
            os.unlink(target.parent / name)
        except OSError:
            pass  # another writer removed it first, or we may not: it is only litter


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts too)."""
    if pid == os.getpid():
        return True  # e.g. another thread of ours may be writing the temporary now
    if pid <= 0:
        return False  # 0 and negatives name process groups, not a process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OverflowError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    fields = proc_stat(pid)
    if not fields:
        return True  # no /proc to ask: kill(0) said it exists
    return fields[0] not in ("Z", "X")  # exited, not yet reaped by its parent: it writes nothing more


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name: state, parent, process group, session...;
    None when there is no such process or no /proc (the name, in parentheses, may hold spaces or ")")."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode("ascii").split()
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable; file systems that cannot sync a directory are left as they are."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EROFS):
            raise
    finally:
        os.close(fd)


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", *, size: int | None = None,
                permissions: int | None = None) -> Iterator[IO[Any]]:
    """Open ``path`` for writing; on a clean exit the new content replaces the old one atomically.

    ``mode`` is ``"wb"`` or ``"w"`` (UTF-8 text); ``size``, when known, is how many bytes will be
    written (a full disk's error says it). If the block raises, the target is untouched and the
    temporary file is removed. A new file gets the mode ``open()`` would give it (0o666 less the
    umask); a replaced file keeps its mode. A symlink keeps pointing where it did: the file it points
    to is replaced. Stdout, stderr, character devices and FIFOs are written in place (see the module
    docstring). Any :class:`OSError` becomes a :class:`FileAccessError` naming ``path``.
    ``permissions`` gives a replaced or new regular file these mode bits instead (e.g. 0o600).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_open writes with mode 'wb' or 'w', not {mode!r}")
    given = Path(path)
    stream = output_stream(given)
    if stream is not None:
        with _through_stream(given, stream, mode, size) as f:
            yield f
        return
    try:
        fd, real, st = _open_target(given)
    except OSError as exc:
        raise _wrap(given, exc) from None
    if fd >= 0:
        with _in_place(given, fd, mode, size) as f:
            yield f
        return
    try:
        if st is not None and not os.access(real, os.W_OK):
            raise FileAccessError(given, "permission denied (the file is read-only)", errno.EACCES)
        real.parent.mkdir(parents=True, exist_ok=True)
        _remove_orphans(real)
        tmp = real.parent / f"{_tmp_prefix(real)}{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        raise _wrap(given, exc) from None
    try:
        if permissions is None:
            _match_mode(fd, st)
        else:
            os.fchmod(fd, permissions)  # set before the rename: the file is never readable more widely
        with _fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, real)  # atomic on POSIX within one file system
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _wrap(given, exc, size=size) from None
        raise
    try:
        _fsync_dir(real.parent)
    except OSError as exc:
        raise _wrap(given, exc) from None


@contextmanager
def _through_stream(path: Path, fd: int, mode: str, size: int | None) -> Iterator[IO[Any]]:
    """Write to ``sys.stdout``/``sys.stderr`` (so what was printed before comes first, and a replaced
    stream, as in a notebook, gets it), or to the descriptor when binary data meets a text-only stream."""
    stream = sys.stdout if fd == 1 else sys.stderr
    target = stream if mode == "w" else getattr(stream, "buffer", None)
    if target is None or stream is None:
        for other in (sys.stdout, sys.stderr):
            if other is not None:
                other.flush()
        with _in_place(path, os.dup(fd), mode, size) as f:
            yield f
        return
    try:
        stream.flush()
        yield target
        target.flush()
    except OSError as exc:
        raise _wrap(path, exc, size=size, replacing=False) from None


def _open_target(given: Path) -> tuple[int, Path, os.stat_result | None]:
    """(descriptor to write in place through, or -1 to replace the file; the file; its status)."""
    real, st = _inspect(given)
    if st is not None and not stat.S_ISREG(st.st_mode):
        return _open_in_place(real), real, st
    return -1, real, st


def _match_mode(fd: int, st: os.stat_result | None) -> None:
    """Give the temporary file the mode (and, when allowed, the owner) the target has or would get."""
    if st is None:
        os.fchmod(fd, 0o666 & ~current_umask())
        return
    os.fchmod(fd, stat.S_IMODE(st.st_mode))
    if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
        try:
            os.fchown(fd, st.st_uid, st.st_gid)
        except OSError:
            pass  # only root may give a file away; the content still arrives


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_open`); return the path."""
    with atomic_open(path, "wb", size=len(data)) as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` as UTF-8 to ``path`` atomically (see :func:`atomic_open`); return the path."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def foreign_file(st: os.stat_result) -> str | None:
    """Why the file of ``st`` (from ``lstat``: a link is not followed) is not one dlperf may replace: not a
    regular file, or another user's; None when it is a regular file of this user."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return f"a {_kind(st.st_mode)}"
    if st.st_uid != os.geteuid():
        return f"a file of uid {st.st_uid}"
    return None


def write_cache_file(path: str | os.PathLike, data: bytes) -> Path:
    """Write one of dlperf's cache files atomically, mode 0600 whatever the umask.

    Only a regular file of this user is replaced. Anything else at ``path`` (a character device such as
    ``/dev/null``, a FIFO, a symbolic link, a directory, another user's file, or the file this process's
    stdout or stderr is open on) is left exactly as it is and :class:`FileAccessError` says what it is:
    a cache is never worth touching a file that is not the cache's. Callers go on without their cache.
    """
    given = Path(path)
    try:
        st: os.stat_result | None = os.lstat(given)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise _wrap(given, exc) from None
    problem = foreign_file(st) if st is not None else None
    if problem is None and output_stream(given) is not None:
        problem = "the file this process's output goes to"
    if problem is not None:
        raise FileAccessError(given, f"it is {problem}, not a cache file dlperf wrote, and is left as it is "
                                     "(point the cache at a path of your own)", errno.EEXIST)
    with atomic_open(given, "wb", size=len(data), permissions=0o600) as f:
        f.write(data)
    return given


def check_writable(path: str | os.PathLike) -> Path:
    """Fail now, with the reason, if ``path`` could not be written later (before hours of work).

    Creates missing parent directories, as the write itself would. Nothing is written to ``path``.
    """
    given = Path(path)
    if output_stream(path) is not None:
        return given
    try:
        real, st = _inspect(given)
        if st is not None and not stat.S_ISREG(st.st_mode):
            if not os.access(real, os.W_OK):
                raise FileAccessError(given, "permission denied", errno.EACCES)
            return given
        if st is not None and not os.access(real, os.W_OK):
            raise FileAccessError(given, "permission denied (the file is read-only)", errno.EACCES)
        real.parent.mkdir(parents=True, exist_ok=True)
        # The rename needs a file created in the directory: try exactly that.
        probe = real.parent / f"{_tmp_prefix(real)}{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        probe.unlink()
    except OSError as exc:
        raise _wrap(given, exc) from None
    return given


def save_torch(path: str | os.PathLike, obj: Any) -> None:
    """``torch.save(obj)`` to ``path`` atomically (see :func:`atomic_open`): a crash leaves the old
    file or the new one.

    A Ctrl-C during the write is raised as KeyboardInterrupt: torch's zip writer, unwinding from it,
    raises a RuntimeError of its own ("unexpected pos") that would otherwise hide the interrupt and
    turn a clean stop into a traceback.
    """
    import torch

    size = tensor_bytes(obj)
    recorder: _WriteErrors | None = None
    try:
        with atomic_open(path, "wb", size=size) as f:
            recorder = _WriteErrors(f)
            torch.save(obj, recorder)  # type: ignore[arg-type]  # a file in all torch uses: write, flush
    except Exception as exc:
        interrupt = _raised_while_interrupted(exc)
        if interrupt is not None:
            raise interrupt from None
        if recorder is not None and recorder.error is not None and not isinstance(exc, OSError):
            # torch's writer turns the OSError of a full disk into "unexpected pos"; the real cause is ours
            raise _wrap(Path(path), recorder.error, size=size) from None
        raise


class _WriteErrors:
    """A file's ``write``/``flush`` that remember the OSError they raised (torch's writer hides it)."""

    def __init__(self, f: IO[Any]) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as exc:
            self.error = exc
            raise


def tensor_bytes(obj: Any) -> int | None:
    """The bytes of the tensors in ``obj`` (plain containers walked), about what torch.save writes."""
    import torch

    total, stack, seen = 0, [obj], 0
    while stack and seen < 1_000_000:
        item = stack.pop()
        seen += 1
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total or None


def _raised_while_interrupted(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C (or termination) ``exc`` was raised while handling, if any."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def safe_torch_load(path: str | os.PathLike, what: str = "checkpoint", expected: str | None = None) -> Any:
    """Load a ``torch.save`` file as data: tensors and plain containers only, onto the CPU.

    ``what`` names the file in messages (e.g. ``"--resume checkpoint"``), ``expected`` says what it
    should hold. Every failure (missing, a directory, a FIFO, corrupt, truncated, pickled objects
    that would run code) is one :class:`~dlperf.errors.UsageError` naming the file. Never blocks on
    a FIFO and never unpickles arbitrary objects.
    """
    import pickle

    import torch

    p = Path(path)
    expected = expected or f"a {what} saved with torch.save"
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; regular files ignore the flag.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UsageError(f"{what} {str(p)!r} does not exist (no such file); check the path") from None
    except OSError as exc:
        raise UsageError(f"cannot read {what} {str(p)!r}: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise UsageError(f"{what} {str(p)!r} is a directory, not a file; give the path of the file")
        raise UsageError(f"{what} {str(p)!r} is a {_kind(mode)}, not a regular file; give {expected}")
    with os.fdopen(fd, "rb") as f:
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
            if found:
                raise UsageError(f"{what} {str(p)!r} is not {expected}: it holds Python objects ({found[1]}) "
                                 "other than tensors and plain containers, which are not loaded because "
                                 "unpickling them could run code") from None
            raise UsageError(f"{what} {str(p)!r} is not {expected} (not a torch.save file)") from None
        except Exception as exc:  # noqa: BLE001 - zip errors, EOFError, RuntimeError: all mean "not that file"
            raise UsageError(f"{what} {str(p)!r} is not {expected} ({_short_reason(exc)})") from None


def read_bounded(path: str | os.PathLike, max_bytes: int | None, fail: Callable[[str, str], Exception], *,
                 follow_links: bool = True, check: Callable[[os.stat_result], None] | None = None) -> bytes:
    """The bytes of the regular file at ``path``, at most ``max_bytes`` (None: no limit).

    The one reader of the small files a user or another process may have put in place (JSON documents,
    cache entries). It never blocks: the file is opened without waiting (a FIFO is refused, not waited
    on) and judged by the descriptor that is then read, so nothing can be swapped in between; and it
    reads at most ``max_bytes + 1`` bytes, so a file that grows meanwhile is refused too.

    ``fail(path, problem)`` makes the caller's one-line error, ``problem`` reading like "a FIFO, not a
    regular file" or "larger than 1048576 bytes (2000000 bytes)"; it is raised for anything but a
    regular file, a file over ``max_bytes``, and a symbolic link when ``follow_links=False``.
    ``check(status)`` may refuse the opened file for reasons of the caller's own (its owner, its mode).
    Any other OSError (no such file, no permission) is the caller's to name.

    >>> read_bounded("/dev/null", 10, lambda path, problem: ValueError(f"{path}: {problem}"))
    Traceback (most recent call last):
    ...
    ValueError: /dev/null: a character device, not a regular file
    """
    text = os.fspath(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(text, flags if follow_links else flags | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links and os.path.islink(text):
            raise fail(text, "a symbolic link, which is not followed here") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise fail(text, f"a {_kind(st.st_mode)}, not a regular file")
        if check is not None:
            check(st)
        if max_bytes is not None and st.st_size > max_bytes:
            raise fail(text, f"larger than {max_bytes} bytes ({st.st_size} bytes)")
        reader = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with reader:
        data = reader.read() if max_bytes is None else reader.read(max_bytes + 1)
    if max_bytes is not None and len(data) > max_bytes:
        raise fail(text, f"larger than {max_bytes} bytes")
    return data


def _json_options(allow_nan: bool, unique_keys: bool) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if not allow_nan:
        options["parse_constant"] = _refuse_constant
    if unique_keys:
        options["object_pairs_hook"] = _unique_object
    return options


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"key {key[:40]!r} appears twice in one object")
        seen.add(key)
    return dict(pairs)


def _short_reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0].strip() if str(exc).strip() else ""
    if not text or "weights_only" in text or "weights only" in text.lower() or len(text) > 120:
        return f"{type(exc).__name__}: unreadable or truncated"
    return text


def decode_json(data: bytes, where: str, fail: Callable[[str, str], Exception], *, allow_nan: bool = True,
                unique_keys: bool = False, max_bytes: int | None = None) -> Any:
    """The JSON document in ``data`` (strict UTF-8), or ``fail(where, why)`` raised: the one decoder for
    what files and peers send, so bad encoding, bad syntax and hostile nesting give one error each.

    ``allow_nan=False`` refuses ``NaN``/``Infinity``; ``unique_keys`` refuses an object naming a key
    twice (which value wins would be the decoder's choice, not the writer's); ``max_bytes`` refuses
    a larger document before decoding it.
    """
    if max_bytes is not None and len(data) > max_bytes:
        raise fail(where, f"larger than {max_bytes} bytes")
    try:
        return json.loads(data.decode("utf-8"), **_json_options(allow_nan, unique_keys))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise fail(where, f"not valid JSON ({type(exc).__name__}: {str(exc)[:80]})") from None


# --- directories replaced as a whole --------------------------------------------------------------
# A directory of several files (an export) is written into a new sibling ``.NAME.TAG-PID-XXXX`` and
# swapped with ``NAME`` in one step; ``.NAME.old-PID-XXXX`` holds the previous one while the two-rename
# fallback has moved it aside.

def _sibling_pattern(target: str, tag: str) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(os.path.basename(target))}\.({re.escape(tag)}|old)-(\d+)-[A-Za-z0-9_]+")


@contextmanager
def atomic_directory(target: str | os.PathLike, tag: str = "new") -> Iterator[str]:
    """A new, empty directory beside ``target`` to fill; on a clean exit it replaces ``target`` whole.

    The files written into it are flushed to disk, then it is swapped with ``target`` in one rename
    (``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere two renames, which :func:`recover_directory`
    and :func:`directory_to_read` undo after a crash between them). If the block raises, ``target``
    is untouched and the new directory removed. What dead processes left beside ``target`` is
    cleaned up first. ``tag`` names the temporaries (``.NAME.TAG-PID-XXXX``).
    """
    import shutil
    import tempfile

    target = os.fspath(target)
    recover_directory(target, tag)
    parent, base = os.path.split(target)
    staging = tempfile.mkdtemp(prefix=f".{base}.{tag}-{os.getpid()}-", dir=parent)
    try:
        os.chmod(staging, 0o777 & ~current_umask())  # mkdtemp's 0700 would become the directory's mode
        yield staging
        # No reader sees the files before the swap, so plain writes suffice; but they must be on
        # disk before it, or a crash right after could leave empty files in place of the old ones.
        for entry in os.scandir(staging):
            if entry.is_file(follow_symlinks=False):
                fd = os.open(entry.path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(Path(staging))
        _swap_directory(staging, target, tag)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # after a swap it holds the previous directory


def recover_directory(target: str, tag: str = "new") -> None:
    """Undo what a killed :func:`atomic_directory` left: put a moved-aside ``target`` back, delete temporaries."""
    import shutil

    parent = os.path.dirname(target)
    pattern = _sibling_pattern(target, tag)
    leftovers = []
    for entry in os.listdir(parent):
        m = pattern.fullmatch(entry)
        if m and not process_alive(int(m.group(2))):
            leftovers.append((m.group(1), os.path.join(parent, entry)))
    for kind, path in sorted(leftovers, key=lambda kp: kp[0] != "old"):
        if kind == "old" and not os.path.exists(target):
            os.rename(path, target)
            _fsync_dir(Path(parent))
        else:
            shutil.rmtree(path, ignore_errors=True)


def directory_to_read(target: str, marker: str, tag: str = "new") -> str:
    """``target``, or while a killed two-rename swap has it moved aside, the newest complete copy
    (one holding ``marker``); ``target`` itself when there is none."""
    if os.path.exists(target):
        return target
    parent = os.path.dirname(target)
    pattern = _sibling_pattern(target, tag)
    try:
        aside = [os.path.join(parent, e) for e in os.listdir(parent)
                 if (m := pattern.fullmatch(e)) and m.group(1) == "old"]
    except OSError:
        return target
    complete = [d for d in aside if os.path.isfile(os.path.join(d, marker))]
    return max(complete, key=os.path.getmtime) if complete else target


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _libc_renameat2() -> Callable[..., int] | None:
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_renameat2 = _libc_renameat2()


def _exchange(a: str, b: str) -> bool:
    """Swap two directory entries in one step; False when the system cannot."""
    import ctypes

    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False  # kernel or file system without RENAME_EXCHANGE
    raise OSError(err, os.strerror(err), b)


def _swap_directory(staging: str, target: str, tag: str) -> None:
    """Make ``staging`` the directory at ``target``; what was there ends up at ``staging``."""
    import shutil

    parent = Path(os.path.dirname(target))
    if not os.path.exists(target):
        try:
            os.rename(staging, target)
            _fsync_dir(parent)
            return
        except OSError as exc:  # another writer created it meanwhile: swap with that one
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    if not _exchange(staging, target):
        # Two renames: a kill between them leaves no ``target`` but a complete ``.old-`` directory,
        # which recover_directory (next write) puts back and directory_to_read reads meanwhile.
        aside = os.path.join(parent, os.path.basename(staging).replace(f".{tag}-", ".old-", 1))
        os.rename(target, aside)
        os.rename(staging, target)
        _fsync_dir(parent)
        shutil.rmtree(aside, ignore_errors=True)
    _fsync_dir(parent)
