"""What one HTTP client may hold of the server: a bounded number of connections, each with
deadlines on reading its request.

Uvicorn on its own holds a connection that sends nothing, half its headers or half its body for
as long as the client likes, accepts connections without limit (its `limit_concurrency` answers
503 only once a request's headers have arrived) and reads a body's trickle after the response
forever. Idle connections then use up the leader's descriptors, and a rebuild of the ranks, which
needs pipes and sockets, fails. Here:

- past `max_connections` open connections a new one gets 503 with Retry-After and is closed;
- a request's headers must arrive within `header_timeout_s` (a partial head gets 408);
- a body may not pause longer than `body_timeout_s` (408, from `BodyTimeout`, while a handler
  reads it; the connection is closed a moment later if nothing reads it), and what is left of a
  body once its response is sent must arrive within `body_timeout_s`, however it trickles;
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

    @classmethod
    def from_settings(cls) -> ConnectionLimits:
        s = settings()
        return cls(s.max_connections, s.header_timeout_s, s.body_timeout_s, s.idle_timeout_s)


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

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._refused = self._lingering = False
        self._draining = False  # the response is sent; the rest of the body is read only to drop it

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.connections.discard(self)
            self._refuse()
            return
        self._arm(self.limits.header_timeout_s, self._head_timed_out)

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
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "lingering": 0})


class BodyTimeout:
    """ASGI middleware: a request body that pauses over `timeout_s` between two reads ends the
    request with 408 and closes its connection. The handler is cancelled where it waits for the
    body, so no error is logged for it."""

    def __init__(self, app, timeout_s: float):
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(receive, send, self.timeout_s)
        with exchange.scope:
            await self.app(scope, exchange.receive, exchange.send)
        if exchange.timed_out and not exchange.started:
            error = APIError(408, f"the request body paused for over {self.timeout_s:g} s", code="request_timeout")
            body = msgspec.json.encode(error.body())
            await send({"type": "http.response.start", "status": 408,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})


class _Exchange:
    """One request's receive and send as the handler sees them under `BodyTimeout`."""

    def __init__(self, receive, send, timeout_s: float):
        self._receive, self._send, self.timeout_s = receive, send, timeout_s
        self.scope = anyio.CancelScope()
        self.body_done = self.timed_out = self.started = False

    async def receive(self):
        if self.body_done:  # later receives wait for a disconnect, as long as a stream runs
            return await self._receive()
        with anyio.move_on_after(self.timeout_s):
            message = await self._receive()
            self.body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message
        log.info("request body paused over %g s; answering 408", self.timeout_s)
        self.timed_out = True
        self.scope.cancel()
        await anyio.lowlevel.checkpoint()  # the handler is cancelled here
        return {"type": "http.disconnect"}

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


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
