"""Server-sent events and client disconnects.

Every request watches its connection: when the client goes away, the handler is cancelled and
its `RequestStream` is closed, which aborts the request in the engine at the next step boundary.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from neuron.engine.async_engine import RequestStream
from neuron.engine.llm_engine import Update
from neuron.engine.request_stream import wait_any

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(StreamingResponse):
    """An SSE response that stops as soon as the client disconnects, and then runs `on_close`.

    Starlette notices a disconnect only when a write fails; a request still waiting for its first
    token writes nothing, so this response listens for the disconnect itself."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await _wait_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self._on_close()
            await self.body_iterator.aclose()


class NDJSONResponse(EventStreamResponse):
    """One JSON object a line (Ollama's streams), with the same watch on the client."""

    media_type = "application/x-ndjson"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run `work` unless the client disconnects first: (True, result), or (False, None)."""
    result: list = []
    error: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            await _wait_disconnect(request.receive)
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result.append(await work)
        except Exception as exc:  # raised below, not wrapped in the task group's ExceptionGroup
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return (True, result[0]) if result else (False, None)


async def merged_updates(streams: list[RequestStream],
                         every_s: float) -> AsyncIterator[list[tuple[int, Update]] | None]:
    """The updates of several streams as they come, in batches of all that are queued at a wake-up
    (each with its stream's position; in stream order, each stream's in its own order), until every
    stream has finished; a None whenever `every_s` seconds pass without any. A batch is what the
    handler writes at once: a reader that fell behind sends the tokens it missed in one write."""
    live = list(range(len(streams)))
    while live:
        batch = [(k, update) for k in live for update in streams[k].take()]
        if batch:
            live = [k for k in live if not streams[k].read_final]
            yield batch
        elif not await wait_any([streams[k] for k in live], every_s):
            yield None


async def json_unless_disconnected(request, streams, collect) -> Response:
    """Await the JSON body `collect` builds; a client that leaves first aborts the request (its
    streams are closed: `streams.close()`) and gets nothing more."""
    try:
        connected, body = await unless_disconnected(request, collect)
    finally:
        streams.close()
    return Response(body, media_type="application/json") if connected else Response(status_code=499)
