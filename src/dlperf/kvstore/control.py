"""The control channel between a worker and a same-host server: push/pull requests as small JSON frames.

Once payloads travel through shared memory (:mod:`dlperf.kvstore.shm`), a request carries only key names and
slot numbers; over a Unix socket it costs two thread hand-offs per round trip instead of torch RPC's six. The
server listens on an abstract socket under a random name and admits a connection only once it presents the
job's token (:class:`ControlServer`); a frame is a 4-byte length and a JSON document, never unpickled; a worker
keeps a pool of connections per server. A dead peer or a late answer is one :class:`KVStoreLinkError` naming the
server. Who may connect, and why the channel is built this way: docs/design/kvstore.md.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from .._io import decode_json
from .._threads import ServiceThread, join_all
from ..errors import DlperfError

__all__ = ["MAX_CONNECTIONS_PER_WORKER", "MAX_FRAME_BYTES", "MAX_PENDING", "MAX_PENDING_PER_PROCESS", "ControlClient",
           "ControlServer", "KVStoreLinkError"]

MAX_FRAME_BYTES = 64 << 20
MAX_HELLO_BYTES = 4096  # a token and a rank: a stranger gets no bigger buffer than this before it proves itself
MAX_PENDING = 64  # connections waiting to say who they are; more are closed unread
MAX_PENDING_PER_PROCESS = 8  # of those, from one process: a flood from one process leaves room for the workers
MAX_CONNECTIONS_PER_WORKER = 64  # a worker's pool holds one per thread that requests at once
_LENGTH = struct.Struct("<I")
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_ACCEPTS_PER_ROUND = MAX_PENDING  # connections taken from the backlog between two reads of the hellos
_AUTH_TIMEOUT_S = 5.0  # a worker sends its hello right after connecting: a silent peer is dropped after this
_SEND_TIMEOUT_S = 30.0  # a worker that stops reading its answers loses its connection after this
_JOIN_S = 5.0
CONNECT_RETRY_S = 30.0  # the longest a worker keeps trying to connect to a busy server
_CONNECT_WAIT_S = 1  # the longest one connect waits for room in the server's backlog
_FIRST_PAUSE_S = 0.005
_LAST_PAUSE_S = 0.5


class KVStoreLinkError(DlperfError, RuntimeError):
    """A kvstore server's control connection closed, or its answer did not come in time."""


def _encode(doc: Any) -> bytes:
    data = json.dumps(doc, separators=(",", ":")).encode()
    return _LENGTH.pack(len(data)) + data


def _send_frame(sock: socket.socket, doc: Any) -> None:
    sock.sendall(_encode(doc))


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:  # a limit for the whole frame, not per recv: a trickle cannot stretch it
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the frame did not arrive in time")
            sock.settimeout(remaining)
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionResetError("the peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket, limit: int = MAX_FRAME_BYTES, deadline: float | None = None) -> Any:
    """One frame's document; ValueError for one that is too big, not JSON, or nested too deeply."""
    (n,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size, deadline))
    if n > limit:
        raise ValueError(f"a control frame of {n} bytes is over the {limit} limit")
    return decode_json(_recv_exact(sock, n, deadline), f"a control frame of {n} bytes",
                       lambda where, why: ValueError(f"{where} is {why}"))


def _peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end, as the kernel saw it connect."""
    pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


class _Reply:
    """The future a server's handler completes: completing it sends the answer on the connection."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, result: tuple[int, dict, list]) -> None:
        self._done = True
        code, meta, wire = result
        if wire:  # a slice this connection cannot carry: the worker asked for it against the protocol
            code, meta = 1, {"error": "the answer holds tensors, which go through RPC, not the control channel"}
        self._conn.send([code, meta])


