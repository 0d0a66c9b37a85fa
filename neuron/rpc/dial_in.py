"""Ranks that dial in: workers an orchestrator starts (Kubernetes LeaderWorkerSet, SLURM job steps,
systemd) with `neuron --worker --connect LEADER:PORT --rank N`, speaking the protocol over TCP.

The leader listens on its cluster address and port only while it waits for ranks (a start or a
rebuild), until every expected rank has dialled in or the start deadline passed. A connection first
says who it is, one JSON line `{"rank": N, "token": T}`; the token must equal the cluster token
(NEURON_CLUSTER_TOKEN or a file, compared in constant time), the rank must be an integer the leader
expects and has not got yet. Anything else is refused with a one-line reason and closed; the refusal
is logged with the peer's address, never with what it sent. An accepted connection stands in for
the worker's process: its end (the worker exits, the host dies, the leader kills it) is the rank's
exit.

The port answers whoever reaches it, token or not, so nothing a connection sends can stop the wait
or outlast its deadline: connections are greeted side by side (at most `_MAX_HELLOS` at once, the
oldest closed past that), each hello has one deadline for the whole line however slowly its bytes
come, it is at most `_HELLO_BYTES` long, and it is decoded against a fixed schema that cannot
recurse, any error of it being a refusal.

The worker keeps dialling until the leader listens (and when the leader closed the connection
without answering), serves one connection, and when the leader closes it (a rebuild) dials again; it
exits on `shutdown`, on a refusal, or when it cannot reach the leader within its deadline.
"""

from __future__ import annotations

import hmac
import io
import logging
import selectors
import socket
import subprocess
import threading
import time

import msgspec

from neuron.errors import ConfigError, NeuronError

log = logging.getLogger("neuron.dial_in")

_HELLO_S = 5.0  # a connection's whole first line is due this long after it was accepted
_HELLO_BYTES = 4096
_MAX_HELLOS = 64  # connections saying hello at once; past it the oldest is closed unanswered
_TICK_S = 1.0  # the longest a wait sleeps without looking at its deadlines (close() wakes it at once)
_HELLO_FORMAT = 'the first line must be {"rank": N, "token": "..."}'
# TCP keepalive on both ends: a connection whose peer vanished (its host down, a link cut, a half
# that closed while the link was down) fails within about idle + interval x count seconds even
# while nothing is sent, so a worker dials again and the leader learns of the loss.
_KEEPALIVE = (5, 2, 3)  # idle, interval, count
_USER_TIMEOUT_MS = 15_000  # unacknowledged data fails the connection after this long


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = _KEEPALIVE
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count),
                        ("TCP_USER_TIMEOUT", _USER_TIMEOUT_MS)):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class DialInFailed(NeuronError):
    """Not every expected rank dialled in before the deadline."""


class Refused(ConnectionRefusedError):
    """The leader refused this rank; the message is its reason."""


class Hello(msgspec.Struct, forbid_unknown_fields=True):
    """A dialling rank's first line. A fixed schema, unknown fields refused rather than skipped:
    decoding it never descends into whatever nesting a peer sends."""

    rank: int  # msgspec takes neither `true` nor `1.0` for an int
    token: str


class _Answer(msgspec.Struct):
    """The leader's answer to a hello."""

    welcome: bool = False
    refused: str = ""


_hello_decoder = msgspec.json.Decoder(Hello)
_answer_decoder = msgspec.json.Decoder(_Answer)
_encoder = msgspec.json.Encoder()


def cluster_token(token: str | None, token_file: str | None) -> str:
    """The shared secret ranks that dial in present: the setting, else the file's first line."""
    if not token and token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.readline().strip()
        except OSError as exc:
            raise ConfigError(f"cluster token file {token_file}: {exc.strerror}") from None
    if not token:
        raise ConfigError("ranks that dial in need a shared secret: set NEURON_CLUSTER_TOKEN or "
                          "NEURON_CLUSTER_TOKEN_FILE on the leader and on every worker")
    return token


