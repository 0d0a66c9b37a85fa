"""Tokenizer, chat templates and streaming detokenisation.

Tokenisation is the `tokenizers` library reading the checkpoint's tokenizer.json; chat templates
are rendered with jinja2 in the same sandbox and with the same helpers as transformers, so a
checkpoint's template produces the prompt its authors tested.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from collections.abc import Sequence
from contextlib import contextmanager
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Encoding
from tokenizers import Tokenizer as _Backend
from tokenizers.pre_tokenizers import ByteLevel

from neuron.engine.gguf_vocab import GGUFVocabulary, VocabularyError, vocabulary_tokenizer
from neuron.errors import NeuronError

# `encode` hands one text at a time to `encode_batch_fast`, a call that releases the GIL. Left on,
# the library would move that one text to its own thread pool, which gains nothing and keeps the
# memory of a large prompt in that pool's malloc arenas after the request ends. The user's value wins.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tokenizing takes about 200 bytes of scratch memory per character, which glibc keeps once freed;
# after a text this long it is handed back to the system (a few ms).
_TRIM_AFTER_CHARS = 1 << 16
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc only

# Named special tokens transformers hands to every chat template.
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning may come under; templates read `reasoning_content`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TokenizerError(NeuronError, ValueError):
    """A tokenizer that cannot be loaded, or a chat that its template cannot render."""


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from None


def _longest_first(a: int, b: int, room: int) -> tuple[int, int]:
    """The lengths two texts of `a` and `b` tokens keep in `room`, as the tokenizers library's
    `longest_first` truncation cuts a pair: the shorter keeps up to half the room (rounded down),
    the longer the rest."""
    if a + b <= room:
        return a, b
    if a <= b:
        kept = min(a, room // 2)
        return kept, room - kept
    kept = min(b, room // 2)
    return room - kept, kept


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode, and render chats with its template."""

    def __init__(
        self,
        backend: _Backend,
        *,
        eos_token: str | None = None,
        chat_template: str | None = None,
        named_tokens: dict[str, str] | None = None,
        templates: dict[str, str] | None = None,
    ):
        # tokenizer.json may carry truncation and padding (sentence-transformers' BERTs: cut at 128,
        # padded to it), which would cut or pad every prompt unasked: a prompt's length is checked
        # and cut by the request's own rules, and no input is padded
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        # a sentence-transformers checkpoint's do_lower_case: its library lowercases every text
        # before its tokenizer sees it (set by the model's configuration, model_config.py)
        self.lowercase = False
        # whether join_pair marks where a pair's second token type starts: an encoder that embeds
        # two types (set by the model's configuration too)
        self.typed_pairs = False
        # a GGUF reranker's prompt for a scored pair (llama.cpp's `rerank` template: {query} and
        # {document} filled in), set by the model's configuration; None: the two texts joined
        self.pair_format: str | None = None
        self._named_tokens = dict(named_tokens or {})
        if eos_token is not None:
            self._named_tokens["eos_token"] = eos_token
        self._templates = dict(templates or {})
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = backend.token_to_id(eos_token) if eos_token else None
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        # None where no bound can be proved; see _max_chars_per_token.
        self.max_chars_per_token: int | None = _max_chars_per_token(backend)
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer else None
        self._byte_level = _byte_level(pre)
        _check_runs(backend)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load tokenizer.json, tokenizer_config.json and chat_template.jinja from a checkpoint folder."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{path} has no tokenizer.json; neuron needs a checkpoint with a fast tokenizer file")
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as exc:
            raise TokenizerError(f"cannot read {tok_file}: {exc}") from None
        cfg_file = path / "tokenizer_config.json"
        cfg = _read_json(cfg_file) if cfg_file.is_file() else {}
        _add_missing_tokens(backend, cfg.get("added_tokens_decoder") or {})
        named = {k: v for k in _NAMED_TOKENS if (v := _token_content(cfg.get(k))) is not None}
        templates = _templates_from_config(cfg.get("chat_template"))
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        return cls(
            backend,
            eos_token=named.get("eos_token"),
            chat_template=templates.get("default"),
            named_tokens=named,
            templates=templates,
        )

    @classmethod
    def from_gguf(cls, path: str | Path, model_type: str) -> "Tokenizer":
        """The tokenizer a GGUF file carries in its metadata (tokenizer.ggml.*, tokenizer.chat_template),
        rebuilt by transformers' GGUF converter into the tokenizer class transformers registers for
        `model_type` (an encoder's: from_vocabulary). The class is named here rather than found by
        AutoTokenizer, which first reads the whole file's config through the `gguf` package: 10 s for
        a vocabulary of 150k tokens, against 1 s for this."""
        from transformers import PreTrainedTokenizerFast
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

        path = Path(path)
        names = TOKENIZER_MAPPING_NAMES.get(model_type)
        name = names[-1] or names[0] if isinstance(names, tuple) else names  # transformers 4: (slow, fast)
        kind = (tokenizer_class_from_name(name) if name else None) or PreTrainedTokenizerFast
        try:
            tok = kind.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as exc:  # the converter's errors are of many kinds
            raise TokenizerError(f"cannot build the tokenizer of {path.name}: {exc}") from None
        named = {k: v for k in _NAMED_TOKENS if isinstance(v := getattr(tok, k, None), str)}
        template = tok.chat_template if isinstance(tok.chat_template, str) else None
        return cls(tok.backend_tokenizer, eos_token=named.get("eos_token"), chat_template=template,
                   named_tokens=named, templates={"default": template} if template else {})

    @classmethod
    def from_vocabulary(cls, vocabulary: GGUFVocabulary, name: str) -> "Tokenizer":
        """A GGUF file's BERT WordPiece or XLM-RoBERTa unigram vocabulary (engine/gguf_vocab.py);
        `name` the file's, for messages."""
        try:
            backend, named = vocabulary_tokenizer(vocabulary)
        except VocabularyError as exc:
            raise TokenizerError(f"cannot build the tokenizer of {name}: {exc}") from None
        return cls(backend, named_tokens=named)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # The batch calls release the GIL while they work and encode does not, so a long prompt
        # tokenized in a worker thread leaves the event loop free. The fast one skips offsets
        # (tokenizers >= 0.21), which halves the time and the memory.
        encode_batch = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
        with _no_panic():
            [encoding] = encode_batch([text.lower() if self.lowercase else text], add_special_tokens=add_special_tokens)
        ids = encoding.ids
        if len(text) >= _TRIM_AFTER_CHARS and _malloc_trim is not None:
            del encoding
            _malloc_trim(0)
        return ids

    def encode_pair(self, first: str, second: str, max_tokens: int | None = None) -> tuple[list[int], int | None]:
        """A pair of texts as one input, as transformers encodes `tokenizer(first, second)` for a
        cross-encoder (join_pair)."""
        return self.join_pair(self.encode(first), self.encode(second), max_tokens)

    def join_pair(self, first: list[int], second: list[int],
                  max_tokens: int | None = None) -> tuple[list[int], int | None]:
        """Two texts' ids (encoded without special tokens) as one input, with the special tokens
        the post-processor's pair template puts around and between them, and where in it the
        template's second token type starts (BERT's: after the [SEP] between the texts; None where
        it gives every token the first, as RoBERTa's does). `max_tokens` bounds the whole, cutting
        the texts' ends as the tokenizer's `longest_first` truncation does. Each text is encoded
        once however many pairs it is in: the template is learnt once."""
        before, between, after = self._pair_template
        if max_tokens is not None:
            room = max_tokens - len(before) - len(between) - len(after)
            if room < 2:
                raise TokenizerError(f"{max_tokens} tokens leave no room for the pair's texts and its "
                                     "special tokens")
            a, b = _longest_first(len(first), len(second), room)
            first, second = first[:a], second[:b]
        at = self.second_type_at if self.typed_pairs else None
        return [*before, *first, *between, *second, *after], None if at is None else len(before) + len(first) + at

    def cut(self, text: str, max_tokens: int) -> str:
        """`text` up to the end of its `max_tokens`-th token (encoded without special tokens); the
        whole text when it has no more."""
        if self.lowercase:
            text = text.lower()  # what is encoded, and so what the offsets index
        with _no_panic():
            [encoding] = self._backend.encode_batch([text], add_special_tokens=False)
        if len(encoding.ids) <= max_tokens:
            return text
        return text[: encoding.offsets[max_tokens - 1][1]] if max_tokens > 0 else ""

    def join_single(self, ids: list[int], max_tokens: int | None = None) -> list[int]:
        """One text's ids (encoded without special tokens) with the special tokens the
        post-processor puts around a single text; `max_tokens` bounds the whole, cutting the
        text's end (transformers' truncation of one text)."""
        before, after = self.single_template
        if max_tokens is not None:
            room = max_tokens - len(before) - len(after)
            if room < 1:
                raise TokenizerError(f"{max_tokens} tokens leave no room for the text and its special tokens")
            ids = ids[:room]
        return [*before, *ids, *after]

    def single_overhead(self) -> int:
        """How many special tokens the post-processor adds to one text."""
        return sum(map(len, self.single_template))

    @cached_property
    def single_template(self) -> tuple[list[int], ...]:
        """The special tokens the post-processor puts before and after one text."""
        return self._specials_around(*self._framed(["a"]))

    def pair_overhead(self) -> int:
        """How many special tokens the pair template adds."""
        return sum(map(len, self._pair_template))

    @cached_property
    def _pair_template(self) -> tuple[list[int], ...]:
        """The special tokens the post-processor puts before, between and after a pair's texts."""
        return self._specials_around(*self._pair_probe)

    @cached_property
    def _pair_probe(self) -> tuple[list[Encoding], Encoding]:
        """A pair framed once: its template's special tokens and its token types are read off it."""
        return self._framed(["a", "b"])

    @cached_property
    def second_type_at(self) -> int | None:
        """Where the pair template's second token type starts, counted from the end of its first
        text (BERT's `[CLS] a [SEP] b [SEP]`: type 0 through the first [SEP], so 1); None when it
        gives every token one type (RoBERTa's). TokenizerError for types that are not one run of
        the first, then one of the second starting between the texts."""
        [a, _], joined = self._pair_probe
        types = joined.type_ids
        if not any(types):
            return None
        before, between, _ = self._pair_template
        first, end_of_a = types.index(1), len(before) + len(a.ids)
        if not end_of_a <= first <= end_of_a + len(between) or any(t != 1 for t in types[first:]):
            raise TokenizerError(f"its token types {types} are not one run of the first type through the first text, "
                                 "then one of the second from between the texts")
        return first - end_of_a

    def _framed(self, probes: list[str]) -> tuple[list[Encoding], Encoding]:
        """One text or a pair (`probes`) encoded alone, and as the post-processor frames them."""
        with _no_panic():
            encodings = self._backend.encode_batch(probes, add_special_tokens=False)
            return encodings, self._backend.post_process(*encodings, add_special_tokens=True)

    @staticmethod
    def _specials_around(encodings: list[Encoding], joined: Encoding) -> tuple[list[int], ...]:
        """The special tokens the post-processor put around the texts of `encodings` in `joined`
        (`_framed`): the runs before, between and after their tokens."""
        content = [i for i, special in enumerate(joined.special_tokens_mask) if not special]
        if len(content) != sum(len(e.ids) for e in encodings):
            raise TokenizerError("the tokenizer's post-processor changes the texts it frames: a scored pair's input "
                                 "cannot be made")
        cuts, at = [0], 0
        for e in encodings:  # each text's first token, and the one after its last
            cuts += [content[at], content[at + len(e.ids) - 1] + 1]
            at += len(e.ids)
        cuts.append(len(joined.ids))
        return tuple(joined.ids[cuts[k]:cuts[k + 1]] for k in range(0, len(cuts), 2))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        try:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as exc:
            raise TokenizerError(f"cannot decode token ids: {exc}") from None

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def added_token_id(self, text: str) -> int | None:
        """The id of the added (special or user-defined) token whose text is `text`, as a chat
        template's markers are; None where no added token is that text."""
        at = self._backend.token_to_id(text)
        return at if at is not None and self._added.get(at) == text else None

    def fill_in_the_middle(self, prefix: str, suffix: str) -> str | None:
        """The prompt that asks the model for the text between `prefix` and `suffix`, in the
        fill-in-the-middle format its vocabulary has tokens for (Qwen's coders, StarCoder's,
        DeepSeek-Coder's, Codestral's); None when it has none."""
        for tokens, layout in _FIM_FORMATS:
            if all(self.token_to_id(t) is not None for t in tokens):
                return layout.format(*tokens, prefix=prefix, suffix=suffix)
        return None

    def id_to_token(self, id: int) -> str | None:
        return self._backend.id_to_token(id) if id >= 0 else None

    def is_special(self, id: int) -> bool:
        return id in self._special_ids

    @property
    def named_tokens(self) -> dict[str, str]:
        """The special tokens tokenizer_config.json names (bos_token, eos_token, pad_token, ...)."""
        return dict(self._named_tokens)

    def added_tokens_decoder(self) -> dict[str, dict]:
        """The added tokens by id, as tokenizer_config.json writes them."""
        return {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                         "single_word": t.single_word, "special": t.special}
                for i, t in sorted(self._backend.get_added_tokens_decoder().items())}

    def to_json(self) -> str:
        """tokenizer.json as loaded, with the tokens tokenizer_config.json added (for grammar engines)."""
        return self._backend.to_str()

    def token_bytes(self, id: int) -> bytes:
        """The bytes one token stands for. A byte-level token that holds part of a UTF-8 character
        gives that part (decoding it alone would give U+FFFD); a byte-fallback token `<0xNN>` its
        byte; an added token, or a token of another vocabulary, the UTF-8 of its text."""
        piece = self._added.get(id) or self.id_to_token(id)
        if piece is None:
            return b""
        if id not in self._added:
            if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
        return self.decode([id], skip_special_tokens=False).encode()

    def use_chat_template(self, template: str) -> None:
        """Render every chat with `template` (Jinja source) in place of the tokenizer's own (its
        tool-use template too); TokenizerError when it does not compile."""
        try:
            _compile(template)
        except TokenizerError:
            raise
        except Exception as exc:
            raise TokenizerError(f"the chat template does not compile: {type(exc).__name__}: {exc}") from None
        self.chat_template = template
        self._templates = {"default": template}

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        **template_kwargs,
    ) -> str:
        """The prompt for `messages`, rendered as transformers' apply_chat_template(tokenize=False)
        would: by `chat_template` where given (Jinja source), else the tokenizer's own.
        `continue_final_message`: the prompt ends right after the last message's text, which the
        reply then continues (a prefill; transformers' and vLLM's meaning); it excludes
        `add_generation_prompt`."""
        if continue_final_message and add_generation_prompt:
            raise TokenizerError("continue_final_message continues the last message, so it needs "
                                 "add_generation_prompt false")
        messages = _normalise_messages(messages)
        template = self._templates.get("tool_use") if tools and chat_template is None else None
        template = chat_template or template or self.chat_template
        if template is None:
            text = _chatml(messages, add_generation_prompt)
        else:
            text = self._render(template, messages, tools, add_generation_prompt, template_kwargs)
        return _continued(text, messages) if continue_final_message else text

    def _render(self, template: str, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                template_kwargs: dict) -> str:
        context = {"documents": None, **self._named_tokens, **template_kwargs}
        context |= {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt}
        try:
            return _compile(template).render(**context)
        except TokenizerError:
            raise
        except Exception as exc:  # a template is untrusted code; any failure is the chat's, not ours
            raise TokenizerError(f"chat template failed: {type(exc).__name__}: {exc}") from None


