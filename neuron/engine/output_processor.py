"""What a request's sampled tokens become: text, a finish decision, logprobs, and what the text means.

The engine hands `OutputProcessor` every sampled token. It decodes the token incrementally, decides
whether the request ends there (an EOS or stop token, a stop string, the length limit) and reports
the text that is safe to show, holding back what might still turn into a stop string. The server
renders logprobs with `LogprobRenderer` and splits the text into reasoning, content and tool calls
with `OutputParser` (in response_parser). Nothing here speaks HTTP: the server wraps these shapes in
its API types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from neuron.engine.response_parser import OutputParser, Parsed
from neuron.engine.sequence import Sequence
from neuron.engine.tokenizer import IncrementalDetokenizer, Tokenizer

# JSON has no -inf; a token the model rules out reports this instead (as vLLM does).
_LOGPROB_FLOOR = -9999.0


@dataclass(slots=True)
class Update:
    """What one step did for one request."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Whose fault an error is: "invalid_request" (the request's own constraints left no token to
    # sample), "internal_error" (a bug or unusable model output); None: a failing rank.
    failure_kind: str | None = None
    # The prompt's logprobs (first entry None), on the request's first update, when asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(slots=True, eq=False)
class _Tracked:
    seq: Sequence
    detok: IncrementalDetokenizer | None
    stop: list[str] = field(default_factory=list)
    text: str = ""  # decoded output, stop strings not yet cut
    emitted: int = 0  # characters of `text` already reported
    prompt_sent: bool = False  # its prompt logprobs went out with an earlier update


