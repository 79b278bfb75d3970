"""A shared-memory segment for the ranks of one host, and the sequence barrier that orders its users.

The segment is a file in ``/dev/shm`` created by one rank, mapped by all, and unlinked as soon as every
rank has mapped it: from then on it lives only as long as the mappings, so no process ending (a crash, a
``SIGKILL``) can leave it behind. Creation reserves its pages (``posix_fallocate``), so a full ``/dev/shm``
is one clear error at setup rather than a ``SIGBUS`` at the first write.

Layout: a 64-byte header (magic, layout version, world size, slot bytes, a random token that proves
the opener mapped the creator's file), one 64-byte control line per rank, then the data area at a
page boundary. A rank writes only its own control line; peers only read it, so lines never bounce
between writers.

The barrier is a sequence counter per rank: arriving at barrier ``s`` stores ``s`` in the rank's line,
and a rank passes once every line holds at least ``s``. It relies on x86-64's store ordering (a store
is never seen before an earlier one; loads are not reordered with loads): data written by torch
before the counter is visible to a peer that sees the counter. Weaker memory models need fences
that Python cannot issue, so :func:`spin_barrier_supported` says no there.
"""

from __future__ import annotations

import atexit
import mmap
import os
import platform
import re
import secrets
import threading
import time
import uuid
from collections.abc import Sequence

from ...errors import DlperfError

__all__ = ["ShmAllreduceError", "ShmUnavailableError", "Segment", "SequenceBarrier", "SHM_DIR",
           "spin_barrier_supported", "segment_name", "leftover_segments"]

SHM_DIR = "/dev/shm"
NAME_PREFIX = "dlperf-shm-"
_NAME_RE = re.compile(r"dlperf-shm-[0-9a-f]{32}")
_MAGIC = 0x646C7065_72667368  # "dlperfsh"
_VERSION = 1
HEADER_WORDS = 8
LINE_WORDS = 8  # one 64-byte cache line per rank
_PAGE = 4096

# control-line words
SEQ, STATE, NUMEL, DTYPE, OP = range(5)
# STATE: kept apart from SEQ, so a rank that closes after passing a barrier still counts as arrived there
ABORTED = 1
CLOSED = 2

# waiting: spin this long (a peer a few microseconds behind costs no system call), then yield the core,
# then sleep with a growing interval, checking the peers' processes while asleep
_SPIN_S = 50e-6
_YIELD_S = 2e-3
_MAX_SLEEP_S = 1e-3
_LIVENESS_EVERY_S = 0.02


class ShmAllreduceError(DlperfError, RuntimeError):
    """A peer did not arrive in time, exited, aborted, or passed a different tensor."""


class ShmUnavailableError(DlperfError, RuntimeError):
    """This system or these ranks cannot share a segment (no /dev/shm, other hosts, another architecture)."""


def spin_barrier_supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def segment_name() -> str:
    return NAME_PREFIX + uuid.uuid4().hex