class _Connection:
    def __init__(self, sock: socket.socket, spawn: Callable[..., None]) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.unsent = bytearray()  # answers a write could not pass at once; a writer thread drains them
        self.closed = False
        self._spawn = spawn

    def send(self, doc: Any) -> None:
        """Write an answer without waiting for the worker: the caller holds the server's lock."""
        data = _encode(doc)
        with self.lock:
            if self.closed:
                return
            if self.unsent:  # a writer is draining: queue behind it, keeping the order
                if len(self.unsent) + len(data) > MAX_FRAME_BYTES:
                    self._end()  # a worker that sends requests but reads no answers
                else:
                    self.unsent += data
                return
            try:
                sent = self.sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError:  # the worker is gone: end the connection, its thread sees it
                self._end()
                return
            if sent == len(data):
                return
            self.unsent += data[sent:]
        self._spawn(self._drain, "dlperf-kvstore control writer")

    def _drain(self) -> None:
        while True:
            with self.lock:
                if self.closed or not self.unsent:
                    self.unsent.clear()
                    return
                data = bytes(self.unsent)
            try:
                sent = self.sock.send(data)  # blocks for at most SO_SNDTIMEO
            except OSError:  # gone, or stopped reading for that long
                with self.lock:
                    self._end()
                return
            with self.lock:
                del self.unsent[:sent]

    def _end(self) -> None:
        """Shut the connection down (under ``lock``): its reading thread wakes and closes it."""
        self.unsent.clear()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        with self.lock:  # never while another thread writes: the descriptor's number could be reused
            self.closed = True
            self.unsent.clear()
            self.sock.close()


Handler = Callable[[int, int, dict, Any], None]


class _Pending:
    """A connection that has not presented its hello yet: the bytes it sent so far, and its deadline."""

    def __init__(self, sock: socket.socket, pid: int, deadline: float) -> None:
        self.sock = sock
        self.pid = pid
        self.deadline = deadline
        self.data = bytearray()


