"""What a request asks of its generation, and the checks on each value: vLLM's `SamplingParams`
and `GuidedDecodingParams`, named and defaulted as there.

Everything here is plain data checked at construction: a bad value raises `InvalidParams` (a
`GrammarError` for a grammar spec) naming the parameter, which the server turns into a 400. The
checks bound what a client controls before any work: stop lists, token ids, a grammar spec's size
and JSON nesting.
"""

from __future__ import annotations

import enum
import json
import operator
import re
from dataclasses import dataclass

MAX_LOGPROBS = 20
# Stop conditions a request may set. Each generated token is checked against all of them on the
# engine thread, which every other request waits for, so their number is bounded.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # per stop string
MAX_STOP_TOKEN_IDS = 4096
MAX_TOKEN_LIST = 1 << 19  # logit_bias and allowed_token_ids: as many as the largest vocabulary
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: 100 already decides a draw; the server clamps to it, as vLLM

# Dividing by a temperature this small overflows float32; the result would be argmax anyway.
_GREEDY_BELOW = 1e-5

# torch.Generator.manual_seed accepts exactly this range.
SEED_RANGE = (-(2**63), 2**64 - 1)
# A repetition penalty this far from 1 means nothing more than greedy does, while smaller ones
# overflow float32 logits into NaN probabilities: the server and generation_config.json keep to it.
REPETITION_PENALTY_RANGE = (0.01, 100.0)



