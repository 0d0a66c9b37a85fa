"""One request's updates as its HTTP handler reads them: an asyncio queue the engine bridge fills
from the event-loop thread, with the request's timings and how an early end is reported."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from neuron.engine.output_processor import Update

if TYPE_CHECKING:
    from neuron.engine.async_engine import AsyncEngine


class RequestStream:
    """One request's updates, in order, ending with the update that has `finished` set."""

    def __init__(self, owner: "AsyncEngine", request_id: str, num_prompt_tokens: int):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self._owner = owner
        self._queue: asyncio.Queue[Update] = asyncio.Queue()
        self._read_final = False
        self.closed = False
        # How an early end (finish reason "error") is reported: a failing rank (`generation_failed`,
        # retrying helps), the server stopping (`shutting_down`), or a bug (`internal_error`).
        self.failure_kind = "generation_failed"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _put(self, update: Update) -> None:
        """Event-loop thread: record timings and queue the update for the handler."""
        if update.token_ids:
            now = time.monotonic()
            self._owner.metrics.generation_tokens.inc(len(update.token_ids))
            if self.first_token_at is None:
                self.first_token_at = now
                self._owner.metrics.ttft.observe(now - self.arrival)
            else:
                self._owner.metrics.itl.observe(now - self.last_token_at)
            self.last_token_at = now
            self.num_output_tokens += len(update.token_ids)
        if update.finished:
            self.finish_reason = update.finish_reason or "stop"
        self._queue.put_nowait(update)

    async def next(self) -> Update:
        return await self._queue.get()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Update:
        if self._read_final:
            raise StopAsyncIteration
        update = await self._queue.get()
        self._read_final = update.finished
        return update

    def close(self) -> None:
        """Release the request; if the engine still runs it, abort it. Safe to call twice."""
        if not self.closed:
            self.closed = True
            self._owner._close(self)
