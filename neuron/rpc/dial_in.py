"""Ranks that dial in: workers an orchestrator starts (Kubernetes LeaderWorkerSet, SLURM job steps,
systemd) with `neuron --worker --connect LEADER:PORT --rank N`, speaking the protocol over TCP.

The leader listens on its cluster address and port while it starts the ranks, and waits until
every expected rank has dialled in, or the start deadline. A connection first says who it is, one
JSON line `{"rank": N, "token": T}`; the token must equal the cluster token (NEURON_CLUSTER_TOKEN
or a file, compared in constant time), the rank must be one the leader expects and has not got
yet. Anything else is refused with a one-line reason and closed; the refusal is logged with the
peer's address, never with what it sent. An accepted connection stands in for the worker's
process: its end (the worker exits, the host dies, the leader kills it) is the rank's exit.

The worker keeps dialling until the leader listens, serves one connection, and when the leader
closes it (a rebuild) dials again; it exits on `shutdown`, on a refusal, or when it cannot reach
the leader within its deadline.
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import socket
import subprocess
import threading
import time

from neuron.errors import ConfigError, NeuronError

log = logging.getLogger("neuron.dial_in")

_HELLO_S = 5.0  # how long a connection may take to say who it is
_HELLO_BYTES = 4096
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
    """The leader's listening socket for ranks that dial in."""

    def __init__(self, address: str, port: int, token: str):
        self.token = token.encode()
        try:
            self.sock = socket.create_server((address, port), backlog=64)
        except OSError as exc:
            raise ConfigError(f"cannot listen for dialling ranks on {address}:{port}: {exc.strerror}") from None
        self.address = f"{address}:{self.sock.getsockname()[1]}"

    def accept(self, ranks: set[int], deadline_s: float) -> dict[int, Connection]:
        """A connection for each of `ranks`, as they dial in; raises DialInFailed at the deadline."""
        got: dict[int, Connection] = {}
        end = time.monotonic() + deadline_s
        log.info("waiting for rank(s) %s to dial in on %s", ", ".join(map(str, sorted(ranks))), self.address)
        while len(got) < len(ranks):
            remaining = end - time.monotonic()
            if remaining <= 0:
                missing = sorted(ranks - set(got))
                for c in got.values():
                    c.kill()
                raise DialInFailed(f"rank(s) {', '.join(map(str, missing))} did not dial in to {self.address} "
                                   f"within {deadline_s:.0f}s")
            self.sock.settimeout(min(remaining, 1.0))
            try:
                sock, (host, port) = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:  # the listener was closed: the start is abandoned
                raise DialInFailed("stopped waiting for ranks to dial in") from None
            rank, conn = self._greet(sock, f"{host}:{port}", ranks - set(got))
            if conn is not None:
                got[rank] = conn
                log.info("rank %d dialled in from %s", rank, conn.peer)
        return got

    def _greet(self, sock: socket.socket, peer: str, expected: set[int]) -> tuple[int, Connection | None]:
        _keepalive(sock)
        sock.settimeout(_HELLO_S)
        reader = sock.makefile("rb")
        try:
            line = reader.readline(_HELLO_BYTES)
            hello = json.loads(line)
            rank, token = hello["rank"], str(hello["token"]).encode()
        except (OSError, ValueError, KeyError, TypeError):
            return -1, self._refuse(sock, peer, "the first line must be {\"rank\": N, \"token\": ...}")
        if not hmac.compare_digest(token, self.token):
            return -1, self._refuse(sock, peer, "wrong cluster token")
        if not isinstance(rank, int) or rank not in expected:
            return -1, self._refuse(sock, peer, f"rank {rank!r} is not one this leader is waiting for")
        sock.settimeout(None)
        sock.sendall(b'{"welcome": true}\n')
        return rank, Connection(sock, peer, reader)

    @staticmethod
    def _refuse(sock: socket.socket, peer: str, why: str) -> None:
        log.warning("refused a rank dialling in from %s: %s", peer, why)
        try:
            sock.sendall(json.dumps({"refused": why}).encode() + b"\n")
        except OSError:
            pass
        sock.close()
        return None

    def close(self) -> None:
        self.sock.close()


def dial(address: str, rank: int, token: str, deadline_s: float):
    """The worker's side: connect to the leader (retrying until `deadline_s`), say who it is, and
    return the socket and its reader once welcomed. Raises ConnectionRefusedError with the
    leader's reason."""
    host, _, port = address.rpartition(":")
    end = time.monotonic() + deadline_s
    while True:
        try:
            sock = socket.create_connection((host, int(port)), timeout=5.0)
            _keepalive(sock)
            break
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)
    sock.sendall(json.dumps({"rank": rank, "token": token}).encode() + b"\n")
    sock.settimeout(max(end - time.monotonic(), 5.0))  # the leader answers once it waits for ranks
    reader = sock.makefile("rb")  # kept: it may already hold the leader's first request
    answer = reader.readline(_HELLO_BYTES)
    try:
        reply = json.loads(answer)
    except ValueError:
        reply = {"refused": "the leader closed the connection"}
    if not reply.get("welcome"):
        sock.close()
        raise ConnectionRefusedError(reply.get("refused", "refused"))
    sock.settimeout(None)
    return sock, reader