# A spec longer than this is refused before compiling (characters of JSON text, regex or grammar).
MAX_SPEC_CHARS = 64 * 1024
# JSON nested deeper than this (arrays and objects, in a schema or a json spec's text) is refused
# before it is parsed: llguidance's own parser stops at 128 levels, Python's would recurse past its limit.
MAX_JSON_DEPTH = 128
_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class InvalidParams(ValueError):
    """A sampling parameter is out of range; `param` names it for the HTTP 400 body."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def _check(ok: bool, param: str, allowed: str, value: object) -> None:
    if not ok:
        raise InvalidParams(param, f"{param} must be {allowed}, got {value!r}")


class RequestOutputKind(enum.IntEnum):
    """vLLM's: what a streaming API (AsyncLLM.generate) yields as a request runs. The batch APIs
    return finished outputs whatever it says."""

    CUMULATIVE = 0  # everything so far, at every step
    DELTA = 1  # what the step added
    FINAL_ONLY = 2  # the finished output alone


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings, named and defaulted as in vLLM."""

    n: int = 1  # samples returned
    best_of: int | None = None  # samples generated, the n with the highest cumulative logprob returned; None: n
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # neuron's: the repetition penalty sees only the last this many tokens of the prompt and output
    # (llama.cpp's and Ollama's repeat_last_n); None: all of them, as vLLM's does
    repetition_window: int | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the prompt tokens' own logprobs and this many top-k at each
    skip_special_tokens: bool = True
    # vLLM's. Text is decoded by the checkpoint's tokenizer.json as transformers' fast tokenizers
    # decode it, where this changes nothing (as in vLLM's fast detokenizer): taken, and checked
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # a stop string, EOS or stop token that ends the text stays in it
    logit_bias: dict[int, float] | None = None  # added to these tokens' logits before the penalties
    allowed_token_ids: list[int] | None = None  # the only tokens that may be sampled
    bad_words: list[str] | None = None  # words never written (each tokenized with and without a leading space)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last this many tokens (-1: the context's worth)
    # Structured output: what the output must match; compiled when the request is added, unless the
    # caller compiled it already (off the event loop) and adds it with the request, beside these params
    guided_decoding: GuidedDecodingParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self._check_stop_sizes()  # before anything walks the lists
        if self.stop_token_ids is not None:
            self.stop_token_ids = token_ids(self.stop_token_ids, "stop_token_ids")
        self._check_token_lists()
        self._check_sampling()
        self._check_penalties()
        self._check_lengths()
        self._check_outputs()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW or self.top_k == 1

    @property
    def biased(self) -> bool:
        """Whether logit_bias, allowed_token_ids or bad_words change the logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def penalised(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def _check_sampling(self) -> None:
        # Each check is a comparison NaN fails, so NaN is rejected too.
        _check(self.n >= 1, "n", ">= 1", self.n)
        if self.best_of is not None:
            _check(self.best_of >= self.n, "best_of", f">= n ({self.n}) or null", self.best_of)
        _check(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        top_k_ok = self.top_k in (0, -1) or self.top_k >= 1
        _check(top_k_ok, "top_k", "0 or -1 (disabled) or >= 1", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        if self.seed is not None:
            lo, hi = SEED_RANGE
            _check(lo <= self.seed <= hi, "seed", f"in [{lo}, {hi}]", self.seed)

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, "in [-2, 2]", value)
        _check(self.repetition_penalty > 0, "repetition_penalty", "> 0", self.repetition_penalty)
        if self.repetition_window is not None:
            _check(isinstance(self.repetition_window, int) and self.repetition_window >= 1, "repetition_window",
                   ">= 1 or null (the whole context)", self.repetition_window)

    def _check_lengths(self) -> None:
        _check(self.min_tokens >= 0, "min_tokens", ">= 0", self.min_tokens)
        check_truncation(self.truncate_prompt_tokens)
        if self.max_tokens is None:
            return
        # 0: score the prompt only (prompt_logprobs, echo) and end after its prefill
        _check(self.max_tokens >= 0, "max_tokens", ">= 0 or null", self.max_tokens)
        cap = f"<= max_tokens ({self.max_tokens})"
        _check(self.min_tokens <= self.max_tokens, "min_tokens", cap, self.min_tokens)

    def _check_stop_sizes(self) -> None:
        if self.stop is not None:
            _check(isinstance(self.stop, (list, tuple)), "stop", "a string or a list of strings", _shown(self.stop))
            if len(self.stop) > MAX_STOP_STRINGS:
                raise InvalidParams("stop", f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if self.stop_token_ids is not None:
            count = len(self.stop_token_ids) if hasattr(self.stop_token_ids, "__len__") else None
            if count is None or count > MAX_STOP_TOKEN_IDS:
                got = f"{count} ids" if count is not None else _shown(self.stop_token_ids)
                raise InvalidParams("stop_token_ids", f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} "
                                                      f"token ids, got {got}")

    def _check_token_lists(self) -> None:
        """logit_bias as {token id: bias in LOGIT_BIAS_RANGE}, allowed_token_ids as a non-empty list
        of ids, both bounded (the vocabulary is checked when the request is added)."""
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict) or len(bias) > MAX_TOKEN_LIST:
                raise InvalidParams("logit_bias", f"logit_bias must map at most {MAX_TOKEN_LIST} token ids to "
                                                  f"biases, got {_shown(bias)}")
            ids = token_ids(list(bias), "logit_bias")
            values = list(bias.values())
            lo, hi = LOGIT_BIAS_RANGE
            if not all(isinstance(v, int | float) and not isinstance(v, bool) and lo <= v <= hi for v in values):
                raise InvalidParams("logit_bias", f"logit_bias's biases must be numbers in [{lo:g}, {hi:g}], got "
                                                  f"{_shown(bias)}")
            self.logit_bias = {t: float(v) for t, v in zip(ids, values)}
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if not hasattr(allowed, "__len__") or not 0 < len(allowed) <= MAX_TOKEN_LIST:
                raise InvalidParams("allowed_token_ids", f"allowed_token_ids must be a non-empty list of at most "
                                                         f"{MAX_TOKEN_LIST} token ids, got {_shown(allowed)}")
            self.allowed_token_ids = token_ids(allowed, "allowed_token_ids")

    def _check_outputs(self) -> None:
        kinds = ", ".join(k.name for k in RequestOutputKind)
        _check(self.output_kind in tuple(RequestOutputKind), "output_kind", f"a RequestOutputKind ({kinds})",
               self.output_kind)
        self.output_kind = RequestOutputKind(self.output_kind)
        _check(isinstance(self.spaces_between_special_tokens, bool), "spaces_between_special_tokens",
               "true or false", self.spaces_between_special_tokens)
        if self.bad_words is not None:
            words_ok = (isinstance(self.bad_words, (list, tuple)) and len(self.bad_words) <= MAX_STOP_STRINGS
                        and all(isinstance(w, str) and 0 < len(w.strip()) and len(w) <= MAX_STOP_CHARS
                                for w in self.bad_words))
            _check(words_ok, "bad_words", f"a list of at most {MAX_STOP_STRINGS} words (non-blank strings of at most "
                                          f"{MAX_STOP_CHARS} characters)", _shown(self.bad_words))
        if self.stop is not None:
            stop_ok = all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop)
            _check(stop_ok, "stop", f"a list of non-empty strings of at most {MAX_STOP_CHARS} characters",
                   _shown(self.stop))
        if self.stop_token_ids is not None:
            ids_ok = all(t >= 0 for t in self.stop_token_ids)
            _check(ids_ok, "stop_token_ids", "a list of ids >= 0", _shown(self.stop_token_ids))
        if self.logprobs is not None:
            allowed = f"in [0, {MAX_LOGPROBS}] or null"
            _check(0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", allowed, self.logprobs)
        if self.prompt_logprobs is not None:
            allowed = f"in [0, {MAX_LOGPROBS}] or null"
            _check(0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs", allowed, self.prompt_logprobs)


def check_truncation(keep) -> None:
    """vLLM's truncate_prompt_tokens: None (the whole prompt), -1 (as much as the context holds),
    or a count >= 1."""
    ok = keep is None or (isinstance(keep, int) and not isinstance(keep, bool) and (keep == -1 or keep >= 1))
    _check(ok, "truncate_prompt_tokens", "-1, an integer >= 1, or null", keep)


def token_ids(values, param: str) -> list[int]:
    """`values` as a list of ints, taking what Python counts as an integer (`operator.index`: ints,
    numpy integers) and nothing else: not floats, even whole ones, not bools, not strings."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise InvalidParams(param, f"{param} must be a list of token ids (integers), got {_shown(values)}")
    out = []
    for i, value in enumerate(values):
        if isinstance(value, bool):
            raise InvalidParams(param, f"{param}[{i}] must be a token id (an integer), got {value!r}")
        try:
            out.append(operator.index(value))
        except TypeError:
            raise InvalidParams(param, f"{param}[{i}] must be a token id (an integer), got {_shown(value)}") from None
    return out