class Connection:
    """A dialled-in worker's socket, shaped like the `subprocess.Popen` the pool otherwise holds:
    `stdin`/`stdout` carry the protocol, `stderr` is empty (the worker logs where it runs),
    `poll`/`wait` say whether it has ended, `kill` ends it."""

    pid = None  # nothing local to look at: no process state, no signals

    def __init__(self, sock: socket.socket, peer: str, reader):
        self.sock, self.peer = sock, peer
        self.stdin = sock.makefile("wb")
        self.stdout = _Watched(reader, self._ended)
        self.stderr = io.BytesIO()
        self.returncode: int | None = None
        self._closed = threading.Event()

    def _ended(self) -> None:
        if self.returncode is None:
            self.returncode = 0
        self._closed.set()

    def poll(self) -> int | None:
        return self.returncode if self._closed.is_set() else None

    def kill(self) -> None:
        if self.returncode is None:
            self.returncode = -9
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # the reader sees EOF; the worker sees its end
        except OSError:
            pass
        self._closed.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._closed.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank at {self.peer}", timeout)
        self.sock.close()
        return self.returncode


class _Watched:
    """A reader that reports its end of file (or error) once."""

    def __init__(self, reader, on_end):
        self._reader, self._on_end = reader, on_end

    def readline(self, limit: int = -1) -> bytes:
        try:
            line = self._reader.readline(limit)
        except (OSError, ValueError):
            line = b""
        if not line:
            self._on_end()
        return line


class Listener:
    """The leader's listening socket for ranks that dial in. Bound at construction, so that an
    address or port it cannot have fails the start at once; it listens until that first wait for
    ranks ends, and each later wait (a rebuild) listens again on the same port."""

    def __init__(self, address: str, port: int, token: str, hello_s: float = _HELLO_S):
        self.token = token.encode()
        self.hello_s = hello_s
        self._host = address
        self._lock = threading.Lock()  # close() comes from other threads
        self.closed = False
        self._waiting = False  # a wait selects on the socket: it closes the socket itself
        try:
            self._sock: socket.socket | None = self._listen(port)
        except OSError as exc:
            raise ConfigError(f"cannot listen for dialling ranks on {address}:{port}: {exc.strerror}") from None
        self.port = self._sock.getsockname()[1]
        self.address = f"{address}:{self.port}"

    def _listen(self, port: int) -> socket.socket:
        sock = socket.create_server((self._host, port), backlog=2 * _MAX_HELLOS)
        sock.setblocking(False)
        return sock

    def accept(self, ranks: set[int], deadline_s: float) -> dict[int, Connection]:
        """A connection for each of `ranks`, as they dial in; raises DialInFailed at the deadline,
        or at once when the listener is closed meanwhile. The port listens until then only."""
        greeter = _Greeter(self, self._open(), ranks, deadline_s)
        log.info("waiting for rank(s) %s to dial in on %s", ", ".join(map(str, sorted(ranks))), self.address)
        try:
            return greeter.run()
        finally:
            greeter.close()
            self._stop_listening()

    def _open(self) -> socket.socket:
        with self._lock:
            if self.closed:
                raise DialInFailed("stopped waiting for ranks to dial in")
            if self._sock is None:
                try:
                    self._sock = self._listen(self.port)
                except OSError as exc:
                    raise DialInFailed(f"cannot listen again for dialling ranks on {self.address}: "
                                       f"{exc.strerror}") from None
            self._waiting = True
            return self._sock

    def _stop_listening(self) -> None:
        with self._lock:
            self._waiting = False
            if self._sock is not None:
                self._sock.close()  # connections not yet accepted are reset; their workers dial again
                self._sock = None

    def close(self) -> None:
        """For good, from any thread; a wait under way gives up at once."""
        with self._lock:
            self.closed = True
            if self._sock is None:
                return
            if self._waiting:  # wake its select (Linux); closing the socket here would not
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            else:
                self._sock.close()
                self._sock = None