class ControlServer:
    """Accepts workers' connections; ``handle(src, op, meta, reply)`` answers each request by ``reply.set_result``.

    Threads are bounded whatever local processes do: one thread accepts connections and reads every hello
    itself (non-blocking, each within :data:`_AUTH_TIMEOUT_S`, at most :data:`MAX_PENDING` waiting, at most
    :data:`MAX_PENDING_PER_PROCESS` from one process); a connection gets a thread of its own only once it has
    proved to be a worker's, and each worker at most :data:`MAX_CONNECTIONS_PER_WORKER` of them. A connection
    over a limit is closed at once: a worker's :class:`ControlClient` connects again after a pause.
    """

    def __init__(self, handle: Handler, workers: set[int], what: str) -> None:
        self._handle = handle
        self._workers = workers
        self._what = what
        self.token = secrets.token_hex(16)
        self.name = f"dlperf-kvstore-{secrets.token_hex(8)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.name)
        self._listener.listen(socket.SOMAXCONN)
        self._listener.setblocking(False)
        self._wake_read, self._wake_write = socket.socketpair()
        self._lock = threading.Lock()
        self._conns: list[_Connection] = []
        self._per_worker: dict[int, int] = {}
        self._threads: list[ServiceThread] = []
        self._closed = False
        self._spawn(self._accept, f"dlperf-{what} control accept")

    def thread_count(self) -> int:
        """Threads of this server still running (the accepting one, one per worker connection, writers)."""
        with self._lock:
            return sum(t.is_alive() for t in self._threads)

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = ServiceThread(target, *args, name=name)
        with self._lock:
            # finished threads go, or every connection ever made would stay listed; one that failed stays
            # until close() raises its error
            self._threads = [t for t in self._threads if t.is_alive() or t.error is not None]
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        pending: dict[int, _Pending] = {}
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_read, selectors.EVENT_READ)
            try:
                while not self._closed:
                    now = time.monotonic()
                    timeout = min((p.deadline for p in pending.values()), default=now + _AUTH_TIMEOUT_S) - now
                    for key, _ in sel.select(max(0.0, timeout)):
                        if key.fileobj is self._listener:
                            self._take_new(sel, pending)
                        elif key.fileobj is not self._wake_read and key.fd in pending:
                            self._read_hello(sel, pending, pending[key.fd])
                    now = time.monotonic()
                    for p in [p for p in pending.values() if p.deadline <= now]:  # too slow: dropped
                        self._drop(sel, pending, p)
            finally:
                for p in list(pending.values()):
                    self._drop(sel, pending, p)

    def _take_new(self, sel: selectors.BaseSelector, pending: dict[int, _Pending]) -> None:
        # a batch per wake-up, not until the backlog is empty: a process that connects as fast as this thread
        # accepts would keep it here for good, and the hellos already waiting (the workers') and the
        # deadlines of the silent would never be served
        for _ in range(_ACCEPTS_PER_ROUND):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # closed
                return
            try:
                pid, uid = _peer(sock)
            except OSError:
                pid, uid = -1, -1
            from_pid = sum(p.pid == pid for p in pending.values())
            # another user's process: nothing it sends is read; past a limit: closed before reading too
            if uid != os.getuid() or len(pending) >= MAX_PENDING or from_pid >= MAX_PENDING_PER_PROCESS:
                sock.close()
                continue
            sock.setblocking(False)
            p = _Pending(sock, pid, time.monotonic() + _AUTH_TIMEOUT_S)
            pending[sock.fileno()] = p
            sel.register(sock, selectors.EVENT_READ)

    def _drop(self, sel: selectors.BaseSelector, pending: dict[int, _Pending], p: _Pending) -> None:
        pending.pop(p.sock.fileno(), None)
        try:
            sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        p.sock.close()

    def _read_hello(self, sel: selectors.BaseSelector, pending: dict[int, _Pending], p: _Pending) -> None:
        try:
            chunk = p.sock.recv(_LENGTH.size + MAX_HELLO_BYTES - len(p.data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # closed before it said who it is
            self._drop(sel, pending, p)
            return
        p.data += chunk
        if len(p.data) < _LENGTH.size:
            return
        (n,) = _LENGTH.unpack(p.data[:_LENGTH.size])
        if n > MAX_HELLO_BYTES:
            self._drop(sel, pending, p)
            return
        if len(p.data) < _LENGTH.size + n:
            return
        pending.pop(p.sock.fileno(), None)
        sel.unregister(p.sock)
        rank = self._check_hello(bytes(p.data[_LENGTH.size:_LENGTH.size + n]))
        with self._lock:
            admitted = (rank is not None and not self._closed and len(p.data) == _LENGTH.size + n
                        and self._per_worker.get(rank, 0) < MAX_CONNECTIONS_PER_WORKER)
            if admitted:
                assert rank is not None
                self._per_worker[rank] = self._per_worker.get(rank, 0) + 1
                conn = _Connection(p.sock, self._spawn)
                self._conns.append(conn)
        if not admitted:
            p.sock.close()
            return
        assert rank is not None
        p.sock.setblocking(True)
        self._spawn(self._serve, f"dlperf-{self._what} control connection", conn, rank)

    def _check_hello(self, data: bytes) -> int | None:
        """The worker rank a hello proves, or None."""
        try:
            hello = decode_json(data, "a hello", lambda where, why: ValueError(why))
        except ValueError:
            return None
        rank = hello.get("rank") if isinstance(hello, dict) else None
        token = hello.get("token") if isinstance(hello, dict) else None
        if (isinstance(rank, int) and not isinstance(rank, bool) and rank in self._workers
                and isinstance(token, str) and token.isascii()
                and secrets.compare_digest(token.encode(), self.token.encode())):
            return rank
        return None

    def _serve(self, conn: _Connection, src: int) -> None:
        sock = conn.sock
        try:
            sock.settimeout(None)  # a worker may go quiet for as long as it likes between requests
            # an answer the worker does not read within this ends its connection (see _Connection)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(_SEND_TIMEOUT_S), 0))
            conn.send([0, {}])
            while True:
                request = _recv_frame(sock)
                if not (isinstance(request, list) and len(request) == 2 and isinstance(request[1], dict)):
                    conn.send([1, {"error": f"a control request is [op, meta], not {str(request)[:80]}"}])
                    continue
                self._handle(src, request[0], request[1], _Reply(conn))
        except Exception:  # noqa: BLE001 - closed, timed out, or not a frame of ours: drop the connection
            return
        finally:
            conn.close()
            with self._lock:
                self._per_worker[src] -= 1
                if conn in self._conns:
                    self._conns.remove(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, threads = list(self._conns), list(self._threads)
        try:
            self._wake_write.send(b"\0")  # the accepting thread wakes, sees the flag and ends
        except OSError:
            pass
        for conn in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            join_all(threads, _JOIN_S)  # raises the first error a thread of this server raised
        finally:
            self._listener.close()
            self._wake_read.close()
            self._wake_write.close()


class ControlClient:
    """A worker's connections to one server; :meth:`request` sends, the function it returns reads the answer."""

    def __init__(self, name: str, token: str, rank: int, server: int, timeout_s: float, server_pid: int) -> None:
        """``server_pid``: the server's process, the only peer this worker's token goes to."""
        self._address = "\0" + name
        self._token = token
        self._rank = rank
        self._server = server
        self._server_pid = server_pid
        self._timeout_s = timeout_s
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self, what: str) -> socket.socket:
        """A new connection, tried again with growing pauses while the server's backlog or limits are full
        (``EAGAIN`` after waiting for room, refused, closed unread, the hello not answered in time), for up to
        ``min(timeout_s, CONNECT_RETRY_S)``."""
        start = time.monotonic()
        deadline = start + min(self._timeout_s, CONNECT_RETRY_S)
        pause, tries = _FIRST_PAUSE_S, 0
        while True:
            tries += 1
            try:
                return self._connect_once()
            # (a hello unanswered in time: a server busy with other connections, not one that hangs)
            except (BlockingIOError, ConnectionRefusedError, ConnectionResetError, BrokenPipeError,
                    TimeoutError) as exc:
                if time.monotonic() + pause > deadline:
                    raise KVStoreLinkError(
                        f"kvstore server rank {self._server}'s control socket took no connection for {what} in "
                        f"{tries} tries over {time.monotonic() - start:.1f} s (last: {exc}); its server is gone, "
                        "or other processes keep its connection slots busy") from None
                time.sleep(pause)
                pause = min(2 * pause, _LAST_PAUSE_S)

    def _connect_once(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # a blocking connect waits in the kernel for room in a full backlog (woken as the server accepts),
            # where a timed one fails at once with EAGAIN and loses the room to a process that keeps connecting
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(_CONNECT_WAIT_S), 0))
            sock.connect(self._address)
            sock.settimeout(self._timeout_s)
            pid, _ = _peer(sock)
            if pid != self._server_pid:  # the server exited and another process took its name
                raise ValueError(f"the socket is held by pid {pid}, not the server's pid {self._server_pid}")
            _send_frame(sock, {"token": self._token, "rank": self._rank})
            # a server over its limits closes the connection unread: the caller tries again
            if _recv_frame(sock, deadline=time.monotonic() + 2 * _AUTH_TIMEOUT_S) != [0, {}]:
                raise ValueError("the server refused this worker")
            sock.settimeout(self._timeout_s)  # each answer's limit from here on
        except BaseException:
            sock.close()
            raise
        return sock

    def _fail(self, what: str, exc: BaseException) -> KVStoreLinkError:
        if isinstance(exc, KVStoreLinkError):
            return exc
        if isinstance(exc, TimeoutError):
            return KVStoreLinkError(f"kvstore server rank {self._server} did not answer {what} within timeout_s="
                                    f"{self._timeout_s:g} s; find the rank that hangs, or raise timeout_s if "
                                    "the workers are only far apart")
        return KVStoreLinkError(f"kvstore server rank {self._server}'s control connection failed during {what} "
                                f"({type(exc).__name__}: {exc}); its server process exited, closed its store, or "
                                "dropped the connection")

    def request(self, op: int, meta: dict, what: str) -> Callable[[], tuple[int, dict]]:
        with self._lock:
            if self._closed:
                raise KVStoreLinkError(f"kvstore server rank {self._server}'s control channel was used for {what} "
                                       "after its store closed")
            sock = self._idle.pop() if self._idle else None
        try:
            if sock is None:
                sock = self._connect(what)
            _send_frame(sock, [op, meta])
        except (OSError, ValueError, KVStoreLinkError) as exc:
            if sock is not None:
                sock.close()
            raise self._fail(what, exc) from None

        def wait() -> tuple[int, dict]:
            try:
                answer = _recv_frame(sock)
            except (OSError, ValueError) as exc:
                sock.close()
                raise self._fail(what, exc) from None
            with self._lock:
                if self._closed:  # closed while this answer was on its way: nobody would close it later
                    sock.close()
                else:
                    self._idle.append(sock)
            if not (isinstance(answer, list) and len(answer) == 2 and isinstance(answer[1], dict)):
                raise KVStoreLinkError(f"kvstore server rank {self._server} answered {what} with "
                                       f"{str(answer)[:80]}; expected [code, meta]: every rank must run the "
                                       "same dlperf")
            return answer[0], answer[1]

        return wait

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()