def _shown(value, limit: int = 80) -> str:
    """repr of a client's value, cut short: an error message never echoes a megabyte."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."




class GrammarError(InvalidParams):
    """A grammar that cannot be used: malformed, too large, or too complex to compile."""


@dataclass(slots=True, frozen=True)
class GuidedDecodingParams:
    """What the output must match; exactly one field set (vLLM's `GuidedDecodingParams`).

    json: a JSON schema (a dict or its JSON text); json_object: any JSON object; regex: a regular
    expression the whole output matches (Rust `regex` syntax); choice: one of these strings;
    grammar: a Lark grammar (llguidance's dialect, with `%json` and `<token>` references) or GBNF."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise GrammarError("guided_decoding", f"guided_decoding needs exactly one of {', '.join(_KINDS)}; "
                               f"got {', '.join(given) or 'none'}")
        self.spec()  # type checks and size, before anything is queued

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def spec(self) -> tuple[str, str]:
        """(kind, text): the cache key, and what llguidance compiles."""
        kind = self.kind
        param = f"guided_decoding.{kind}"
        if kind == "json_object":
            return "json", '{"type": "object"}'
        if kind == "json":
            text = self.json if isinstance(self.json, str) else _dumps(self.json, param)
        elif kind == "choice":
            text = _choice_text(self.choice, param)
        else:
            text = getattr(self, kind)
            _expect(isinstance(text, str) and text != "", param, "a non-empty string")
        _expect(len(text) <= MAX_SPEC_CHARS, param, f"at most {MAX_SPEC_CHARS} characters long")
        if kind == "json":
            _expect(json_depth(text) <= MAX_JSON_DEPTH, param, f"nested at most {MAX_JSON_DEPTH} levels deep")
        return kind, text


def _expect(ok: bool, param: str, what: str) -> None:
    if not ok:
        raise GrammarError(param, f"{param} must be {what}")


def _dumps(schema, param: str) -> str:
    _expect(isinstance(schema, dict), param, "a JSON schema (an object)")
    _expect(object_depth(schema) <= MAX_JSON_DEPTH, param, f"nested at most {MAX_JSON_DEPTH} levels deep")
    return json.dumps(schema, ensure_ascii=False)


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON text, counted without parsing it (no recursion):
    brackets outside strings. Malformed text gets a number too; the parser refuses it later."""
    depth = deepest = 0
    for match in _JSON_TOKENS.finditer(text):
        bracket = match.group()
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif bracket in "]}":
            depth -= 1
    return deepest


_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')


def object_depth(value) -> int:
    """How deep lists and dicts nest in `value`, walked with a stack of our own (no recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:  # deeper is refused whatever lies below
            todo += [(child, depth + 1) for child in children]
    return deepest


def _choice_text(choice, param: str) -> str:
    ok = isinstance(choice, (list, tuple)) and choice and all(isinstance(c, str) and c for c in choice)
    _expect(bool(ok), param, "a non-empty list of non-empty strings")
    return json.dumps(list(choice), ensure_ascii=False)
