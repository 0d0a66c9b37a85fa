"""Logprobs in the shapes the OpenAI API writes them: the chat API's per-token entries with their
most likely alternatives, the completions API's parallel lists with text offsets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from neuron.engine.tokenizer import Tokenizer

# JSON has no -inf; a token the model rules out reports this instead (as vLLM does).
_LOGPROB_FLOOR = -9999.0


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