# Fill-in-the-middle prompts: the tokens a vocabulary must have, and how the prompt lays them out.
_FIM_FORMATS = (
    (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), "{0}{prefix}{1}{suffix}{2}"),  # Qwen2.5-Coder, Qwen3
    (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), "{0}{prefix}{1}{suffix}{2}"),  # StarCoder, Granite Code
    (("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),
     "{0}{prefix}{1}{suffix}{2}"),  # DeepSeek-Coder
    (("[SUFFIX]", "[PREFIX]"), "{0}{suffix}{1}{prefix}"),  # Codestral: the suffix first
)

# How many characters of input one character of a normalizer's output can come from. NFC and NFKC
# compose: an output character comes from at most as many input characters as its canonical
# decomposition has, at most 4 (U+1FAF and others). The rest listed never shorten text.
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "ByteLevel": 1}
# Pre-tokenizers that split text without dropping any of it (Split does too, unless it removes).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}


def _max_chars_per_token(backend: _Backend) -> int | None:
    """The most characters of input text one token can stand for, or None where no bound holds.

    A token covers at most as many characters of normalized text as its string in the vocabulary
    is long: a byte-level token has one character per byte, and a character is at least one byte.
    A normalizer that composes characters widens that by its factor. So text of n characters
    always tokenizes to at least n / max_chars_per_token tokens, and a prompt can be refused by its
    length alone. The bound fails where tokenizing can drop text or fold a run of any length into
    one token (a normalizer or pre-tokenizer that deletes, unknown symbols fused or skipped,
    WordPiece's and Unigram's unknown words, added tokens that strip spaces); then it is None."""
    shrink = _shrink(json.loads(backend.normalizer.__getstate__()) if backend.normalizer else None)
    pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer else None
    vocab = backend.get_vocab(with_added_tokens=True)
    if shrink is None or not _keeps_text(pre) or not _covers_all_text(backend.model, pre, vocab):
        return None
    if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
        return None
    return shrink * max(map(len, vocab), default=1)


