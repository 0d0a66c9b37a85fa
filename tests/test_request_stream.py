"""A request's update queue as the HTTP handlers read it: one update at a time (`next`, the JSON
responses) or in batches of everything queued across a request's samples (`merged_updates`, the
SSE responses), with keep-alives when nothing comes, and no update lost or reordered."""

from __future__ import annotations

import asyncio

import pytest

from neuron.engine.output_processor import Update
from neuron.engine.request_stream import RequestStream, wait_any
from neuron.entrypoints.openai.streaming import merged_updates


class _Metric:
    def inc(self, n=1):
        pass

    def observe(self, v):
        pass


class _Owner:
    """What a RequestStream asks of its engine: metrics, and being told when it closes."""

    class metrics:
        generation_tokens = ttft = itl = _Metric()

    def __init__(self):
        self.closed = []

    def close(self, stream):
        self.closed.append(stream.request_id)


def _update(rid: str, token: int, finished: bool = False) -> Update:
    return Update(rid, [token], f"<{token}>", None, finished, "length" if finished else None)


def _stream(rid: str) -> RequestStream:
    owner = _Owner()
    return RequestStream(owner.metrics, rid, 3, owner.close)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_next_reads_in_order_and_waits_for_the_engine():
    async def scenario():
        s = _stream("a")
        loop = asyncio.get_running_loop()
        s.put(_update("a", 1))
        loop.call_later(0.05, s.put, _update("a", 2))
        loop.call_later(0.1, s.put, _update("a", 3, finished=True))
        return [u.token_ids[0] async for u in s], s.read_final

    assert _run(scenario()) == ([1, 2, 3], True)


def test_a_reader_behind_gets_everything_queued_in_one_batch():
    async def scenario():
        s = _stream("a")
        for t in range(4):
            s.put(_update("a", t, finished=t == 3))
        return [batch async for batch in merged_updates([s], every_s=5)]

    batches = _run(scenario())
    assert len(batches) == 1
    assert [(k, u.token_ids[0]) for k, u in batches[0]] == [(0, 0), (0, 1), (0, 2), (0, 3)]


def test_samples_interleave_in_stream_order_and_leave_when_finished():
    async def scenario():
        a, b = _stream("a"), _stream("b")
        loop = asyncio.get_running_loop()
        b.put(_update("b", 10))
        a.put(_update("a", 1, finished=True))
        loop.call_later(0.05, b.put, _update("b", 11, finished=True))
        return [batch async for batch in merged_updates([a, b], every_s=5)]

    batches = _run(scenario())
    assert [[(k, u.token_ids[0]) for k, u in batch] for batch in batches] == [[(0, 1), (1, 10)], [(1, 11)]]


def test_keepalive_when_nothing_comes():
    async def scenario():
        s = _stream("a")
        asyncio.get_running_loop().call_later(0.25, s.put, _update("a", 7, finished=True))
        return [batch async for batch in merged_updates([s], every_s=0.1)]

    batches = _run(scenario())
    assert batches[:2] == [None, None]  # at 0.1 s and 0.2 s
    assert [u.token_ids for _, u in batches[-1]] == [[7]]


@pytest.mark.parametrize("timeout", [None, 0.05])
def test_a_cancelled_wait_leaves_no_waiter_behind(timeout):
    """A handler cancelled while waiting (its client left) must not leave a future that a later
    update would resolve, or a timer that fires into it."""

    async def scenario():
        s = _stream("a")
        task = asyncio.ensure_future(wait_any([s], timeout))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert s._waiter is None
        s.put(_update("a", 1))
        await asyncio.sleep(0.06)
        return await wait_any([s], 0.01)

    assert _run(scenario()) is True
