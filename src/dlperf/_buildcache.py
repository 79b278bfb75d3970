"""A per-user cache of compiled shared libraries that only ever loads bytes it has verified.

Shared by everything dlperf compiles (the native plan interpreter of :mod:`dlperf.hybrid.backends.native`,
the probe's C kernels of :mod:`dlperf.probe.kernels`), and by the probe's caches of figures for their
private directories; it sits below both so that neither reaches into the other.

Layout: ``<base>/<subdirs...>/`` (every level created 0700 and checked to belong to the effective
user, with no group or other write permission) holds the library, ``manifest.json`` (its size and
SHA-256, written atomically after the library) and ``.lock``.

Loading reads the cached library into memory, compares its hash with the manifest, writes those
same bytes to a fresh ``mkdtemp`` directory (0700, created by this process) and loads that copy, so
a file swapped in after the check is never the one loaded. Building happens in another fresh
private directory, so a compiler front end that imports whatever library already sits in its build
directory (``torch.utils.cpp_extension.load_inline`` does) only ever sees its own output.

Concurrent builders serialize on ``flock`` of ``.lock``: the kernel drops the lock when its holder
dies, so a process killed mid-compile leaves nothing that blocks the next one, and a live holder is
waited for at most ``wait_s`` seconds (``$DLPERF_BUILD_WAIT_S``, default 900).

Every file of the cache is opened with ``O_NOFOLLOW | O_NONBLOCK`` and used only if it is a regular
file owned by the effective user that group and others cannot write: a link, a FIFO (which would
block a plain ``open`` forever) or a file someone else could have written is reported and rebuilt.
Files are published by :func:`dlperf._io.write_cache_file`, so what is not a regular file of the user
(that link, that FIFO) is never replaced: the fresh build is used and not kept, with one warning.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

from ._cliargs import one_line
from ._io import decode_json, read_bounded, write_cache_file
from .errors import UsageError

log = logging.getLogger("dlperf.hybrid")

T = TypeVar("T")

MANIFEST = "manifest.json"
LOCK = ".lock"
MANIFEST_FORMAT = 1
DEFAULT_WAIT_S = 900.0  # a first compile takes minutes on a loaded two-core machine
WAIT_ENV = "DLPERF_BUILD_WAIT_S"
_MAX_WAIT_S = 7 * 24 * 3600.0
_MAX_MANIFEST_BYTES = 64 * 1024
_SCRATCH_MAX_AGE_S = 24 * 3600.0

_warned: set[str] = set()
_warned_lock = threading.Lock()


class NativeCacheWarning(UserWarning):
    """The cache was not used, or a cached library was not loaded; the message says why."""


class CacheUnsafe(RuntimeError):
    """A cache directory that another user could write to (or that is not a plain directory)."""


class BuildWaitTimeout(RuntimeError):
    """Another live process held the build lock for longer than the caller is willing to wait."""


BUILD_CACHE_ENV = "DLPERF_BUILD_CACHE"


def cache_base() -> str:
    """$XDG_CACHE_HOME, or ~/.cache: the base of every per-user cache dlperf keeps."""
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


def build_cache_base() -> str:
    """The base of the compiled libraries' cache: ``$DLPERF_BUILD_CACHE``, else :func:`cache_base`. Moving the
    figures and plans (``XDG_CACHE_HOME``) need not cost a compile of a minute."""
    return os.environ.get(BUILD_CACHE_ENV) or cache_base()


def build_wait_s() -> float:
    """How long to wait for another process compiling the same library: ``$DLPERF_BUILD_WAIT_S`` or 900 s."""
    text = os.environ.get(WAIT_ENV)
    if text is None or not text.strip():
        return DEFAULT_WAIT_S
    try:
        value = float(text) if len(text) <= 40 else math.nan
    except ValueError:
        value = math.nan
    if not 0 <= value <= _MAX_WAIT_S:  # NaN fails too
        raise UsageError(f"{WAIT_ENV}={text[:40]!r} is not a number of seconds from 0 to {_MAX_WAIT_S:.0f}; "
                         f"set it to e.g. 900, or 0 not to wait for another build")
    return value


@functools.cache
def compiler_identity(compiler: str) -> str:
    """The compiler's resolved path and ``--version`` text, for cache keys: another compiler, another build."""
    path = shutil.which(compiler) or compiler
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=False)
        version = out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        version = f"unavailable ({type(exc).__name__})"
    return f"{os.path.realpath(path)}\n{version}"


def say(message: str) -> None:
    """One note (a warning: shown on stderr where logging is not configured, and by the CLI)."""
    log.warning("%s", message)


def warn_once(message: str) -> None:
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, NativeCacheWarning, stacklevel=3)


