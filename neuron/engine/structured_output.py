"""Structured output: a grammar (JSON schema, regex, choice, Lark) that a sequence's tokens must follow.

llguidance does the grammar work: it compiles a grammar against the tokenizer's vocabulary and, at
each step, gives the bitmask of the tokens that keep the output inside the grammar. A request names
its grammar with `GuidedDecodingParams` (vLLM's names); `StructuredOutput.compile` turns it into a
`CompiledGrammar`, cached by its spec, and each sequence gets its own `GrammarMatcher` from it.

Compiling is the work a client controls, so it is bounded before it starts (the spec's size and
JSON nesting), while it runs (llguidance's fuel limits, the first mask included) and where it runs:
llguidance's compiler recurses as deep as a grammar's rules chain, so it runs on a thread of its
own whose stack holds the deepest chain a spec of `MAX_SPEC_CHARS` can write (a 63 KB chain of
7,000 Lark rules needs 32 MiB of it, 1,400 chained `$defs` 16 MiB), one compile at a time.
Compiled grammars are cached by spec, bounded in bytes (each one's C-heap growth is measured as it
is built); a failed compile is never kept, and the heap it used is handed back. The server compiles
off the event loop and hands the engine the compiled grammar, so the engine loop never compiles.
The engine computes the masks of all constrained sequences of a step in one call (llguidance's
thread pool, GIL released) and the sampler applies them to their logits rows together
(`TokenBitmask.apply`).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import llguidance.numpy as llg_np
import numpy as np

from neuron.engine.sampling import TokenBitmask
from neuron.engine.sampling_params import GrammarError, GuidedDecodingParams
from neuron.engine.tokenizer import Tokenizer
from neuron.utils.native_memory import heap_in_use, release_free_heap, run_with_stack

# The compiling thread's stack: eight times what the deepest spec within MAX_SPEC_CHARS was measured to
# need (a chain of 7,000 Lark rules, 63 KB, crashed with 16 MiB and compiled with 32 MiB).
COMPILE_STACK_BYTES = 256 * 2**20
# Bytes of compiled grammars kept (their lexers' states, which the sequences using one share); a
# grammar larger than half of it is used by its request and not kept.
CACHE_BYTES = 64 * 2**20
# llguidance's own bounds (its fuel a fifth of its defaults, its lexer states a fifth): building the
# lexer, and each step's mask. Memory follows the fuel (a pathological regex grew 88 MB at 500k fuel,
# 38 MB at 200k) and so does what the C heap keeps after it; every grammar the tests and benchmarks
# use needs far less. One that needs more fails to compile (a 400) or, mid-generation, fails its
# sequence alone.
_LIMITS = {"initial_lexer_fuel": 200_000, "step_lexer_fuel": 50_000, "max_lexer_states": 50_000,
           "max_grammar_size": 200_000}
# JSON without optional whitespace: an answer is one compact line, and a model cannot pad forever.
_JSON_OPTIONS = {"whitespace_flexible": False}


def _grammar(kind: str, text: str, param: str) -> str:
    """llguidance's grammar for a spec (which its matcher then checks and compiles)."""
    if kind == "json":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GrammarError(param, f"{param} is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise GrammarError(param, f"{param} must be a JSON schema (an object)")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(param, f"{param} cannot be compiled: {exc}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    try:
        return llguidance.grammar_from("grammar", text)
    except ValueError as exc:
        raise GrammarError(param, f"{param} is not a Lark or GBNF grammar: {exc}") from None


class GrammarMatcher:
    """One sequence's place in its grammar, advanced by each token it samples."""

    __slots__ = ("ll", "__weakref__")

    def __init__(self, ll: llguidance.LLMatcher):
        self.ll = ll

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False when the grammar refuses it (see `error`)."""
        return self.ll.consume_token(token_id)

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the grammar would take from here (its state unchanged)."""
        try:
            return self.ll.validate_tokens(token_ids)
        except (ValueError, TypeError, OverflowError):  # a token id past the tokenizer's vocabulary
            return 0

    @property
    def terminated(self) -> bool:
        """The output is complete: the grammar allows nothing more (or has failed)."""
        return self.ll.is_stopped()

    @property
    def error(self) -> str:
        return _first_line(self.ll.get_error())


@dataclass(slots=True, frozen=True, eq=False, weakref_slot=True)
class CompiledGrammar:
    """A grammar ready to use: each sequence copies the compiled matcher, sharing its lexer."""

    spec: tuple[str, str]
    _template: llguidance.LLMatcher
    nbytes: int = 0  # memory it holds, as measured when it was built

    @property
    def too_large_to_keep(self) -> bool:
        """Over half the cache's bytes: used by its request, never cached, its heap handed back."""
        return self.nbytes > CACHE_BYTES // 2

    def matcher(self) -> GrammarMatcher:
        matcher = GrammarMatcher(self._template.deep_copy())
        if self.too_large_to_keep:  # its lexer grows as it runs: give the heap back when it ends
            weakref.finalize(matcher, release_free_heap)
        return matcher


def _first_line(message: str) -> str:
    """llguidance's message without the parser state it appends (which would echo the grammar)."""
    return re.split(r"\n<(?:state|non-verbose)", message, maxsplit=1)[0].strip()


class StructuredOutput:
    """An engine's grammars: compiled against its tokenizer, cached, and turned into token masks.

    `compile` may run in any thread (it takes a lock only around the cache); `allowed_tokens` is
    the engine thread's."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self._source = tokenizer
        self._eos = list(eos_token_ids)
        # Masks span the model's vocabulary (ids the tokenizer lacks are never allowed) and the
        # tokenizer's, should it hold ids the model cannot produce.
        self._n_vocab = max(vocab_size, tokenizer.vocab_size)
        self._words = (self._n_vocab + 31) // 32  # int32 words of one row's bitmask
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiling = threading.Lock()  # one compile at a time: its heap growth is then its own
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._executor: llguidance.LLExecutor | None = None

    def _tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (tens of ms): engines that never see a grammar never pay for it."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(self._source.to_json(), n_vocab=self._n_vocab,
                                                            eos_token=self._eos or None)
            return self._ll_tokenizer

    def compile(self, guided: GuidedDecodingParams) -> CompiledGrammar:
        """The compiled grammar, from the cache or compiled now (bounded; raises GrammarError)."""
        if not isinstance(guided, GuidedDecodingParams):
            raise GrammarError("guided_decoding", "guided_decoding must be a GuidedDecodingParams, "
                               f"got {type(guided).__name__}")
        spec = guided.spec()
        if (hit := self._cached(spec)) is not None:
            return hit
        with self._compiling:
            if (hit := self._cached(spec)) is not None:  # compiled while this one waited
                return hit
            compiled = run_with_stack(COMPILE_STACK_BYTES, self._measured_build, spec, f"guided_decoding.{guided.kind}")
        self._keep(compiled)
        return compiled

    def _cached(self, spec: tuple[str, str]) -> CompiledGrammar | None:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
            return hit

    def _keep(self, compiled: CompiledGrammar) -> None:
        """Cache `compiled` unless it is too large to; evict the least recently used past CACHE_BYTES."""
        if compiled.too_large_to_keep:
            return
        with self._lock:
            self._cache[compiled.spec] = compiled
            self._cache_bytes += compiled.nbytes
            evicted = 0
            while self._cache_bytes > CACHE_BYTES:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.nbytes
                evicted += 1
        if evicted:
            release_free_heap()  # once the requests using them end, their lexers' memory can go back

    def _measured_build(self, spec: tuple[str, str], param: str) -> CompiledGrammar:
        """`_build`, with the C-heap growth it caused as the grammar's size (at least its spec's)."""
        tokenizer = self._tokenizer()  # shared by every grammar: not counted in any one's size
        before = heap_in_use()
        try:
            matcher = self._build(tokenizer, spec, param)
        except BaseException:
            release_free_heap()
            raise
        grew = 0 if before is None else max(heap_in_use() - before, 0)
        compiled = CompiledGrammar(spec, matcher, max(grew, 2 * len(spec[1])))
        if compiled.too_large_to_keep:  # once its requests are done, give its heap back
            weakref.finalize(compiled, release_free_heap)
        return compiled

    def _build(self, tokenizer: llguidance.LLTokenizer, spec: tuple[str, str], param: str) -> llguidance.LLMatcher:
        """The matcher at the grammar's start, its first mask computed once: that builds the lexer's
        start states, which every copy shares, and a grammar that cannot even start fails here."""
        limits = llguidance.LLParserLimits(**_LIMITS, verbose_errors=False)
        try:
            matcher = llguidance.LLMatcher(tokenizer, _grammar(*spec, param), limits=limits, log_level=0)
        except RecursionError:  # Python's own parsing of the spec, should a check above have missed a depth
            raise GrammarError(param, f"{param} nests too deeply") from None
        if not matcher.is_error():
            llg_np.fill_next_token_bitmask(matcher, np.empty((1, self._words), dtype=np.int32))
        if matcher.is_error():
            raise GrammarError(param, f"{param} cannot be compiled: {_first_line(matcher.get_error())}")
        return matcher

    def allowed_tokens(self, grammars: Sequence[GrammarMatcher | None]) -> TokenBitmask | None:
        """The next-token masks of the rows that have a grammar, computed together; None if none has."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        bits = np.empty((len(rows), self._words), dtype=np.int32)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llg_np.fill_next_token_bitmask_par(self._executor, [(grammars[i].ll, j) for j, i in enumerate(rows)], bits)
        return TokenBitmask(rows, bits)