class _Greeting:
    """A connection that has yet to say who it is."""

    __slots__ = ("sock", "peer", "due", "data")

    def __init__(self, sock: socket.socket, peer: str, due: float):
        self.sock, self.peer, self.due, self.data = sock, peer, due, b""


class _Greeter:
    """One wait for ranks: the listening socket and every connection saying hello, in one
    selector, so that no connection waits on another, and every deadline is looked at."""

    def __init__(self, listener: Listener, sock: socket.socket, ranks: set[int], deadline_s: float):
        self.listener, self.sock, self.ranks, self.deadline_s = listener, sock, ranks, deadline_s
        self.end = time.monotonic() + deadline_s
        self.got: dict[int, Connection] = {}
        self.pending: dict[socket.socket, _Greeting] = {}  # in order of arrival, the oldest first
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ)

    def run(self) -> dict[int, Connection]:
        while len(self.got) < len(self.ranks):
            now = time.monotonic()
            if self.listener.closed:
                raise DialInFailed("stopped waiting for ranks to dial in")
            if now >= self.end:
                missing = sorted(self.ranks - set(self.got))
                raise DialInFailed(f"rank(s) {', '.join(map(str, missing))} did not dial in to "
                                   f"{self.listener.address} within {self.deadline_s:.0f}s")
            self._expire(now)
            due = min([self.end, *(g.due for g in self.pending.values())])
            for key, _ in self.selector.select(min(due - now, _TICK_S)):
                if key.fileobj is self.sock:
                    self._accept_one()
                else:
                    self._read(key.data)
        return self.got

    def close(self) -> None:
        """Whatever the wait ends with: connections still saying hello are refused, and on a failed
        wait the ranks that did join are let go, so nothing of it stays connected."""
        if len(self.got) < len(self.ranks):
            for conn in self.got.values():
                conn.kill()
        for g in list(self.pending.values()):
            self._refuse(g, "this leader is no longer waiting for ranks")
        self.selector.close()

    def _accept_one(self) -> None:
        """One connection per wake-up, the hellos already sent read in between: a flood of new
        connections cannot push a rank that has spoken out of the bound."""
        try:
            sock, addr = self.sock.accept()
        except (BlockingIOError, ConnectionAbortedError):  # gone before it was accepted
            return
        except OSError as exc:
            if self.listener.closed:
                raise DialInFailed("stopped waiting for ranks to dial in") from None
            log.warning("cannot accept a rank dialling in to %s: %s", self.listener.address, exc.strerror or exc)
            time.sleep(0.1)  # out of descriptors, say: the connection waits in the backlog meanwhile
            return
        sock.setblocking(False)
        g = _Greeting(sock, f"{addr[0]}:{addr[1]}", min(time.monotonic() + self.listener.hello_s, self.end))
        if len(self.pending) >= _MAX_HELLOS:
            self._drop(next(iter(self.pending.values())), f"{_MAX_HELLOS} connections were saying hello at once")
        self.pending[sock] = g
        self.selector.register(sock, selectors.EVENT_READ, g)

    def _expire(self, now: float) -> None:
        for g in [g for g in self.pending.values() if g.due <= now]:
            self._refuse(g, f"it did not say who it is within {self.listener.hello_s:g} s")

    def _read(self, g: _Greeting) -> None:
        try:
            chunk = g.sock.recv(_HELLO_BYTES + 1 - len(g.data))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._refuse(g, "it closed the connection before saying who it is")
            return
        g.data += chunk
        if b"\n" in g.data:
            self._hello(g)
        elif len(g.data) > _HELLO_BYTES:
            self._refuse(g, f"the first line is longer than {_HELLO_BYTES} bytes")

    def _hello(self, g: _Greeting) -> None:
        line, _, rest = g.data.partition(b"\n")
        try:
            hello = _hello_decoder.decode(line)
            token = hello.token.encode("utf-8", "surrogatepass")
        except Exception as exc:  # noqa: BLE001 - whatever a peer sends ends in a refusal, never in the wait
            # msgspec's message may name a field the peer made up: escaped, so it stays on one line
            self._refuse(g, f"{_HELLO_FORMAT} ({ascii(str(exc)[:200])[1:-1]})")
            return
        if not hmac.compare_digest(token, self.listener.token):
            self._refuse(g, "wrong cluster token")
        elif rest:
            self._refuse(g, "it sent more than its hello before it was welcomed")
        elif hello.rank in self.got:
            self._refuse(g, f"rank {hello.rank} has already dialled in")
        elif hello.rank not in self.ranks:
            self._refuse(g, f"rank {hello.rank} is not one this leader is waiting for")
        else:
            self._welcome(g, hello.rank)

    def _welcome(self, g: _Greeting, rank: int) -> None:
        self._forget(g)
        try:
            g.sock.settimeout(self.listener.hello_s)  # blocking again; one short line into an empty buffer
            g.sock.sendall(b'{"welcome":true}\n')
            g.sock.settimeout(None)
            _keepalive(g.sock)
        except OSError as exc:
            log.warning("refused a rank dialling in from %s: its connection failed (%s)", g.peer, exc)
            g.sock.close()
            return
        self.got[rank] = Connection(g.sock, g.peer, g.sock.makefile("rb"))
        log.info("rank %d dialled in from %s", rank, g.peer)

    def _refuse(self, g: _Greeting, why: str) -> None:
        self._forget(g)
        log.warning("refused a rank dialling in from %s: %s", g.peer, why)
        try:
            g.sock.send(_encoder.encode({"refused": why}) + b"\n")
        except OSError:
            pass
        g.sock.close()

    def _drop(self, g: _Greeting, why: str) -> None:
        """Closed unanswered: a worker whose connection this was dials again."""
        self._forget(g)
        log.warning("closed a connection dialling in from %s unanswered: %s", g.peer, why)
        g.sock.close()

    def _forget(self, g: _Greeting) -> None:
        self.selector.unregister(g.sock)
        del self.pending[g.sock]