class OutputProcessor:
    """Every admitted request's text and finish decisions; used by the engine's thread only."""

    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self._tracked: dict[str, _Tracked] = {}

    def add(self, seq: Sequence) -> None:
        p = seq.params
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, p.skip_special_tokens)
        self._tracked[seq.request_id] = _Tracked(seq, detok, list(p.stop or []))

    def sequence(self, request_id: str) -> Sequence | None:
        """The request's sequence from admission until its final update, else None."""
        tr = self._tracked.get(request_id)
        return None if tr is None else tr.seq

    def process(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> Update:
        """The update for `token`, just appended to `seq`'s output. A finished update carries the
        finish and stop reasons the scheduler retires the sequence with."""
        tr = self._tracked[seq.request_id]
        reason, stop_reason = self._stop_check(seq, token)
        if tr.detok is not None:
            if not (reason == "stop" and stop_reason is None and token in self.eos_token_ids):
                tr.text += tr.detok.push(token)  # the EOS token that stops a sequence is not output
            if reason is None and tr.stop:
                reason, stop_reason = self._stop_strings(tr)
            if reason is not None and not isinstance(stop_reason, str):
                tr.text += tr.detok.flush()
        lps = None if logprobs is None else [logprobs]
        if reason is None:
            return self._partial(tr, [token], lps)
        return self._final(tr, reason, stop_reason, [token], lps)

    def end(self, seq: Sequence, error: str | None = None, failure_kind: str | None = None) -> Update:
        """The final update of a request the scheduler retired from outside (aborted, failed)."""
        tr = self._tracked.get(seq.request_id)
        if tr is None:  # it failed after `process` had made its final update, which is lost
            return Update(seq.request_id, [], "", None, True, "error", None, error, len(seq.prompt_token_ids),
                          len(seq.output_token_ids), failure_kind)
        update = self._final(tr, seq.finish_reason, seq.stop_reason, error=error)
        update.failure_kind = failure_kind
        return update

    def _stop_check(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        p = seq.params
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if p.stop_token_ids and token in p.stop_token_ids:
                return "stop", token
        if seq.grammar is not None and seq.grammar.terminated:  # structured output: nothing may follow
            return "stop", None
        if n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None

    @staticmethod
    def _stop_strings(tr: _Tracked) -> tuple[str | None, str | None]:
        if len(tr.seq.output_token_ids) < tr.seq.params.min_tokens:
            return None, None
        start = max(0, tr.emitted - max(len(s) for s in tr.stop))
        for stop in tr.stop:
            at = tr.text.find(stop, start)
            if at != -1:
                tr.text = tr.text[:at]
                return "stop", stop
        return None, None

    @staticmethod
    def _held_back(tr: _Tracked) -> int:
        """Characters kept back while they might still begin a stop string."""
        return max((len(s) for s in tr.stop), default=1) - 1

    def _partial(self, tr: _Tracked, tokens, logprobs) -> Update:
        safe = max(tr.emitted, len(tr.text) - self._held_back(tr))
        delta = tr.text[tr.emitted : safe]
        tr.emitted = safe
        seq = tr.seq
        return Update(seq.request_id, tokens, delta, logprobs, False,
                      num_prompt_tokens=len(seq.prompt_token_ids), num_output_tokens=len(seq.output_token_ids),
                      prompt_logprobs=self._prompt_logprobs(tr))

    def _final(self, tr: _Tracked, reason: str | None, stop_reason: int | str | None, tokens=None, logprobs=None,
               error: str | None = None) -> Update:
        seq = tr.seq
        delta = tr.text[tr.emitted :]
        tr.emitted = len(tr.text)
        self._tracked.pop(seq.request_id, None)
        return Update(seq.request_id, tokens or [], delta, logprobs, True, reason, stop_reason,
                      error, len(seq.prompt_token_ids), len(seq.output_token_ids),
                      prompt_logprobs=self._prompt_logprobs(tr))

    @staticmethod
    def _prompt_logprobs(tr: _Tracked) -> list[dict[int, float] | None] | None:
        """The prompt's logprobs, once: on the first update after its prefill."""
        if tr.prompt_sent or tr.seq.prompt_logprobs is None:
            return None
        tr.prompt_sent = True
        return tr.seq.prompt_logprobs


# ---- logprobs, in the shapes the OpenAI API writes them ----


def clamp_logprob(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


@dataclass(slots=True)
class TopToken:
    """One of the most likely tokens at a position."""

    token: str
    logprob: float
    bytes: list[int]


@dataclass(slots=True)
class SampledToken:
    """A sampled token with its most likely alternatives (the chat API's shape)."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopToken]


@dataclass(slots=True)
class TextLogprobs:
    """One entry per sampled token in each list, offsets counting characters of the completion
    text (the completions API's shape)."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)


class LogprobRenderer:
    """Writes one request's logprobs, a token as its text or as `token_id:N` when asked (or when
    there is no tokenizer). Text offsets run on across updates, so each request has its own."""

    def __init__(self, tokenizer: Tokenizer | None, as_ids: bool):
        self._decode = _decoder(tokenizer) if tokenizer is not None else None
        self._as_ids = as_ids or tokenizer is None
        self._tokenizer = tokenizer
        self._offset = 0  # characters of completion text before the next token

    def token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._as_ids else self._decode(token_id)

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (part of a UTF-8 character for some tokens, where its text is
        U+FFFD); the bytes of `token_id:N` where tokens are rendered so."""
        if self._as_ids:
            return list(self.token(token_id).encode())
        return list(self._tokenizer.token_bytes(token_id))

    def chat(self, token_ids: list[int], logprobs: list[dict[int, float]], n: int) -> list[SampledToken]:
        """Each sampled token with its `n` most likely alternatives."""
        out = []
        for token, entry in zip(token_ids, logprobs):
            text = self.token(token)
            out.append(SampledToken(text, clamp_logprob(entry[token]), self.token_bytes(token), self._top(entry, n)))
        return out

    def completion(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> TextLogprobs:
        """Each sampled token with every alternative the sampler reported."""
        out = TextLogprobs()
        for token, entry in zip(token_ids, logprobs):
            out.tokens.append(self.token(token))
            out.token_logprobs.append(clamp_logprob(entry[token]))
            ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)
            out.top_logprobs.append({self.token(t): clamp_logprob(v) for t, v in ranked})
            out.text_offset.append(self._offset)
            self._offset += len(self._text(token))
        return out

    def _text(self, token_id: int) -> str:
        """The token's text where there is a tokenizer (for text offsets), else its rendering."""
        return self._decode(token_id) if self._decode else self.token(token_id)

    def _top(self, entry: dict[int, float], n: int) -> list[TopToken]:
        ranked = sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:n]
        return [TopToken(self.token(t), clamp_logprob(v), self.token_bytes(t)) for t, v in ranked]


@lru_cache(maxsize=8)
def _decoder(tokenizer: Tokenizer):
    @lru_cache(maxsize=1 << 16)
    def decode(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return decode


__all__ = ["LogprobRenderer", "OutputParser", "OutputProcessor", "Parsed", "SampledToken", "TextLogprobs", "TopToken",
           "Update"]
