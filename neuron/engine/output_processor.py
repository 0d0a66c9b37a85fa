"""What a request's sampled tokens become: text, a finish decision, logprobs, and what the text means.

The engine hands `OutputProcessor` every sampled token. It decodes the token incrementally, decides
whether the request ends there (an EOS or stop token, a stop string, the length limit) and reports
the text that is safe to show, holding back what might still turn into a stop string, with the
token ids and plain logprob values. What they mean to an API (logprobs in the OpenAI shapes,
reasoning and tool calls in the text) is the entrypoints' business (neuron/entrypoints/openai).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neuron.engine.sequence import Sequence
from neuron.engine.tokenizer import IncrementalDetokenizer, Tokenizer


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
    # The prompt's logprobs (first entry None), on the request's first update, when asked for, and
    # its tokens' ranks in the vocabulary (1: the most likely; first None).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None
    # An embedding request's pooled vector (engine/pooling.py), on its final update.
    embedding: list[float] | None = None
    # With logprobs: each token's rank in the vocabulary (1: the most likely; vLLM's Logprob.rank)
    token_ranks: list[int | None] | None = None


@dataclass(slots=True, eq=False)
class _Tracked:
    seq: Sequence
    detok: IncrementalDetokenizer | None
    stop: list[str] = field(default_factory=list)
    text: str = ""  # decoded output, stop strings not yet cut
    emitted: int = 0  # characters of `text` already reported
    searched: int = 0  # characters of `text` no stop string may end within: searched already, or min_tokens' own
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

    def process(self, seq: Sequence, token: int, logprobs: dict[int, float] | None,
                rank: int | None = None) -> Update:
        """The update for `token`, just appended to `seq`'s output. A finished update carries the
        finish and stop reasons the scheduler retires the sequence with."""
        tr = self._tracked[seq.request_id]
        reason, stop_reason = self._stop_check(seq, token)
        if tr.detok is not None:
            stopping_token = reason == "stop" and (stop_reason is not None or token in self.eos_token_ids)
            if not stopping_token or seq.params.include_stop_str_in_output:
                tr.text += tr.detok.push(token)  # an EOS or stop token that ends a sequence is not output
            if reason != "stop" and tr.stop:  # a stop string the last token allowed completes still counts
                found, stop = self._stop_strings(tr)
                if found is not None:
                    reason, stop_reason = found, stop
            if reason is not None and not isinstance(stop_reason, str):
                tr.text += tr.detok.flush()
        lps = None if logprobs is None else [logprobs]
        if reason is None:
            update = self._partial(tr, [token], lps)
        else:
            update = self._final(tr, reason, stop_reason, [token], lps)
        if logprobs is not None:
            update.token_ranks = [rank]
        return update

    def end(self, seq: Sequence, error: str | None = None, failure_kind: str | None = None) -> Update:
        """The final update of a request the scheduler retired from outside (aborted, failed, or
        done with its prompt: scored, or pooled into its embedding)."""
        tr = self._tracked.get(seq.request_id)
        if tr is None:  # it failed after `process` had made its final update, which is lost
            return Update(seq.request_id, [], "", None, True, "error", None, error, len(seq.prompt_token_ids),
                          len(seq.output_token_ids), failure_kind)
        update = self._final(tr, seq.finish_reason, seq.stop_reason, error=error)
        update.failure_kind = failure_kind
        if seq.pooling is not None and error is None and seq.finish_reason != "abort":
            update.embedding = seq.pooled.vector(seq.pooling)  # its prefill is done: the pooled vector
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
        """The first stop string that ends in the text decoded since the last search, as vLLM finds
        them: none ends within the text of the first min_tokens tokens (one may begin there). The
        text is cut before it, or after it with include_stop_str_in_output."""
        p = tr.seq.params
        if len(tr.seq.output_token_ids) <= p.min_tokens:
            tr.searched = len(tr.text)
            return None, None
        found = None
        for stop in tr.stop:
            at = tr.text.find(stop, max(0, tr.searched - len(stop) + 1))
            if at != -1 and (found is None or at + len(stop) < found[0] + len(found[1])):
                found = at, stop
        tr.searched = len(tr.text)
        if found is None:
            return None, None
        at, stop = found
        tr.text = tr.text[: at + len(stop) if p.include_stop_str_in_output else at]
        return "stop", stop

    @staticmethod
    def _held_back(tr: _Tracked) -> int:
        """Characters kept back while they might still begin a stop string (none where a stop string
        found stays in the text)."""
        if tr.seq.params.include_stop_str_in_output:
            return 0
        return max((len(s) for s in tr.stop), default=1) - 1

    def _partial(self, tr: _Tracked, tokens, logprobs) -> Update:
        safe = max(tr.emitted, len(tr.text) - self._held_back(tr))
        delta = tr.text[tr.emitted : safe]
        tr.emitted = safe
        seq = tr.seq
        prompt_logprobs, ranks = self._prompt_logprobs(tr)
        return Update(seq.request_id, tokens, delta, logprobs, False,
                      num_prompt_tokens=len(seq.prompt_token_ids), num_output_tokens=len(seq.output_token_ids),
                      prompt_logprobs=prompt_logprobs, prompt_token_ranks=ranks)

    def _final(self, tr: _Tracked, reason: str | None, stop_reason: int | str | None, tokens=None, logprobs=None,
               error: str | None = None) -> Update:
        seq = tr.seq
        delta = tr.text[tr.emitted :]
        tr.emitted = len(tr.text)
        self._tracked.pop(seq.request_id, None)
        prompt_logprobs, ranks = self._prompt_logprobs(tr)
        return Update(seq.request_id, tokens or [], delta, logprobs, True, reason, stop_reason,
                      error, len(seq.prompt_token_ids), len(seq.output_token_ids),
                      prompt_logprobs=prompt_logprobs, prompt_token_ranks=ranks)

    @staticmethod
    def _prompt_logprobs(tr: _Tracked) -> tuple[list | None, list | None]:
        """The prompt's logprobs and its tokens' ranks, once: on the first update after its prefill."""
        if tr.prompt_sent or tr.seq.prompt_logprobs is None:
            return None, None
        tr.prompt_sent = True
        return tr.seq.prompt_logprobs, tr.seq.prompt_token_ranks


__all__ = ["OutputProcessor", "Update"]