def dial(address: str, rank: int, token: str, deadline_s: float):
    """The worker's side: connect to the leader, say who it is, and return the socket and its
    reader once welcomed. Until `deadline_s` it tries again while the leader does not listen or
    closes the connection unanswered (it is not waiting for ranks yet, or had too many connections
    at once). Raises Refused with the leader's reason, or the last OSError at the deadline."""
    host, _, port = address.rpartition(":")
    hello = _encoder.encode(Hello(rank=rank, token=token)) + b"\n"
    end = time.monotonic() + deadline_s
    while True:
        try:
            return _say_hello((host, int(port)), hello, end)
        except Refused:
            raise
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


def _say_hello(address: tuple[str, int], hello: bytes, end: float):
    sock = socket.create_connection(address, timeout=5.0)
    try:
        _keepalive(sock)
        sock.sendall(hello)
        sock.settimeout(max(end - time.monotonic(), 5.0))  # the leader answers once it waits for ranks
        reader = sock.makefile("rb")  # kept: it may already hold the leader's first request
        answer = _answer(reader.readline(_HELLO_BYTES))
        if answer.welcome:
            sock.settimeout(None)
            return sock, reader
    except BaseException:
        sock.close()
        raise
    sock.close()
    if answer.refused:
        raise Refused(answer.refused)
    raise ConnectionResetError("the leader closed the connection without answering")


def _answer(line: bytes) -> _Answer:
    if not line:
        return _Answer()
    try:
        return _answer_decoder.decode(line)
    except (msgspec.MsgspecError, RecursionError, UnicodeDecodeError):
        return _Answer(refused="the leader's answer is not one this worker understands")
