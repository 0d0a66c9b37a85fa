"""A GGUF file's vocabulary, for the models whose tokenizer transformers' GGUF converter does not
rebuild: BERT's WordPiece (llama.cpp's `bert` tokenizer model) and XLM-RoBERTa's unigram (its `t5`
model, in a `bert` architecture file), rebuilt as the tokenizer llama.cpp's converter read, so an
embedding model from Ollama or a GGUF publisher tokenizes as its checkpoint's tokenizer.json does.

llama.cpp's converter stores BERT's vocabulary in its own spelling: a piece that starts a word
after a phantom space (U+2581), a continuation piece without its `##`, a control token ([CLS],
[SEP], ...) as it is. Undoing that gives the vocabulary back; the rest is BERT's: its normalizer
(lowercasing and stripping accents unless the file's `tokenizer.ggml.normalizer.*` says otherwise,
as llama.cpp reads it), its splitting on whitespace and punctuation, WordPiece, and the
`[CLS] a [SEP]` / `[CLS] a [SEP] b [SEP]` templates (the second text token type 1).

XLM-RoBERTa's sentencepiece vocabulary is stored as it is, with each piece's score, the
normaliser's precompiled character map and whether a space is put before the text; rebuilt as
transformers' XLMRobertaTokenizer builds it: unigram over the pieces and scores, the character map,
whitespace splitting with the phantom space, and `<s> a </s>` / `<s> a </s></s> b </s>`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend
from tokenizers.models import Unigram, WordPiece

PHANTOM_SPACE = "\u2581"
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # llama.cpp's token types (gguf.TokenType)


_WORDPIECE_NAMES = ("cls_token", "sep_token", "unk_token", "pad_token", "mask_token")  # BERT's, as transformers names


class VocabularyError(ValueError):
    """A GGUF WordPiece vocabulary that cannot be read back."""


@dataclass(frozen=True)
class GGUFVocabulary:
    """A GGUF file's vocabulary as its metadata holds it (read by engine/model_config.py): its
    tokenizer model (`bert` or `t5`), the tokens (in llama.cpp's spelling for `bert`), their types,
    the named special tokens' ids (`cls_token`, `sep_token`, `unk_token`, `pad_token`, `mask_token`,
    `bos_token`, `eos_token`; each from the key it came from, for messages), BERT's normaliser flags,
    and a unigram vocabulary's scores, character map and space prefix."""

    model: str
    tokens: list[str]
    kinds: list[int]
    ids: dict[str, tuple[str, object]]  # name: (metadata key, value as the file holds it)
    lowercase: object = True
    strip_accents: object = None  # None: as lowercase
    scores: list | None = None
    charsmap: list | None = None  # the precompiled character map's bytes
    space_prefix: object = True


def vocabulary_tokenizer(v: GGUFVocabulary) -> tuple[_Backend, dict[str, str]]:
    """The vocabulary's tokenizer, and its named special tokens as text."""
    tokens, kinds = v.tokens, v.kinds
    if not tokens or len(kinds) != len(tokens) or not all(isinstance(t, str) for t in tokens):
        raise VocabularyError("a vocabulary needs tokenizer.ggml.tokens and one tokenizer.ggml.token_type per token")
    return _unigram(v) if v.model == "t5" else _wordpiece(v)


def _named(v: GGUFVocabulary, texts: list[str]) -> dict[str, str]:
    named = {}
    for name, (key, at) in v.ids.items():
        if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at < len(texts):
            raise VocabularyError(f"{key} must be a token id below {len(texts)}, got {at!r:.40}")
        named[name] = texts[at]
    return named


