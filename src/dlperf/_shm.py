"""A shared-memory segment for the ranks of one host, and the sequence barrier that orders its users.

The segment is an anonymous memory file (``memfd_create``) made by one rank: it has no name in
``/dev/shm`` or anywhere else, so no way a process ends (an exception, ``SIGTERM`` from the launcher's
agent, ``SIGKILL``) can leave it behind. The peers open it through ``/proc/<pid>/fd/<fd>`` of the
creating rank, which closes its descriptor once every rank has mapped it; from then on the segment
lives exactly as long as the mappings. Creation reserves its pages (``posix_fallocate``), so too little
shared memory is one clear error at setup rather than a ``SIGBUS`` at the first write.

Layout: a 64-byte header (magic, layout version, world size, slot bytes, a random token that proves
the opener mapped the creator's segment), one 64-byte control line per rank, then the data area at a
page boundary. A rank writes only its own control line; peers only read it, so lines never bounce
between writers.

The barrier is a sequence counter per rank: arriving at barrier ``s`` stores ``s`` in the rank's line,
and a rank passes once every line holds at least ``s``. It relies on x86-64's store ordering (a store
is never seen before an earlier one; loads are not reordered with loads): data written by torch
before the counter is visible to a peer that sees the counter. Weaker memory models need fences
that Python cannot issue, so :func:`spin_barrier_supported` says no there.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import platform
import secrets
import stat
import time

from ._io import process_alive
from .errors import DlperfError

__all__ = ["ShmAllreduceError", "ShmUnavailableError", "Segment", "SequenceBarrier", "spin_barrier_supported",
           "mapped_segments", "SEGMENT_LABEL"]

SEGMENT_LABEL = "dlperf-shm"
"""The memory file's name, as /proc/<pid>/maps and /proc/<pid>/fd show it (``memfd:dlperf-shm``)."""
_MAGIC = 0x646C7065_72667368  # "dlperfsh"
_VERSION = 2
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
    """These ranks cannot share a segment (other hosts or pid namespaces, not Linux, not x86-64)."""


def spin_barrier_supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and hasattr(os, "memfd_create") \
        and os.path.isdir("/proc/self/fd")


def mapped_segments(pid: int | str = "self") -> tuple[int, int]:
    """(mappings, open descriptors) of segments in process ``pid``: what it still holds of any group.

    Python's mmap keeps a descriptor of its own per mapping, so a process that holds nothing else has as
    many descriptors as mappings; the creator has one more until every peer has mapped the segment.
    """
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = sum(1 for line in f if f"memfd:{SEGMENT_LABEL}" in line)
    except OSError:
        maps = 0
    fds = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                fds += os.readlink(f"/proc/{pid}/fd/{fd}").startswith(f"/memfd:{SEGMENT_LABEL}")
            except OSError:
                continue
    except OSError:
        pass
    return maps, fds


def _sealed_against_shrinking(fd: int) -> bool:
    try:
        return bool(fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK)
    except OSError:  # a file without seals (EINVAL)
        return False


