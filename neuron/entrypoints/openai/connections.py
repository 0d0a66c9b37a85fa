"""What one HTTP client may hold of the server: a bounded number of connections, each with
deadlines on reading its request.

Uvicorn on its own holds a connection that sends nothing, half its headers or half its body for
as long as the client likes, accepts connections without limit (its `limit_concurrency` answers
503 only once a request's headers have arrived) and reads a body's trickle after the response
forever. Idle connections then use up the leader's descriptors, and a rebuild of the ranks, which
needs pipes and sockets, fails. Here:

- past `max_connections` open connections, or `max_per_client` from one client address, a new
  one gets 503 with Retry-After and is closed;
- a request's headers must arrive within `header_timeout_s` (a partial head gets 408);
- a body may not pause longer than `body_timeout_s`, and the whole of it must arrive within
  `body_timeout_s` plus one second per `min_body_rate` bytes received (408, from `BodyTimeout`,
  while a handler reads it; the connection is closed a moment later if nothing reads it), and what
  is left of a body once its response is sent must arrive within `body_timeout_s`, however it
  trickles;
- a request that declares both Content-Length and Transfer-Encoding gets 400 and its connection
  is closed (RFC 9112 6.1: the two framings could be read differently by a proxy in front), and
  one from a browser page of an origin not allowed gets 403 (`RequestGuard`);
- an idle keep-alive connection is closed after `idle_timeout_s` (Uvicorn's own timer).

The connection cap is kept below the open-file limit by a margin that a rebuild needs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import resource
import time
from dataclasses import dataclass

import anyio
import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from neuron.config import settings
from neuron.entrypoints.openai.api_errors import APIError

log = logging.getLogger("neuron.server")

# Descriptors kept free for the leader itself, its log and model files, and a rebuild of the ranks:
# per rank its three pipes, store and gloo pair sockets, with room to spare.
FD_RESERVE = 256
FD_RESERVE_PER_RANK = 32
_BODY_BACKSTOP_S = 1.0  # after `BodyTimeout`'s own deadline, for a body nothing reads
_REJECT_LINGER_S = 1.0  # a refused client may still be sending its request: read and drop it this long
MAX_LINGERING = 64  # refused connections lingering at once; beyond that they are cut at once


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float
    max_per_client: int = 0  # connections from one address; 0: no such cap

    @classmethod
    def from_settings(cls) -> ConnectionLimits:
        s = settings()
        return cls(s.max_connections, s.header_timeout_s, s.body_timeout_s, s.idle_timeout_s,
                   s.max_connections_per_client)


def _raw_response(status: int, reason: str, error: APIError) -> bytes:
    """A whole response written straight to the socket, outside h11 (no request was parsed)."""
    body = msgspec.json.encode(error.body())
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close", *(f"{k}: {v}" for k, v in error.headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


_TOO_MANY = _raw_response(503, "Service Unavailable", APIError(
    503, "the server has too many open connections; retry shortly", type="server_error", code="overloaded",
    headers={"retry-after": "1"}))
_HEAD_TIMEOUT = _raw_response(408, "Request Timeout", APIError(
    408, "the request headers did not arrive in time", code="request_timeout"))


class GuardedH11Protocol(H11Protocol):
    """Uvicorn's h11 protocol with the connection cap and read deadlines; `guarded_protocol` binds
    the limits. One timer per connection: the head's deadline, then the body's backstop."""

    limits: ConnectionLimits
    lingering = 0  # refused connections still open, on this server
    per_client: dict[str, int]  # open connections by client address, on this server

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._refused = self._lingering = False
        self._draining = False  # the response is sent; the rest of the body is read only to drop it
        self._address: str | None = None  # counted in per_client

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self._client_address(transport)
        if len(self.connections) > self.limits.max_connections or self._over_client_cap(address):
            self.connections.discard(self)
            self._refuse()
            return
        if address is not None:
            self.per_client[address] = self.per_client.get(address, 0) + 1
            self._address = address
        self._arm(self.limits.header_timeout_s, self._head_timed_out)

    def _client_address(self, transport) -> str | None:
        """The client's address when connections are capped per client (a TCP peer), else None."""
        peer = transport.get_extra_info("peername") if self.limits.max_per_client else None
        return peer[0] if isinstance(peer, tuple) and peer else None

    def _over_client_cap(self, address: str | None) -> bool:
        return address is not None and self.per_client.get(address, 0) >= self.limits.max_per_client

    def _refuse(self) -> None:
        """503 at once; then read and drop what the client still sends for a moment, so closing does
        not reset the connection before the client has read the answer."""
        self._refused = True
        self.transport.write(_TOO_MANY)
        cls = type(self)
        if cls.lingering >= MAX_LINGERING or not self.transport.can_write_eof():
            self.transport.close()
            return
        cls.lingering += 1
        self._lingering = True
        self.transport.write_eof()
        self._arm(_REJECT_LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self.conn.their_state is h11.IDLE and self._timer is None:  # the first bytes of a next request
            self._arm(self.limits.header_timeout_s, self._head_timed_out)
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if not self._draining:  # a deadline per pause: the handler reading it answers 408 before this
                self._arm(self.limits.body_timeout_s + _BODY_BACKSTOP_S, self._body_stalled)
        elif state is h11.IDLE:
            if self._draining:  # the dropped body has ended: the next request's head gets its deadline
                self._draining = False
                self._arm(self.limits.header_timeout_s, self._head_timed_out)
        else:
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            # Answered before its body was read (401, 413, 405): one deadline for the rest, not one
            # per byte, so a trickle cannot hold the connection.
            self._draining = True
            self._arm(self.limits.body_timeout_s, self._body_stalled)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._address is not None:
            left = self.per_client.pop(self._address) - 1
            if left:
                self.per_client[self._address] = left
            self._address = None
        if self._refused:
            if self._lingering:
                type(self).lingering -= 1
            return
        super().connection_lost(exc)

    def _head_timed_out(self) -> None:
        self._timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        partial = bool(self.conn.trailing_data[0])
        if partial:  # a connection that never sent a byte is simply closed, like an idle one
            log.info("closing a connection whose request headers took over %g s", self.limits.header_timeout_s)
            self.transport.write(_HEAD_TIMEOUT)
        self.transport.close()

    def _body_stalled(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            log.info("closing a connection whose request body paused over %g s", self.limits.body_timeout_s)
            self.transport.close()

    def _arm(self, delay_s: float, callback) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol class for one server, with its limits and its own count of refused connections."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "lingering": 0, "per_client": {}})


async def send_error(send, error: APIError, close: bool = False) -> None:
    """A whole JSON error response through ASGI, optionally closing the connection after it."""
    body = msgspec.json.encode(error.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
               *((k.encode(), str(v).encode()) for k, v in error.headers.items())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class BodyTimeout:
    """ASGI middleware: a request body that pauses over `timeout_s` between two reads, or arrives
    more slowly than `min_rate` bytes/s after a head start of `timeout_s`, ends the request with 408
    and closes its connection. The handler is cancelled where it waits for the body, so no error is
    logged for it."""

    def __init__(self, app, timeout_s: float, min_rate: int):
        self.app = app
        self.timeout_s = timeout_s
        self.min_rate = min_rate

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(receive, send, self.timeout_s, self.min_rate)
        with exchange.scope:
            await self.app(scope, exchange.receive, exchange.send)
        if exchange.timed_out and not exchange.started:
            await send_error(send, APIError(408, exchange.timed_out, code="request_timeout"), close=True)


class _Exchange:
    """One request's receive and send as the handler sees them under `BodyTimeout`."""

    def __init__(self, receive, send, timeout_s: float, min_rate: int):
        self._receive, self._send, self.timeout_s, self.min_rate = receive, send, timeout_s, min_rate
        self.scope = anyio.CancelScope()
        self.body_done = self.started = False
        self.timed_out = ""  # why, once it has
        self._start: float | None = None
        self._received = 0

    def _wait_s(self) -> tuple[float, str]:
        """How long the next read may wait, and what to say if it waits that long in vain."""
        now = time.monotonic()
        if self._start is None:
            self._start = now
        due = self._start + self.timeout_s + self._received / self.min_rate - now
        if due < self.timeout_s:
            return max(due, 0.0), f"the request body arrived at under {self.min_rate} bytes/s"
        return self.timeout_s, f"the request body paused for over {self.timeout_s:g} s"

    async def receive(self):
        if self.body_done:  # later receives wait for a disconnect, as long as a stream runs
            return await self._receive()
        wait_s, why = self._wait_s()
        with anyio.move_on_after(wait_s):
            message = await self._receive()
            self._received += len(message.get("body", b""))
            self.body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message
        log.info("%s; answering 408", why)
        self.timed_out = why
        self.scope.cancel()
        await anyio.lowlevel.checkpoint()  # the handler is cancelled here
        return {"type": "http.disconnect"}

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


class RequestGuard:
    """ASGI middleware for what a request's head alone shows to be unsafe:

    - both Content-Length and Transfer-Encoding: 400, and the connection is closed, since a proxy
      in front may have framed the body by the other header (request smuggling, RFC 9112 6.1);
    - an `Origin` (a browser page's) that is not among `allowed_origins`: 403. A page of any site
      its user opens could otherwise drive a server on that user's machine or network."""

    def __init__(self, app, allowed_origins: frozenset[str]):
        self.app = app
        self.allowed_origins = allowed_origins

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self._refusal(scope)
            if error is not None:
                log.info("%s %r refused: %d %s", scope["method"], scope["path"], error.status, error.code)
                await send_error(send, error, close=True)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> APIError | None:
        names = {name for name, _ in scope["headers"]}
        if b"content-length" in names and b"transfer-encoding" in names:
            return APIError(400, "a request may not carry both Content-Length and Transfer-Encoding",
                            code="ambiguous_framing")
        origin = next((value for name, value in scope["headers"] if name == b"origin"), None)
        if origin is not None and origin.decode("latin-1") not in self.allowed_origins:
            return APIError(403, f"requests from the origin {origin.decode('latin-1')!r} are not allowed; the "
                                 "operator can allow it with --allowed-origins", type="permission_error",
                            code="origin_not_allowed")
        return None


_MAX_REQUEST_ID_HEADER = 256


def header_request_id(headers) -> str | None:
    """The client's (or its proxy's) `X-Request-Id`, when it is 1 to 256 visible ASCII characters:
    vLLM names a chat or completion response by it, before the body's `request_id`."""
    value = headers.get("x-request-id")
    if value is None or not 0 < len(value) <= _MAX_REQUEST_ID_HEADER or not all("!" <= c <= "~" for c in value):
        return None
    return value


class EchoRequestId:
    """ASGI middleware: a request's `X-Request-Id` (header_request_id) comes back on its response,
    for tracing through proxies, as vLLM's `--enable-request-id-headers` does."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = header_request_id({name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
                                   if name == b"x-request-id"})
        if given is None:
            await self.app(scope, receive, send)
            return

        async def echoing(message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", given.encode())]}
            await send(message)

        await self.app(scope, receive, echoing)


def parse_origins(value: str | None) -> frozenset[str]:
    """`--allowed-origins`: comma-separated origins, each as a browser sends it (no trailing slash)."""
    return frozenset(o.strip().rstrip("/") for o in (value or "").split(",") if o.strip())


class RateLimitFilter(logging.Filter):
    """Lets one record of each message through per `interval_s`; the next one let through says how
    many were dropped. asyncio logs every failed accept, and with descriptors exhausted that is as
    often as the loop turns."""

    def __init__(self, interval_s: float = 10.0):
        super().__init__()
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._dropped: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key, now = f"{record.name}:{record.msg}", time.monotonic()
        if now - self._last.get(key, -math.inf) < self.interval_s:
            self._dropped[key] = self._dropped.get(key, 0) + 1
            return False
        self._last[key] = now
        dropped = self._dropped.pop(key, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it in the last {self.interval_s:g} s not logged)"
        return True


def rate_limit_server_logs(interval_s: float = 10.0) -> None:
    """Install `RateLimitFilter` where accept and connection errors are logged."""
    for name in ("asyncio", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
            logger.addFilter(RateLimitFilter(interval_s))


def raise_fd_limit() -> int:
    """Raise the soft open-file limit to the hard one, and return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def connection_cap(wanted: int, tp: int) -> int:
    """`wanted`, lowered so that connections at the cap still leave a rebuild of `tp` ranks the
    descriptors it needs. Raises the soft open-file limit first."""
    limit = raise_fd_limit()
    room = limit - open_fds() - FD_RESERVE - FD_RESERVE_PER_RANK * tp - MAX_LINGERING
    cap = max(1, min(wanted, room))
    if cap < wanted:
        log.warning("serving at most %d connections, not %d: the open-file limit is %d and rebuilding %d rank(s) "
                    "needs some of it; raise `ulimit -n` to serve more", cap, wanted, limit, tp)
    return cap
