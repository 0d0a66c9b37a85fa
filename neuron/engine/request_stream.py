"""One request's updates as its HTTP handler reads them: a queue the engine bridge fills from the
event-loop thread, with the request's timings and how an early end is reported.

Reading costs little per token, since every stream is read once per engine step: the queue is a
deque, and a reader that finds it empty parks one future, which the next update resolves (`wait_any`
parks one future for several streams, with a timer for keep-alives). Everything queued is taken at
once (`take`), so a reader that fell behind catches up in one pass."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence

from neuron.engine.metrics import ModelMetrics
from neuron.engine.output_processor import Update


class RequestStream:
    """One request's updates, in order, ending with the update that has `finished` set."""

    def __init__(self, metrics: ModelMetrics, request_id: str, num_prompt_tokens: int,
                 on_close: Callable[[RequestStream], None]):
        """`on_close(stream)`, called once, releases the request (aborts it if the engine still runs it)."""
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self._metrics = metrics
        self._on_close = on_close
        self._updates: deque[Update] = deque()
        self._waiter: asyncio.Future | None = None  # a reader's, while the queue is empty
        self._read_final = False
        self.closed = False
        # How an early end (finish reason "error") is reported: a failing rank (`generation_failed`,
        # retrying helps), the server stopping (`shutting_down`), or a bug (`internal_error`).
        self.failure_kind = "generation_failed"
        self.lora: str | None = None  # the LoRA adapter it runs, by name (None: the base model)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def put(self, update: Update) -> None:
        """Event-loop thread: record timings and queue the update for the handler."""
        if update.token_ids:
            now = time.monotonic()
            self._metrics.generation_tokens.inc(len(update.token_ids))
            if self.first_token_at is None:
                self.first_token_at = now
                self._metrics.ttft.observe(now - self.arrival)
            else:
                self._metrics.itl.observe(now - self.last_token_at)
            self.last_token_at = now
            self.num_output_tokens += len(update.token_ids)
        if update.finished:
            self.finish_reason = update.finish_reason or "stop"
        self._updates.append(update)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    def take(self) -> list[Update]:
        """Every update queued now, oldest first; none when the queue is empty."""
        updates = list(self._updates)
        self._updates.clear()
        if updates and updates[-1].finished:
            self._read_final = True
        return updates

    @property
    def read_final(self) -> bool:
        """Whether the update that finishes the request has been read."""
        return self._read_final

    async def next(self) -> Update:
        while not self._updates:
            await wait_any([self])
        update = self._updates.popleft()
        self._read_final = update.finished
        return update

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Update:
        if self._read_final:
            raise StopAsyncIteration
        return await self.next()

    def close(self) -> None:
        """Release the request; if the engine still runs it, abort it. Safe to call twice."""
        if not self.closed:
            self.closed = True
            self._on_close(self)


async def wait_any(streams: Sequence[RequestStream], timeout: float | None = None) -> bool:
    """Until one of `streams` has an update queued (True) or `timeout` seconds pass (False)."""
    if any(s._updates for s in streams):
        return True
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    for s in streams:
        s._waiter = waiter
    timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
    try:
        return await waiter
    finally:
        if timer is not None:
            timer.cancel()
        for s in streams:
            s._waiter = None


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(False)