# --- private directories ---------------------------------------------------------------------
def private_dir(base: str, subdirs: Sequence[str]) -> str:
    """``base/subdirs...``, creating missing levels 0700; raise CacheUnsafe if any level is not ours."""
    _check_base(base)
    path = base
    for part in subdirs:
        path = os.path.join(path, part)
        try:
            os.mkdir(path, 0o700)
            os.chmod(path, 0o700)  # the umask may have taken bits away; never adds group/other ones
        except FileExistsError:
            pass
        _check_ours(path)
    return path


def _check_base(base: str) -> None:
    if not os.path.isdir(base):
        os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.stat(base)
    euid = os.geteuid()
    sticky = bool(st.st_mode & stat.S_ISVTX)
    # A shared sticky directory such as /tmp is fine as a base: nobody else can rename or remove
    # the private directory made inside it.
    if st.st_uid not in (euid, 0) or (st.st_mode & 0o022 and not sticky):
        raise CacheUnsafe(f"{base} is {_describe(st)}; expected a directory owned by uid {euid} that "
                          f"group and others cannot write (fix: chmod go-w {base}, or set XDG_CACHE_HOME "
                          f"to a private directory)")


def _check_ours(path: str) -> None:
    st = os.lstat(path)
    euid = os.geteuid()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != euid or st.st_mode & 0o022:
        raise CacheUnsafe(f"{path} is {_describe(st)}; expected a directory owned by uid {euid} that group "
                          f"and others cannot write (fix: remove it, or chmod go-w it if it is yours)")