def _shrink(spec: dict | None) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factors = [_shrink(s) for s in spec.get("normalizers", [])]
        return None if None in factors else math.prod(factors)
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}).get("String"), spec.get("content") or ""
        return math.ceil(len(pattern) / len(content)) if pattern is not None and content else None
    return _NORMALIZER_SHRINK.get(kind)


def _keeps_text(spec: dict | None) -> bool:
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        return all(_keeps_text(s) for s in spec.get("pretokenizers", []))
    return spec.get("type") in _KEEPING_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def _covers_all_text(model, pre: dict | None, vocab: dict[str, int]) -> bool:
    """Whether the model gives every symbol its own token (none skipped, no run of them fused)."""
    if type(model).__name__ != "BPE":
        return False
    if model.byte_fallback or (model.unk_token is not None and not model.fuse_unk):
        return True
    return _byte_level(pre) and all(c in vocab for c in ByteLevel.alphabet())


def _gpt2_byte_chars() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's): printable Latin-1 characters stand for their own byte, the
    other bytes for the characters from U+0100 on, in byte order."""
    own = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in own]
    return {chr(b): b for b in own} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_OF_CHAR = _gpt2_byte_chars()


def _byte_level(spec: dict | None) -> bool:
    if spec is None:
        return False
    return spec.get("type") == "ByteLevel" or any(_byte_level(s) for s in spec.get("pretokenizers", []))


# Characters of many scripts and forms (Latin and its accents, Greek, Cyrillic, Hebrew, Arabic,
# Devanagari, Thai, punctuation, letter-like and enclosed symbols, CJK, kana, Hangul, compatibility and
# full-width forms, mathematical letters, emoji) that a tokenizer encodes once when it loads.
_PROBE = "".join(chr(c) for a, b in [(0x20, 0x250), (0x300, 0x500), (0x590, 0x700), (0x900, 0x980), (0xE00, 0xE80),
                                     (0x1E00, 0x1F00), (0x2000, 0x2200), (0x2460, 0x2500), (0x2E80, 0x3400),
                                     (0x4E00, 0x4F00), (0xAC00, 0xAD00), (0xF900, 0xFB50), (0xFE30, 0xFE70),
                                     (0xFF00, 0xFFF0), (0x1D400, 0x1D500), (0x1F100, 0x1F200), (0x1F600, 0x1F650)]
                 for c in range(a, b))


@contextmanager
def _no_panic():
    """A panic inside the tokenizers library (a Rust panic is a BaseException, which no request's
    handler expects) as a TokenizerError: a corrupt character map can make one on some text."""
    try:
        yield
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise TokenizerError(f"the tokenizer failed on this text: {str(exc).splitlines()[0][:200]}") from None


def _check_runs(backend: _Backend) -> None:
    """Encode _PROBE once (a millisecond or so), so that a tokenizer whose files are corrupt in a way
    its loader does not see (a precompiled character map's tables) fails at load, not at a request."""
    try:
        with _no_panic():
            backend.encode_batch([_PROBE], add_special_tokens=False)
    except Exception as exc:  # the library's own errors, and its panics (as TokenizerError)
        raise TokenizerError(f"the tokenizer fails on ordinary text of many scripts: {exc}") from None


def _add_missing_tokens(backend: _Backend, added: dict) -> None:
    """Register tokens that tokenizer_config.json declares but tokenizer.json lacks, as transformers does."""
    for _, spec in sorted(added.items(), key=lambda kv: int(kv[0])):
        content = spec.get("content")
        if not isinstance(content, str) or backend.token_to_id(content) is not None:
            continue
        token = AddedToken(
            content,
            single_word=spec.get("single_word", False),
            lstrip=spec.get("lstrip", False),
            rstrip=spec.get("rstrip", False),
            normalized=spec.get("normalized", not spec.get("special", False)),
            special=spec.get("special", False),
        )
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])


