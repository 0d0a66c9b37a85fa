"""What comes back, as Ollama writes it: the engine stream parsed by the chat path's parser (or taken
as text, for a raw generate), one JSON object a line while it streams (NDJSON), or one object."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime, timezone

import msgspec

from neuron.engine.async_engine import RequestStream
from neuron.engine.output_processor import Update
from neuron.entrypoints.openai.api_types import TokenLogprob
from neuron.entrypoints.openai.common import Samples, stream_error
from neuron.entrypoints.openai.logprobs import LogprobRenderer
from neuron.entrypoints.openai.response_parser import Parsed
from neuron.entrypoints.openai.streaming import merged_updates


class PlainText:
    """A raw generate's parser: its text is all response."""

    def feed(self, text: str) -> Parsed:
        return Parsed(content=text)

    def finish(self) -> Parsed:
        return Parsed()


class RawLogprobs:
    """A raw generate's logprobs, rendered as the chat path renders them (Ollama's shape is the same)."""

    def __init__(self, tokenizer, top: int | None):
        self.top = top
        self.render = LogprobRenderer(tokenizer, False)

    def logprobs(self, update: Update):
        if self.top is None or update.logprobs is None:
            return None
        entries = self.render.chat(update.token_ids, update.logprobs, self.top)
        return _Logprobs(msgspec.convert(entries, list[TokenLogprob], from_attributes=True))


@dataclass(slots=True)
class _Logprobs:
    content: list[TokenLogprob]


class Reply:
    """One answer as Ollama writes it: `message` (chat) or `response` (generate) deltas with their
    thinking, tool calls and logprobs, the last object closing it with the counts and durations."""

    def __init__(self, model: str, field: str, parser, state, started: float, load_s: float):
        """`parser` splits the text (feed, finish); `state` renders logprobs, and tool calls on a chat."""
        self.model, self.field, self.parser, self.state = model, field, parser, state
        self.started, self.load_s = started, load_s

    def parse(self, update: Update) -> tuple[Parsed, list[TokenLogprob]]:
        """What one update adds: its text split, and its tokens' logprobs when asked for."""
        parsed = self.parser.feed(update.text)
        if update.finished:
            parsed.extend(self.parser.finish())
        lp = self.state.logprobs(update)
        return parsed, lp.content if lp is not None else []

    def part(self, parsed: Parsed, logprobs: list[TokenLogprob]) -> dict:
        """An object of the answer, not its last."""
        body = {"model": self.model, "created_at": timestamp(), **self._text(parsed), "done": False}
        if logprobs:
            body["logprobs"] = logprobs
        return body

    def last(self, parsed: Parsed, logprobs: list[TokenLogprob], stream: RequestStream, final: Update) -> dict:
        """The closing object: what it still says, why it ended, and Ollama's counts and durations
        (nanoseconds; the prompt's from the request's arrival at the engine to its first token)."""
        now = time.monotonic()
        first = stream.first_token_at or now
        body = self.part(parsed, logprobs)
        body.update(done=True, done_reason="length" if final.finish_reason == "length" else "stop",
                    total_duration=ns(now - self.started), load_duration=ns(self.load_s),
                    prompt_eval_count=stream.num_prompt_tokens, prompt_eval_duration=ns(first - stream.arrival),
                    eval_count=stream.num_output_tokens, eval_duration=ns((stream.last_token_at or first) - first))
        return body

    def _text(self, parsed: Parsed) -> dict:
        if self.field == "response":
            return {"response": parsed.content, **({"thinking": parsed.reasoning} if parsed.reasoning else {})}
        message = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning:
            message["thinking"] = parsed.reasoning
        if parsed.tool_calls:
            first = self.state.num_tool_calls
            calls = self.state.tool_calls(parsed)
            message["tool_calls"] = [{"function": {"index": first + i, "name": c.function.name,
                                                   "arguments": json.loads(c.function.arguments)}}
                                     for i, c in enumerate(calls)]
        return {"message": message}


_QUIET_S = 60.0  # how often a stream with nothing to say wakes its writer, which then writes nothing


def _line(obj) -> bytes:
    return msgspec.json.encode(obj) + b"\n"


async def ndjson_lines(reply: Reply, samples: Samples) -> AsyncIterator[bytes]:
    """The NDJSON body: an object per update that adds something, the closing object, or an
    `{"error": ...}` line (and the end) when the request fails. NDJSON has no comments, so a quiet
    stream sends nothing until it has something to say (NDJSONResponse watches the client)."""
    [stream] = samples.streams
    try:
        async for batch in merged_updates(samples.streams, _QUIET_S):
            out = []
            for _, update in batch or ():
                if update.finish_reason == "error":
                    yield b"".join(out) + _line({"error": stream_error(stream, update.error).message})
                    return
                parsed, logprobs = reply.parse(update)
                if update.finished:
                    out.append(_line(reply.last(parsed, logprobs, stream, update)))
                elif parsed or logprobs:
                    out.append(_line(reply.part(parsed, logprobs)))
            if out:
                yield b"".join(out)
    finally:
        samples.close()


async def collect(reply: Reply, samples: Samples) -> bytes:
    """The one object of `"stream": false`: the whole answer and its counts."""
    [stream] = samples.streams
    whole, logprobs = Parsed(), []
    async for update in stream:
        if update.finish_reason == "error":
            raise stream_error(stream, update.error)
        parsed, lp = reply.parse(update)
        whole.extend(parsed)
        logprobs += lp
        final = update
    return msgspec.json.encode(reply.last(whole, logprobs, stream, final))


def timestamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))