def _check_file(path: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else "not a regular file"
        raise _unsafe(path, f"{kind} owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}")


def _unsafe(path: str, problem: str) -> CacheUnsafe:
    return CacheUnsafe(f"{path} is {problem}; expected a regular file owned by uid {os.geteuid()} that group and "
                       f"others cannot write (fix: remove it)")


def _describe(st: os.stat_result) -> str:
    kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a symbolic link" if stat.S_ISLNK(st.st_mode) \
        else "not a directory"
    return f"{kind} owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}"


# --- build lock ------------------------------------------------------------------------------
class build_lock:  # noqa: N801 - used as a context manager, reads like one
    """Exclusive ``flock`` on ``directory/.lock``, waited for at most ``wait_s`` seconds.

    The file records the holder (pid, host, start time) only to name it in the waiting message;
    the lock itself is the kernel's, released when the holder exits or is killed.
    """

    def __init__(self, directory: str, wait_s: float, what: str):
        self.path = os.path.join(directory, LOCK)
        self.wait_s = wait_s
        self.what = what
        self._fd: int | None = None

    def __enter__(self) -> build_lock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        try:
            _check_file(self.path, os.fstat(fd))
            self._acquire(fd)
            os.ftruncate(fd, 0)
            owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
            os.pwrite(fd, json.dumps(owner).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _acquire(self, fd: int) -> None:
        deadline = time.monotonic() + self.wait_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            if not told:
                say(f"dlperf: waiting up to {self.wait_s:.0f} s for {self._holder(fd)}, which is compiling "
                    f"{self.what} into {os.path.dirname(self.path)} (${WAIT_ENV} sets how long)")
                told = True
            if time.monotonic() >= deadline:
                raise BuildWaitTimeout(
                    f"{self._holder(fd)} has been compiling {self.what} for longer than {self.wait_s:.0f} s "
                    f"(lock {self.path}); let it finish, or stop it and run again (or set ${WAIT_ENV} higher)")
            time.sleep(0.2)

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            owner = decode_json(os.pread(fd, 4096, 0) or b"{}", "lock owner", _unusable, allow_nan=False)
            return f"process {int(owner['pid'])} on {one_line(str(owner['host'])[:64])}"
        except (OSError, ValueError, KeyError, TypeError, OverflowError):
            return "another process"

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None


# --- verified load and build -------------------------------------------------------------------
def load_or_build(*, base: str, subdirs: Sequence[str], filename: str, what: str, expected_time: str,
                  build: Callable[[str], tuple[str, T]], load: Callable[[str], T],
                  wait_s: float | None = None) -> T:
    """The cached library ``filename`` loaded by ``load(path)`` if its hash checks out, else a fresh build.

    ``build(workdir)`` compiles into the empty private ``workdir`` and returns the library's path and
    the loaded object; the library's bytes are then published to the cache with their hash.
    ``wait_s`` bounds the wait for another builder (default :func:`build_wait_s`).
    """
    wait_s = build_wait_s() if wait_s is None else wait_s
    try:
        directory = private_dir(base, subdirs)
    except (CacheUnsafe, OSError) as exc:
        warn_once(f"dlperf: not using the cache for {what}: {exc}; building in a private temporary "
                  f"directory instead, and not keeping the result")
        return _build(None, filename, what, expected_time, build)
    loaded, problem = _load_verified(directory, filename, load)
    if loaded is not None:
        return loaded
    with build_lock(directory, wait_s, what):
        # A builder that held the lock while we waited has published by now.
        loaded, problem = _load_verified(directory, filename, load)
        if loaded is not None:
            return loaded
        if problem:
            warn_once(f"dlperf: not loading {os.path.join(directory, filename)}: {problem}; rebuilding it")
        _remove_abandoned_scratch(directory)
        return _build(directory, filename, what, expected_time, build)


def _remove_abandoned_scratch(directory: str) -> None:
    # A process killed while building or loading leaves its scratch directory behind; none lives a day.
    cutoff = time.time() - _SCRATCH_MAX_AGE_S
    for entry in os.scandir(directory):
        if entry.name.startswith((".build-", ".load-")) and entry.is_dir(follow_symlinks=False) \
                and entry.stat(follow_symlinks=False).st_mtime < cutoff:
            shutil.rmtree(entry.path, ignore_errors=True)


def _load_verified(directory: str, filename: str, load: Callable[[str], T]) -> tuple[T | None, str | None]:
    """(loaded, None) on success, (None, None) when nothing is cached, (None, reason) otherwise."""
    path = os.path.join(directory, filename)
    try:
        data = _read_regular(path, limit=None)
    except FileNotFoundError:
        return None, None
    except (OSError, CacheUnsafe) as exc:
        return None, f"cannot use it ({exc})"
    try:
        manifest = decode_json(_read_regular(os.path.join(directory, MANIFEST), limit=_MAX_MANIFEST_BYTES),
                               MANIFEST, _unusable, allow_nan=False, unique_keys=True)
    except FileNotFoundError:
        return None, f"no {MANIFEST} records its hash"
    except (OSError, ValueError, CacheUnsafe) as exc:
        return None, f"its {MANIFEST} is unusable ({exc})"
    digest = hashlib.sha256(data).hexdigest()
    if not isinstance(manifest, dict) or type(manifest.get("format")) is not int \
            or manifest["format"] != MANIFEST_FORMAT \
            or manifest.get("file") != filename:
        return None, f"its {MANIFEST} is not a format-{MANIFEST_FORMAT} manifest for {filename}"
    if manifest.get("sha256") != digest or manifest.get("size") != len(data):
        return None, f"its SHA-256 {digest[:16]}... does not match the one recorded in {MANIFEST}"
    scratch = tempfile.mkdtemp(prefix=".load-", dir=directory)
    try:
        copy = os.path.join(scratch, filename)
        # The bytes just hashed go to a file in a directory only this process has seen: what gets
        # loaded is exactly what was verified, whatever happens to the cached file meanwhile.
        fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o700)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            return load(copy), None
        except (ImportError, OSError) as exc:
            return None, f"it does not load ({type(exc).__name__}: {exc})"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # the mapping outlives the file


def _unusable(where: str, why: str) -> ValueError:
    return ValueError(f"{where}: {why}")


def _read_regular(path: str, limit: int | None, *, shared: bool = True) -> bytes:
    """The bytes of ``path`` if it is a regular file of ours that nobody else can write (CacheUnsafe if not).

    ``shared=False``: a file in a directory only this process has used (a fresh build's output), whose
    mode is the compiler's and the umask's; it must still be a regular file.
    """
    # no link followed: one could point the cache at any file
    return read_bounded(path, limit, _unsafe, follow_links=False,
                        check=(lambda st: _check_file(path, st)) if shared else None)


def _build(directory: str | None, filename: str, what: str, expected_time: str,
           build: Callable[[str], tuple[str, T]]) -> T:
    try:
        workdir = tempfile.mkdtemp(prefix=".build-", dir=directory)
    except OSError as exc:  # a full or read-only cache: the build itself can still happen elsewhere
        if directory is None:
            raise
        warn_once(f"dlperf: cannot build {what} in {directory} ({exc.strerror or exc}); building in a private "
                  f"temporary directory instead, and not keeping the result")
        return _build(None, filename, what, expected_time, build)
    where = f"cached in {directory}" if directory else "not cached"
    say(f"dlperf: compiling {what} once for this machine and environment ({expected_time}; {where})...")
    start = time.monotonic()
    try:
        library, loaded = build(workdir)
        if directory is not None:
            _keep(directory, filename, library, what)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    say(f"dlperf: compiled {what} in {time.monotonic() - start:.0f} s")
    return loaded


def _keep(directory: str, filename: str, library: str, what: str) -> None:
    """Publish a fresh build with its hash; a cache that cannot take it (a full disk) costs the next
    process a compile, not this one its library."""
    try:
        data = _read_regular(library, limit=None, shared=False)
        manifest = {"format": MANIFEST_FORMAT, "file": filename, "size": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(), "built": time.time()}
        # Library first, manifest second: a reader in between sees a mismatch and takes the lock.
        write_cache_file(os.path.join(directory, filename), data)
        write_cache_file(os.path.join(directory, MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode())
    except (OSError, CacheUnsafe) as exc:
        warn_once(f"dlperf: compiled {what} but could not keep it in the cache: {exc}; the next process "
                  f"compiles it again")
