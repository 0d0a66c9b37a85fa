"""A GGUF file's WordPiece vocabulary (llama.cpp's `bert` tokenizer model) as the tokenizer its
converter read, so a BERT embedding model from Ollama or a GGUF publisher tokenizes as its
checkpoint's tokenizer.json does.

llama.cpp's converter stores BERT's vocabulary in its own spelling: a piece that starts a word
after a phantom space (U+2581), a continuation piece without its `##`, a control token ([CLS],
[SEP], ...) as it is. Undoing that gives the vocabulary back; the rest is BERT's: its normalizer
(lowercasing and stripping accents unless the file's `tokenizer.ggml.normalizer.*` says otherwise,
as llama.cpp reads it), its splitting on whitespace and punctuation, WordPiece, and the
`[CLS] a [SEP]` / `[CLS] a [SEP] b [SEP]` templates (the second text token type 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend
from tokenizers.models import WordPiece

PHANTOM_SPACE = "\u2581"
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types (gguf.TokenType)


class VocabularyError(ValueError):
    """A GGUF WordPiece vocabulary that cannot be read back."""


@dataclass(frozen=True)
class GGUFVocabulary:
    """A GGUF file's WordPiece vocabulary as its metadata holds it (read by engine/model_config.py):
    the tokens in llama.cpp's spelling, their types, the named special tokens' ids (`cls_token`,
    `sep_token`, `unk_token`, `pad_token`, `mask_token`; each from the key it came from, for
    messages) and the normaliser's flags."""

    tokens: list[str]
    kinds: list[int]
    ids: dict[str, tuple[str, object]]  # name: (metadata key, value as the file holds it)
    lowercase: object = True
    strip_accents: object = None  # None: as lowercase


def wordpiece_tokenizer(v: GGUFVocabulary) -> tuple[_Backend, dict[str, str]]:
    """The vocabulary's tokenizer, and its named special tokens as text."""
    tokens, kinds = v.tokens, v.kinds
    if not tokens or len(kinds) != len(tokens) or not all(isinstance(t, str) for t in tokens):
        raise VocabularyError("a WordPiece vocabulary needs tokenizer.ggml.tokens and one tokenizer.ggml.token_type "
                              "per token")
    readback = [token if kind == CONTROL else token[1:] if token.startswith(PHANTOM_SPACE) else "##" + token
                for token, kind in zip(tokens, kinds)]
    pieces: dict[str, int] = {}
    for i, piece in enumerate(readback):
        if pieces.setdefault(piece, i) != i:
            raise VocabularyError(f"token {i} ({tokens[i]!r:.40}) reads back as {piece!r:.40}, as token "
                                  f"{pieces[piece]} does")
    named = {}
    for name, (key, at) in v.ids.items():
        if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at < len(tokens):
            raise VocabularyError(f"{key} must be a token id below {len(tokens)}, got {at!r:.40}")
        named[name] = readback[at]
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