def _templates_from_config(value) -> dict[str, str]:
    """tokenizer_config's chat_template: one string, or a list of {"name", "template"} entries."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value if isinstance(t, dict) and "name" in t and "template" in t}
    return {}


def _normalise_messages(messages: list[dict]) -> list[dict]:
    """Copy the chat as transformers does: drop None values and alias reasoning field names."""
    if not isinstance(messages, list) or not messages:
        raise TokenizerError("a chat needs at least one message")
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise TokenizerError(f"chat messages must be objects with a role, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _continued(text: str, messages: list[dict]) -> str:
    """The rendered chat cut right after its last message's text (what transformers and vLLM do
    with continue_final_message). The text is found from the end: the template may have added its
    end-of-turn, and trimmed the text's outer spaces."""
    content = messages[-1].get("content")
    if isinstance(content, list):  # parts: the last text part is where the message ends
        content = next((p.get("text") for p in reversed(content) if isinstance(p, dict) and p.get("type") == "text"),
                       None)
    stripped = content.strip() if isinstance(content, str) else ""
    if not stripped or stripped not in text:
        raise TokenizerError("continue_final_message needs a last message whose text the chat template renders")
    at = text.rindex(stripped)
    kept = content.lstrip()  # its trailing spaces too, where the template kept them
    return text[: at + (len(kept) if text[at: at + len(kept)] == kept else len(stripped))]