class Segment:
    """One mapped segment: ``ctl`` (int64 words: header, then a line per rank) and the data area."""

    def __init__(self, mm: mmap.mmap, world: int, slot_bytes: int, data_offset: int, fd: int | None = None) -> None:
        self._mm = mm
        self._fd = fd  # the creator's descriptor, which the peers open; closed once they all have
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
    def create(cls, world: int, slot_bytes: int, data_bytes: int) -> tuple[Segment, dict[str, int]]:
        """Make and map a new segment; return it and what a peer needs to open it (pid, fd, token)."""
        offset, size = cls.layout(world, data_bytes)
        try:
            fd = os.memfd_create(SEGMENT_LABEL, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (OSError, AttributeError) as exc:
            raise ShmUnavailableError(f"cannot make an anonymous shared-memory file ({exc}); use "
                                      "torch.distributed.all_reduce") from None
        try:
            os.posix_fallocate(fd, 0, size)
            # Sealed at its size: a peer that opens it read-write cannot shrink it under the other
            # ranks' mappings (their next touch of a lost page would be SIGBUS, not an error).
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            raise ShmUnavailableError(f"cannot reserve a {size / 2**20:.1f} MiB shared-memory segment ({exc}); "
                                      "free shared memory or pass a smaller chunk_bytes") from None
        seg = cls(mm, world, slot_bytes, offset, fd)
        token = secrets.randbits(62)
        seg.ctl[1], seg.ctl[2], seg.ctl[3], seg.ctl[4] = _VERSION, world, slot_bytes, token
        seg.ctl[0] = _MAGIC  # last: a complete header is one with the magic
        return seg, {"pid": os.getpid(), "fd": fd, "token": token}

    @classmethod
    def attach(cls, handle: object, world: int, slot_bytes: int, data_bytes: int) -> Segment:
        """Map the segment a peer created, checking it is the one it announced before trusting it."""
        fields = handle if isinstance(handle, dict) else {}
        pid, fd, token = fields.get("pid"), fields.get("fd"), fields.get("token")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (pid, fd, token)):
            raise ShmUnavailableError(f"the creating rank announced {handle!r}; expected a pid, a descriptor and a "
                                      "token, all integers >= 0: every rank must run the same dlperf")
        path = f"/proc/{pid}/fd/{fd}"
        offset, size = cls.layout(world, data_bytes)
        try:
            # O_NONBLOCK/O_NOCTTY: a hostile pid/fd pair naming a FIFO or a terminal must not block or
            # become our controlling tty; anything but a sealed regular file is refused below.
            fd_here = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError as exc:
            raise ShmUnavailableError(f"cannot open the creating rank's segment {path} ({exc.strerror}): the ranks "
                                      "do not share a host and pid namespace; use torch.distributed.all_reduce") \
                from None
        try:
            st = os.fstat(fd_here)
            if not stat.S_ISREG(st.st_mode) or not _sealed_against_shrinking(fd_here):
                raise ShmUnavailableError(f"{path} is not a sealed shared-memory file: every rank must run the "
                                          "same dlperf; use torch.distributed.all_reduce otherwise")
            actual = st.st_size
            if actual != size:
                raise ShmUnavailableError(f"{path} has {actual} bytes, expected {size}: every rank must pass "
                                          "the same chunk_bytes and run the same dlperf")
            mm = mmap.mmap(fd_here, size)
        finally:
            os.close(fd_here)
        seg = cls(mm, world, slot_bytes, offset)
        header = (seg.ctl[0], seg.ctl[1], seg.ctl[2], seg.ctl[3], seg.ctl[4])
        if header != (_MAGIC, _VERSION, world, slot_bytes, token):
            seg.close()
            raise ShmUnavailableError(f"{path} is not the segment the creating rank announced (header {header}); "
                                      "the ranks do not share a host and pid namespace: use "
                                      "torch.distributed.all_reduce")
        return seg

    def release_handle(self) -> None:
        """Close the creator's descriptor: from now on the segment lives only as long as its mappings."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def buffer(self) -> memoryview:
        """The data area, writable (the caller wraps it with torch.frombuffer and drops it before close)."""
        return memoryview(self._mm)[self.data_offset:]

    def close(self) -> None:
        self.release_handle()
        self.ctl.release()
        try:
            self._mm.close()
        except BufferError:
            # a tensor over the mapping is still alive somewhere; the mapping goes with it
            pass


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
            missing = [(r, i) for r, i in zip(self._others, self._idx) if ctl[i] < seq]
            if not missing:
                return
            now = time.monotonic()
            for r, i in missing:
                state = ctl[self.line(r) + STATE]
                # A peer stores its sequence number before its state: one that arrived, finished and
                # closed between the two reads above has reached this barrier and is not a failure.
                if state in (ABORTED, CLOSED) and ctl[i] < seq:
                    why = "aborted its call (it raised)" if state == ABORTED else "closed the group"
                    raise self._error(f"rank {r} {why}", context)
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY_S
                if self.pids:
                    for r, i in missing:
                        pid = self.pids[r]
                        if not process_alive(pid) and ctl[i] < seq:
                            raise self._error(f"rank {r} (pid {pid}) exited", context)
            waited = now - start
            if waited >= self.timeout_s:
                ranks = ", ".join(str(r) for r, _ in missing)
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
