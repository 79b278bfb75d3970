"""The control channel between a worker and a same-host server: push/pull requests as small JSON frames.

Once a slice's payloads travel through shared memory (:mod:`dlperf.kvstore.shm`), a push or pull
carries only key names and slot numbers. Through torch RPC each such request still passes six threads
(caller, TensorPipe's loops and its handler pool on both sides); on a host whose cores the processes
share, every hand-off waits for a core. Here the worker's calling thread writes one frame to a Unix
socket and reads the answer itself, and one server thread per connection reads the request and
answers it: two hand-offs per round trip.

The server listens on an abstract Unix socket (no file to leave behind) under a random name, and a
connection counts only after its first frame presents the random token that the server gave its
workers over RPC, with the worker's rank. A frame is a 4-byte length and a JSON document: nothing a
peer sends is unpickled or run, and a frame over :data:`MAX_FRAME_BYTES` ends the connection.

A worker keeps a pool of connections per server and takes a free one per request, so requests from
several threads never wait behind each other (a sync pull may wait for a round that another thread's
push of the same worker completes). A dead peer shows as a closed connection, an answer that does not
come within the store's ``timeout_s`` as a timeout: both one :class:`KVStoreLinkError` naming the server.
"""

from __future__ import annotations

import json
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from ..errors import DlperfError

__all__ = ["MAX_FRAME_BYTES", "ControlClient", "ControlServer", "KVStoreLinkError"]

MAX_FRAME_BYTES = 64 << 20
_LENGTH = struct.Struct("<I")
_AUTH_TIMEOUT_S = 30.0
_SEND_TIMEOUT_S = 30.0  # a worker that stops reading its answers loses its connection, not the server's lock
_JOIN_S = 5.0


class KVStoreLinkError(DlperfError, RuntimeError):
    """A kvstore server's control connection closed, or its answer did not come in time."""


def _send_frame(sock: socket.socket, doc: Any) -> None:
    data = json.dumps(doc, separators=(",", ":")).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionResetError("the peer closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket) -> Any:
    (n,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    if n > MAX_FRAME_BYTES:
        raise ValueError(f"a control frame of {n} bytes is over the {MAX_FRAME_BYTES} limit")
    return json.loads(_recv_exact(sock, n))


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
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()

    def send(self, doc: Any) -> None:
        with self.lock:
            try:
                _send_frame(self.sock, doc)
            except OSError:  # the worker is gone or stopped reading: end the connection, its thread sees it
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


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
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                conn = _Connection(sock)
                self._conns.append(conn)
            self._spawn(self._serve, f"{self._what} control connection", conn)

    def _serve(self, conn: _Connection) -> None:
        sock = conn.sock
        try:
            sock.settimeout(_AUTH_TIMEOUT_S)
            hello = _recv_frame(sock)
            rank = hello.get("rank") if isinstance(hello, dict) else None
            if not (isinstance(rank, int) and not isinstance(rank, bool) and rank in self._workers
                    and secrets.compare_digest(str(hello.get("token")), self.token)):
                return
            src = hello["rank"]
            sock.settimeout(None)  # a worker may go quiet for as long as it likes between requests
            # but an answer that cannot be written within this is dropped with the connection: the
            # answering thread holds the server's lock
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
            sock.close()

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

    def __init__(self, name: str, token: str, rank: int, server: int, timeout_s: float) -> None:
        self._address = "\0" + name
        self._token = token
        self._rank = rank
        self._server = server
        self._timeout_s = timeout_s
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._timeout_s)
            sock.connect(self._address)
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
                self._idle.append(sock)
            if not (isinstance(answer, list) and len(answer) == 2 and isinstance(answer[1], dict)):
                raise KVStoreLinkError(f"kvstore server rank {self._server} answered {what} with "
                                       f"{str(answer)[:80]}; expected [code, meta]: every rank must run the "
                                       "same dlperf")
            return answer[0], answer[1]

        return wait

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()
