"""The control channel between a worker and a same-host server: push/pull requests as small JSON frames.

Once a slice's payloads travel through shared memory (:mod:`dlperf.kvstore.shm`), a push or pull
carries only key names and slot numbers. Through torch RPC each such request still passes six threads
(caller, TensorPipe's loops and its handler pool on both sides); on a host whose cores the processes
share, every hand-off waits for a core. Here the worker's calling thread writes one frame to a Unix
socket and reads the answer itself, and one server thread per connection reads the request and
answers it: two hand-offs per round trip.

The server listens on an abstract Unix socket (no file to leave behind) under a random name, and a
connection counts only after its first frame presents the random token that the server gave its
workers over RPC, with the worker's rank. Abstract names are visible to every local user
(``/proc/net/unix``) and any of them may connect, or bind a name its owner has let go: so the server
drops a peer of another user before reading anything, a hello must be small and complete within
:data:`_AUTH_TIMEOUT_S` however slowly it trickles in, and a worker sends its token only to the
server's own process (``SO_PEERCRED``), never to whoever holds the name after the server exits. A frame
is a 4-byte length and a JSON document: nothing a peer sends is unpickled or run, and a frame over
:data:`MAX_FRAME_BYTES`, or nested too deeply to parse, ends the connection.

Answers are written without blocking: a worker that stops reading them gets the rest from a writer
thread of its connection, so the thread answering (which holds the server's lock) never waits for it.

A worker keeps a pool of connections per server and takes a free one per request, so requests from
several threads never wait behind each other (a sync pull may wait for a round that another thread's
push of the same worker completes). A dead peer shows as a closed connection, an answer that does not
come within the store's ``timeout_s`` as a timeout: both one :class:`KVStoreLinkError` naming the server.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from .._io import decode_json
from ..errors import DlperfError

__all__ = ["MAX_FRAME_BYTES", "ControlClient", "ControlServer", "KVStoreLinkError"]

MAX_FRAME_BYTES = 64 << 20
MAX_HELLO_BYTES = 4096  # a token and a rank: a stranger gets no bigger buffer than this before it proves itself
_LENGTH = struct.Struct("<I")
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_AUTH_TIMEOUT_S = 30.0
_SEND_TIMEOUT_S = 30.0  # a worker that stops reading its answers loses its connection after this
_JOIN_S = 5.0


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
        self._spawn(self._drain, "kvstore control writer")

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


class ControlServer:
    """Accepts workers' connections; ``handle(src, op, meta, reply)`` answers each request by ``reply.set_result``."""

    def __init__(self, handle: Handler, workers: set[int], what: str) -> None:
        self._handle = handle
        self._workers = workers
        self._what = what
        self.token = secrets.token_hex(16)
        self.name = f"dlperf-kvstore-{secrets.token_hex(8)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.name)
        self._listener.listen(64)
        self._lock = threading.Lock()
        self._conns: list[_Connection] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._spawn(self._accept, f"{what} control accept")

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            # finished threads go, or every connection ever made would stay listed
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                stranger = _peer(sock)[1] != os.getuid()
            except OSError:
                stranger = True
            with self._lock:
                if self._closed or stranger:  # another user's process: nothing it sends is read
                    sock.close()
                    if self._closed:
                        return
                    continue
                conn = _Connection(sock, self._spawn)
                self._conns.append(conn)
            self._spawn(self._serve, f"{self._what} control connection", conn)

    def _serve(self, conn: _Connection) -> None:
        sock = conn.sock
        try:
            hello = _recv_frame(sock, MAX_HELLO_BYTES, time.monotonic() + _AUTH_TIMEOUT_S)
            rank = hello.get("rank") if isinstance(hello, dict) else None
            token = hello.get("token") if isinstance(hello, dict) else None
            if not (isinstance(rank, int) and not isinstance(rank, bool) and rank in self._workers
                    and isinstance(token, str) and token.isascii()
                    and secrets.compare_digest(token.encode(), self.token.encode())):
                return
            src = rank
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
                if conn in self._conns:
                    self._conns.remove(conn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, threads = list(self._conns), list(self._threads)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for conn in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(_JOIN_S)


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

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._timeout_s)
            sock.connect(self._address)
            pid, _ = _peer(sock)
            if pid != self._server_pid:  # the server exited and another process took its name
                raise ValueError(f"the socket is held by pid {pid}, not the server's pid {self._server_pid}")
            _send_frame(sock, {"token": self._token, "rank": self._rank})
            if _recv_frame(sock) != [0, {}]:
                raise ValueError("the server refused this worker")
        except BaseException:
            sock.close()
            raise
        return sock

    def _fail(self, what: str, exc: BaseException) -> KVStoreLinkError:
        if isinstance(exc, TimeoutError):
            return KVStoreLinkError(f"kvstore server rank {self._server} did not answer {what} within timeout_s="
                                    f"{self._timeout_s:g} s; find the rank that hangs, or raise timeout_s if "
                                    "the workers are only far apart")
        return KVStoreLinkError(f"kvstore server rank {self._server}'s control connection failed during {what} "
                                f"({exc}); the server exited or closed its store")

    def request(self, op: int, meta: dict, what: str) -> Callable[[], tuple[int, dict]]:
        with self._lock:
            if self._closed:
                raise KVStoreLinkError(f"kvstore server rank {self._server}'s control channel was used for {what} "
                                       "after its store closed")
            sock = self._idle.pop() if self._idle else None
        try:
            if sock is None:
                sock = self._connect()
            _send_frame(sock, [op, meta])
        except (OSError, ValueError) as exc:
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