def _unigram(v: GGUFVocabulary) -> tuple[_Backend, dict[str, str]]:
    tokens, kinds, scores = v.tokens, v.kinds, v.scores
    if scores is None or len(scores) != len(tokens) or not all(isinstance(x, (int, float)) and math.isfinite(x)
                                                                 for x in scores):
        raise VocabularyError("a unigram vocabulary needs one finite tokenizer.ggml.scores entry per token")
    if len(set(tokens)) != len(tokens):
        raise VocabularyError("a unigram vocabulary holds a token twice")
    unknown = [i for i, k in enumerate(kinds) if k == UNKNOWN]
    if len(unknown) != 1:
        raise VocabularyError(f"a unigram vocabulary needs one unknown token, it has {len(unknown)}")
    named = _named(v, tokens)
    missing = [name for name in ("bos_token", "eos_token") if name not in named]
    if missing:
        raise VocabularyError(f"an XLM-RoBERTa vocabulary needs its {', '.join(missing)}'s id")
    backend = _Backend(Unigram([(t, float(x)) for t, x in zip(tokens, scores)], unk_id=unknown[0], byte_fallback=False))
    if v.charsmap:
        if not all(isinstance(b, int) and 0 <= b < 256 for b in v.charsmap):
            raise VocabularyError("tokenizer.ggml.precompiled_charsmap must hold bytes")
        try:
            backend.normalizer = normalizers.Precompiled(bytes(v.charsmap))
        except Exception as exc:  # the library's own check of the map
            raise VocabularyError(f"tokenizer.ggml.precompiled_charsmap is not a character map: {exc}") from None
    prepend = "always" if _flag("tokenizer.ggml.add_space_prefix", v.space_prefix) else "never"
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                     pre_tokenizers.Metaspace(replacement=PHANTOM_SPACE,
                                                                              prepend_scheme=prepend)])
    backend.decoder = decoders.Metaspace(replacement=PHANTOM_SPACE, prepend_scheme=prepend)
    bos, eos = named["bos_token"], named["eos_token"]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, tokens.index(bos)), (eos, tokens.index(eos))])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, kinds)
                                if k in (CONTROL, UNKNOWN)])
    backend.add_tokens([AddedToken(t, special=False) for t, k in zip(tokens, kinds) if k == USER_DEFINED])
    return backend, {**named, "cls_token": bos, "sep_token": eos}


def _wordpiece(v: GGUFVocabulary) -> tuple[_Backend, dict[str, str]]:
    tokens, kinds = v.tokens, v.kinds
    readback = [token if kind == CONTROL else token[1:] if token.startswith(PHANTOM_SPACE) else "##" + token
                for token, kind in zip(tokens, kinds)]
    pieces: dict[str, int] = {}
    for i, piece in enumerate(readback):
        if pieces.setdefault(piece, i) != i:
            raise VocabularyError(f"token {i} ({tokens[i]!r:.40}) reads back as {piece!r:.40}, as token "
                                  f"{pieces[piece]} does")
    named = {k: t for k, t in _named(v, readback).items() if k in _WORDPIECE_NAMES}
    missing = [name for name in ("cls_token", "sep_token", "unk_token") if name not in named]
    if missing:
        raise VocabularyError(f"a BERT vocabulary needs its {', '.join(missing)}'s id")
    lowercase = _flag("tokenizer.ggml.normalizer.lowercase", v.lowercase)
    strip = lowercase if v.strip_accents is None else _flag("tokenizer.ggml.normalizer.strip_accents", v.strip_accents)
    backend = _Backend(WordPiece(pieces, unk_token=named["unk_token"], continuing_subword_prefix="##"))
    backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, lowercase=lowercase,
                                                    strip_accents=strip)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    cls, sep = named["cls_token"], named["sep_token"]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, pieces[cls]), (sep, pieces[sep])])
    # control tokens are never split from a text's words; a user-defined one is matched as it is
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, kinds)
                                if k == CONTROL])
    backend.add_tokens([AddedToken(piece, special=False) for piece, k in zip(readback, kinds) if k == USER_DEFINED])
    return backend, named


def _flag(key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise VocabularyError(f"{key} must be true or false, got {value!r:.40}")
    return value
