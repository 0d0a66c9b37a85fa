"""Graceful shutdown: Uvicorn, but SIGINT and SIGTERM drain the engine before the server stops.

Left to itself Uvicorn closes its listening socket at once (new clients get "connection refused",
not an answer a load balancer understands), cancels streams still running after its own timeout in
the middle of a chunk, and re-raises the signal once it is done (so SIGTERM ends the process with
-15 rather than 0). Here the first signal instead:

1. closes admission: new requests get 503 `shutting_down`, /health answers 503 `shutting_down`;
2. lets in-flight requests finish for up to the grace period (`NEURON_SHUTDOWN_GRACE_S`);
3. cancels what is still running with a clean error (a 503, or a final SSE error event);
4. stops Uvicorn, whose lifespan shutdown stops the engine: workers get `shutdown` and are reaped.

A second signal skips what is left of the grace period. The server also applies the connection
limits and read deadlines of `connections.py`, so every server neuron runs has them.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from neuron.engine.async_engine import AsyncEngine
from neuron.engine.host import ModelHost
from neuron.entrypoints.openai.connections import ConnectionLimits, guarded_protocol

log = logging.getLogger("neuron.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine | ModelHost, grace_s: float,
                 limits: ConnectionLimits | None = None):
        """`engine`: what the signal drains, one engine or a host of them; `limits`: the connection cap
        and read deadlines, their settings when left out."""
        limits = limits or ConnectionLimits.from_settings()
        config.http = guarded_protocol(limits)
        config.timeout_keep_alive = limits.idle_timeout_s
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hurry: asyncio.Event | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self._hurry = asyncio.Event()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Uvicorn's signal handler (main thread). Not recording the signal keeps Uvicorn from
        raising it again after the shutdown, so the process exits with 0."""
        log.info("%s received: %s", signal.Signals(sig).name,
                 "stopping now" if self._drain is not None else f"draining for up to {self.grace_s:g} s")
        self.begin_shutdown()

    def begin_shutdown(self) -> None:
        """Start the drain, or cut its grace period short if it has started; callable from any thread."""
        if self._loop is None:  # not serving yet
            self.should_exit = True
            return
        try:
            self._loop.call_soon_threadsafe(self._on_shutdown_request)
        except RuntimeError:  # the loop is already closed
            pass

    def _on_shutdown_request(self) -> None:
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit())
        else:
            self._hurry.set()

    async def _drain_then_exit(self) -> None:
        try:
            await self.engine.drain(self.grace_s, self._hurry)
        finally:
            self.should_exit = True  # Uvicorn then waits for the handlers to send what is left