def _chatml(messages: list[dict], add_generation_prompt: bool) -> str:
    """The prompt format used when a checkpoint ships no template."""
    turns = [f"<|im_start|>{m.get('role', 'user')}\n{_text_of(m.get('content'))}<|im_end|>\n" for m in messages]
    return "".join(turns) + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _raise_exception(message):
    raise TokenizerError(f"chat template rejected the chat: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


# Tokens decoded before the first new one, so decoders that look at context (leading spaces) see it.
_CONTEXT_TOKENS = 5
# A character spans at most 4 bytes, so text held back this long is invalid bytes, not a split character.
_MAX_HELD_TOKENS = 16


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a character.

    Each push decodes only a short window, ids[prefix:], and emits what it adds to the text of
    ids[prefix:read]. A delta that ends in U+FFFD may be an incomplete UTF-8 sequence, so it is
    held back until a later token completes it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])  # the window: ids from the prefix offset on
        self._read = len(self._ids)  # window index up to which text has been emitted
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix, new = self._decode_window()
        held = len(self._ids) - self._read
        if new.endswith("\ufffd") and held < _MAX_HELD_TOKENS:
            return ""
        if len(new) <= len(prefix) and held < _MAX_HELD_TOKENS:
            return ""
        return self._emit(new[len(prefix) :])

    def flush(self) -> str:
        """Whatever is still held back, at the end of the sequence."""
        prefix, new = self._decode_window()
        return self._emit(new[len(prefix) :])

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        return decode(self._ids[: self._read], self._skip), decode(self._ids, self._skip)

    def _emit(self, delta: str) -> str:
        del self._ids[: self._read]  # the tokens just read become the next prefix
        self._read = len(self._ids)
        if delta:
            self._parts.append(delta)
        return delta