def leftover_segments() -> list[str]:
    """Segments of this module still named in /dev/shm (none once every group finished its setup)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX))
    except OSError:
        return []


# paths created here and not yet unlinked: the only window in which a file exists that no rank unlinks
_created: set[str] = set()
_created_lock = threading.Lock()


def _unlink_created() -> None:
    with _created_lock:
        for path in list(_created):
            _unlink(path)


atexit.register(_unlink_created)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    with _created_lock:
        _created.discard(path)


class Segment:
    """One mapped segment: ``ctl`` (int64 words: header, then a line per rank) and ``data`` (bytes)."""

    def __init__(self, mm: mmap.mmap, path: str, world: int, slot_bytes: int, data_offset: int) -> None:
        self._mm = mm
        self.path = path
        self.world = world
        self.slot_bytes = slot_bytes
        self.data_offset = data_offset
        self.ctl = memoryview(mm).cast("q")

    @staticmethod
    def layout(world: int, data_bytes: int) -> tuple[int, int]:
        """(offset of the data area, total size)."""
        ctl_bytes = 8 * (HEADER_WORDS + LINE_WORDS * world)
        offset = -(-ctl_bytes // _PAGE) * _PAGE
        return offset, offset + -(-data_bytes // _PAGE) * _PAGE

    @classmethod
    def create(cls, name: str, world: int, slot_bytes: int, data_bytes: int) -> tuple[Segment, int]:
        """Create, size and map a new segment; return it and its token. Raises ShmUnavailableError."""
        if not os.path.isdir(SHM_DIR):
            raise ShmUnavailableError(f"{SHM_DIR} does not exist on this system; shared-memory allreduce needs "
                                      "it: use torch.distributed.all_reduce instead")
        path = os.path.join(SHM_DIR, name)
        offset, size = cls.layout(world, data_bytes)
        with _created_lock:
            _created.add(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except OSError as exc:
            _unlink(path)
            raise ShmUnavailableError(f"cannot create a {size / 2**20:.1f} MiB segment {path} ({exc}); free "
                                      f"space in {SHM_DIR} or pass a smaller chunk_bytes") from None
        seg = cls(mm, path, world, slot_bytes, offset)
        token = secrets.randbits(62)
        seg.ctl[1], seg.ctl[2], seg.ctl[3], seg.ctl[4] = _VERSION, world, slot_bytes, token
        seg.ctl[0] = _MAGIC  # last: a complete header is one with the magic
        return seg, token

    @classmethod
    def attach(cls, name: object, world: int, slot_bytes: int, data_bytes: int, token: object) -> Segment:
        """Map the segment a peer created, checking it is the one it announced."""
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ShmUnavailableError(f"the segment name {name!r} from the creating rank is not of the form "
                                      f"{NAME_PREFIX}<32 hex digits>; every rank must run the same dlperf")
        path = os.path.join(SHM_DIR, name)
        offset, size = cls.layout(world, data_bytes)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ShmUnavailableError(f"cannot open {path} ({exc.strerror}): the ranks do not share {SHM_DIR} "
                                      "(different hosts or containers); use torch.distributed.all_reduce") from None
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise ShmUnavailableError(f"{path} has {actual} bytes, expected {size}: every rank must pass "
                                          "the same chunk_bytes and run the same dlperf")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        seg = cls(mm, path, world, slot_bytes, offset)
        header = (seg.ctl[0], seg.ctl[1], seg.ctl[2], seg.ctl[3], seg.ctl[4])
        if header != (_MAGIC, _VERSION, world, slot_bytes, token):
            seg.close()
            raise ShmUnavailableError(f"{path} is not the segment the creating rank announced (header {header}); "
                                      f"the ranks do not share {SHM_DIR}: use torch.distributed.all_reduce")
        return seg

    def unlink(self) -> None:
        _unlink(self.path)

    def buffer(self) -> memoryview:
        """The data area, writable (the caller wraps it with torch.frombuffer and drops it before close)."""
        return memoryview(self._mm)[self.data_offset:]

    def close(self) -> None:
        self.ctl.release()
        try:
            self._mm.close()
        except BufferError:
            # a tensor over the mapping is still alive somewhere; the mapping goes with it
            pass


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")  # exited, not yet reaped by its parent
    except (OSError, IndexError):
        return True


class SequenceBarrier:
    """All ranks of a segment meet here; a late, dead or aborted peer raises one error naming it."""

    def __init__(self, seg: Segment, rank: int, timeout_s: float, pids: dict[int, int] | None = None,
                 what: str = "shm allreduce") -> None:
        """``pids``: each peer's process id, checked while waiting (None: peers in another pid namespace)."""
        self.seg = seg
        self.pids = pids
        self.rank = rank
        self.timeout_s = timeout_s
        self.what = what
        self.seq = 0
        self._mine = HEADER_WORDS + LINE_WORDS * rank
        self._others = [r for r in range(seg.world) if r != rank]
        self._idx = [HEADER_WORDS + LINE_WORDS * r + SEQ for r in self._others]

    def line(self, rank: int) -> int:
        return HEADER_WORDS + LINE_WORDS * rank

    def set_state(self, value: int) -> None:
        self.seg.ctl[self._mine + STATE] = value

    def arrive(self, context: str = "") -> None:
        """Store the next sequence number, then wait for every peer to store it too."""
        self.seq += 1
        seq = self.seq
        ctl = self.seg.ctl
        ctl[self._mine + SEQ] = seq
        idx = self._idx
        for _ in range(64):  # the common case: the peers are already here or a few microseconds away
            for i in idx:
                if ctl[i] < seq:
                    break
            else:
                return
        self._wait(seq, context)

    def _wait(self, seq: int, context: str) -> None:
        ctl = self.seg.ctl
        start = time.monotonic()
        next_check = start + _LIVENESS_EVERY_S
        sleep_s = 1e-5
        while True:
            missing = [r for r, i in zip(self._others, self._idx) if ctl[i] < seq]
            if not missing:
                return
            now = time.monotonic()
            for r in missing:
                state = ctl[self.line(r) + STATE]
                if state in (ABORTED, CLOSED):
                    why = "aborted its call (it raised)" if state == ABORTED else "closed the group"
                    raise self._error(f"rank {r} {why}", context)
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY_S
                if self.pids:
                    for r in missing:
                        pid = self.pids[r]
                        if not process_alive(pid):
                            raise self._error(f"rank {r} (pid {pid}) exited", context)
            waited = now - start
            if waited >= self.timeout_s:
                ranks = ", ".join(str(r) for r in missing)
                raise self._error(f"rank{'s' if len(missing) > 1 else ''} {ranks} did not arrive within "
                                  f"timeout_s={self.timeout_s:g} s", context, hint="find the rank that hangs or "
                                  "runs different code, or raise timeout_s if it is only slow")
            if waited < _SPIN_S:
                continue
            if waited < _YIELD_S:
                os.sched_yield()
                continue
            time.sleep(sleep_s)
            sleep_s = min(sleep_s * 2, _MAX_SLEEP_S)

    def _error(self, cause: str, context: str, hint: str = "the group is unusable now; close it") -> ShmAllreduceError:
        where = f" ({context})" if context else ""
        return ShmAllreduceError(f"{self.what}: {cause} while rank {self.rank} waited at barrier {self.seq}"
                                 f"{where}; {hint}")


def same_values(values: Sequence[object]) -> bool:
    return all(v == values[0] for v in values)
