"""The kvstore control channel against hostile local peers: real sockets and processes, short timeouts."""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import threading
import time

import pytest
import torch

from dlperf.kvstore import control
from dlperf.kvstore.control import ControlClient, ControlServer, KVStoreLinkError


def _frame(doc) -> bytes:
    data = json.dumps(doc).encode()
    return struct.pack("<I", len(data)) + data


def _raw(name: str, timeout: float = 10) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect("\0" + name)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server ended the connection within ``seconds`` (a timeout says it did not)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


class _FakeServer:
    """A listener in this process that answers a hello, then sends ``answer`` as raw bytes."""

    def __init__(self, answer: bytes) -> None:
        self.name = f"dlperf-kvstore-{secrets.token_hex(8)}"
        self.received = bytearray()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.name)
        self._listener.listen(1)
        self._listener.settimeout(10)
        self._answer = answer
        self._thread = threading.Thread(target=self._run, name="fake control server")
        self._thread.start()

    def _run(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        with sock:
            sock.settimeout(5)
            try:
                self.received += sock.recv(4096)
                if self.received:
                    sock.sendall(_frame([0, {}]))
                    self.received += sock.recv(4096)
                    sock.sendall(self._answer)
                sock.recv(1)  # until the client closes
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()
        self._thread.join(10)


@pytest.fixture
def server():
    srv = ControlServer(lambda src, op, meta, reply: reply.set_result((0, {"echo": meta}, [])), {0, 1}, "test")
    try:
        yield srv
    finally:
        srv.close()


@pytest.mark.timeout(30)
def test_a_hello_that_is_too_big_or_trickles_in_is_dropped_at_once(server, monkeypatch):
    sock = _raw(server.name)
    sock.sendall(struct.pack("<I", 1 << 20))  # a stranger asks for a megabyte of buffer
    assert _closed_within(sock, 2)
    monkeypatch.setattr(control, "_AUTH_TIMEOUT_S", 1.0)
    hello = _frame({"token": server.token, "rank": 0})
    sock = _raw(server.name)
    started = time.monotonic()
    stop = threading.Event()

    def trickle():  # one byte every 0.2 s: each recv returns well within any per-call timeout
        for byte in hello[:-1]:
            if stop.wait(0.2):
                return
            try:
                sock.send(bytes([byte]))
            except OSError:
                return

    writer = threading.Thread(target=trickle, name="trickle")
    writer.start()
    try:
        assert _closed_within(sock, 5)
        assert time.monotonic() - started < 3
    finally:
        stop.set()
        writer.join(5)


@pytest.mark.timeout(30)
def test_another_users_process_is_dropped_even_with_the_token(server):
    if os.getuid() != 0:
        pytest.skip("switching to another user needs root")
    # a child process of user nobody that holds the token: it must get no answer
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child only makes system calls, then leaves without running any cleanup
        status = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            sock = _raw(server.name, timeout=5)
            try:
                sock.sendall(_frame({"token": server.token, "rank": 0}))
                status = 0 if sock.recv(64) == b"" else 2
            except (BrokenPipeError, ConnectionResetError):
                status = 0
        finally:
            os.write(write_end, bytes([status]))
            os._exit(0)
    os.close(write_end)
    try:
        assert os.read(read_end, 1) == b"\x00"  # 2: answered; 1: could not even try
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    # the same hello from this user is answered
    sock = _raw(server.name)
    sock.sendall(_frame({"token": server.token, "rank": 0}))
    assert sock.recv(64).endswith(b"[0,{}]")
    sock.close()


@pytest.mark.timeout(30)
def test_a_token_goes_only_to_the_servers_process():
    fake = _FakeServer(_frame([0, {}]))
    try:
        # the name's holder is this process, but the worker was told the server is another one
        client = ControlClient(fake.name, "secret-token", 0, 3, timeout_s=5, server_pid=os.getppid())
        with pytest.raises(KVStoreLinkError, match=f"held by pid {os.getpid()}, not the server's pid"):
            client.request(1, {}, "a push")()
        client.close()
    finally:
        fake.close()
    assert b"secret-token" not in fake.received


@pytest.mark.timeout(30)
@pytest.mark.parametrize("answer", [b"[" * 200_000, b"\xff\xfe", b"[0, {}"])
def test_a_server_answering_garbage_gives_one_link_error(answer):
    fake = _FakeServer(struct.pack("<I", len(answer)) + answer)
    client = ControlClient(fake.name, "t", 0, 3, timeout_s=5, server_pid=os.getpid())
    try:
        with pytest.raises(KVStoreLinkError, match="server rank 3's control connection failed during a pull"):
            client.request(2, {}, "a pull")()
    finally:
        client.close()
        fake.close()


@pytest.mark.timeout(60)
def test_a_worker_that_reads_no_answers_never_holds_up_the_others():
    """Answers are written under the server's lock: a full socket must not keep it."""
    big_lock = threading.Lock()  # stands in for the kvstore server's lock, held while answering
    answers = []

    def handle(src, op, meta, reply):
        with big_lock:
            started = time.monotonic()
            reply.set_result((0, {"pad": "x" * 300_000} if op == 98 else {"echo": meta}, []))
            answers.append(time.monotonic() - started)

    srv = ControlServer(handle, {0, 1}, "test")
    greedy = _raw(srv.name)
    try:
        greedy.sendall(_frame({"token": srv.token, "rank": 0}))
        assert greedy.recv(64).endswith(b"[0,{}]")
        for _ in range(8):  # 2.4 MB of answers that it never reads
            greedy.sendall(_frame([98, {}]))
        honest = ControlClient(srv.name, srv.token, 1, 5, timeout_s=3, server_pid=os.getpid())
        for i in range(5):
            assert honest.request(1, {"i": i}, "a push")() == (0, {"echo": {"i": i}})
        honest.close()
        deadline = time.monotonic() + 10
        while len(answers) < 13 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(answers) == 13 and max(answers) < 1.0, answers
    finally:
        greedy.close()
        srv.close()


@pytest.mark.timeout(60)
def test_refused_and_finished_connections_leave_nothing_listed(server):
    for i in range(40):
        sock = _raw(server.name)
        try:
            sock.sendall(_frame({"token": "wrong", "rank": 0}) if i % 2 else b"")
        except (BrokenPipeError, ConnectionResetError):
            pass  # a loaded server still holds this process's earlier ones and closed this one unread: a refusal too
        sock.close()
    client = ControlClient(server.name, server.token, 0, 1, timeout_s=5, server_pid=os.getpid())
    assert client.request(1, {}, "a push")()[0] == 0
    client.close()
    deadline = time.monotonic() + 10
    while server._conns and time.monotonic() < deadline:
        time.sleep(0.02)
    sock = _raw(server.name)  # one more spawn prunes the finished threads
    sock.close()
    time.sleep(0.2)
    assert len(server._conns) <= 1 and len(server._threads) <= 3, (server._conns, server._threads)


@pytest.mark.timeout(30)
def test_a_client_closed_while_an_answer_is_on_its_way_keeps_no_socket():
    gate = threading.Event()
    waiting = []

    def handle(src, op, meta, reply):
        waiting.append(reply)
        gate.set()

    srv = ControlServer(handle, {0}, "test")
    client = ControlClient(srv.name, srv.token, 0, 1, timeout_s=5, server_pid=os.getpid())
    try:
        wait = client.request(2, {}, "a pull")
        assert gate.wait(5)
        client.close()  # the store closes while the pull is in flight
        waiting[0].set_result((0, {"late": True}, []))
        assert wait() == (0, {"late": True})
        assert client._idle == []
        with pytest.raises(KVStoreLinkError, match="used for a push after its store closed"):
            client.request(1, {}, "a push")
    finally:
        client.close()
        srv.close()


def test_a_peer_cannot_shrink_an_arena_under_its_server():
    """A worker opens the arena read-write; a shrink would make the server's next touch of a slot a SIGBUS."""
    from dlperf.kvstore.shm import Arena

    arena = Arena.create(1 << 20)
    view = arena.view(0, 1024, torch.float32)
    try:
        fd = os.open(f"/proc/{arena.handle['pid']}/fd/{arena.handle['fd']}", os.O_RDWR)  # as a peer does
        try:
            size = os.fstat(fd).st_size
            try:
                os.ftruncate(fd, 0)
            except PermissionError:  # sealed: the server's mapping stays whole
                shrunk = False
            else:
                shrunk = True
                os.ftruncate(fd, size)  # back to its size (zeros) before anything touches it
        finally:
            os.close(fd)
        view.fill_(1.0)
        assert not shrunk, "a peer shrank the server's arena: the server's next write would raise SIGBUS"
    finally:
        del view
        arena.close()


_ABUSER = """
import socket, sys, time
name, rounds, held = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kept = []
for i in range(rounds):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect("\\0" + name)
    except OSError:  # the backlog is full: try again, as a flood would
        s.close()
        continue
    if len(kept) < held:
        kept.append(s)  # connected and silent: it never says who it is
    else:
        s.close()
time.sleep(0.5)
"""


@pytest.mark.timeout(60)
def test_a_flood_of_connections_keeps_threads_bounded_and_workers_served(server):
    """Another local process connecting and closing in a loop, and holding some connections silent: the
    workers' requests still go through, and the server never runs a thread per connection."""
    import subprocess
    import sys

    abusers = [subprocess.Popen([sys.executable, "-c", _ABUSER, server.name, "3000", "40"]) for _ in range(3)]
    peak = 0
    clients = [ControlClient(server.name, server.token, rank, 9, timeout_s=20, server_pid=os.getpid())
               for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 40
        done = 0
        while any(a.poll() is None for a in abusers) or done < 50:
            assert time.monotonic() < deadline, "the workers' requests did not get through the flood"
            for client in clients:
                code, reply = client.request(2, {"n": done}, "a pull")()
                assert (code, reply) == (0, {"echo": {"n": done}})
            done += 1
            peak = max(peak, server.thread_count())
    finally:
        for client in clients:
            client.close()
        for a in abusers:
            a.kill()
            a.wait()
    # the accepting thread, and one per worker connection (each client here holds one): not one per connection
    assert peak <= 1 + 2 * 2, peak


_FLOODER = """
import socket, sys
print("flooding", flush=True)
while True:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        sock.connect("\\0" + sys.argv[1])
    except OSError:
        pass
    sock.close()
"""

# a server in a process of its own, as a parameter server is: it prints its name, token and pid, and
# closes when its stdin does
_SERVING = """
import os, sys
from dlperf.kvstore.control import ControlServer
server = ControlServer(lambda src, op, meta, reply: reply.set_result((0, {"echo": meta}, [])), {0, 1}, "t")
print(server.name, server.token, os.getpid(), flush=True)
sys.stdin.read()
server.close()
"""


@pytest.mark.subprocess
@pytest.mark.timeout(90)
def test_new_connections_get_through_a_flood_that_never_pauses():
    """A process that connects and closes as fast as it can, without end: the accepting thread must not
    spend itself on the backlog while the workers' hellos wait unread past their deadline."""
    import subprocess
    import sys

    serving = subprocess.Popen([sys.executable, "-c", _SERVING], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    flooder = None
    try:
        name, token, pid = serving.stdout.readline().split()
        flooder = subprocess.Popen([sys.executable, "-c", _FLOODER, name], stdout=subprocess.PIPE, text=True)
        assert flooder.stdout.readline().strip() == "flooding"
        time.sleep(0.5)  # the flood is under way
        worst = 0.0
        for n in range(30):  # each a fresh connection, with its hello, through the flood
            client = ControlClient(name, token, n % 2, 9, timeout_s=20, server_pid=int(pid))
            started = time.monotonic()
            try:
                assert client.request(2, {"n": n}, "a pull")() == (0, {"echo": {"n": n}})
            finally:
                client.close()
            worst = max(worst, time.monotonic() - started)
        assert flooder.poll() is None  # it flooded throughout
    finally:
        for proc in (flooder, serving):
            if proc is not None:
                proc.kill()
                proc.wait()
                proc.stdout.close()
        serving.stdin.close()
    assert worst < 2 * control._AUTH_TIMEOUT_S, worst  # within a hello's deadline, not after retries


@pytest.mark.timeout(30)
def test_connections_over_the_limits_are_closed_unread(server, monkeypatch):
    monkeypatch.setattr(control, "MAX_PENDING_PER_PROCESS", 2)
    held = [_raw(server.name) for _ in range(2)]  # this process's two silent connections fill its share
    extra = _raw(server.name)
    assert _closed_within(extra, 2)  # a third from the same process: closed at once
    assert not _closed_within(held[0], 0.3)  # those within the limit wait for their hello
    held[1].close()
    # a worker from another process is not held back by this process's connections (here: the same
    # process, once a slot is free again; the client tries again after a pause)
    client = ControlClient(server.name, server.token, 0, 1, timeout_s=5, server_pid=os.getpid())
    try:
        assert client.request(1, {}, "a push")()[0] == 0
    finally:
        client.close()


@pytest.mark.timeout(30)
def test_a_server_that_stays_full_is_one_line_naming_the_cause(server, monkeypatch):
    monkeypatch.setattr(control, "MAX_PENDING_PER_PROCESS", 0)  # every connection closed unread
    monkeypatch.setattr(control, "CONNECT_RETRY_S", 1.0)
    client = ControlClient(server.name, server.token, 0, 1, timeout_s=5, server_pid=os.getpid())
    try:
        started = time.monotonic()
        with pytest.raises(KVStoreLinkError, match="took no connection for a push in .* tries") as info:
            client.request(1, {}, "a push")
        assert time.monotonic() - started < 5
        assert "\n" not in str(info.value) and "exited or closed its store" not in str(info.value)
    finally:
        client.close()
