"""The requests a benchmark sends: random token ids, random words, or lines of a JSONL file."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import msgspec

from neuron.errors import ConfigError

# Token ids in this range exist in every real vocabulary and are rarely special tokens.
TOKEN_ID_RANGE = (100, 999)

# Common words, most of them one token in BPE vocabularies, so `n` words is close to `n` tokens
# when the server's tokenizer is not known.
WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be or "
    "has had have not first one their its new after who they two been other all also into more only "
    "time year over when some these many would most city such about between may where like during "
    "three part under people water world school house state family group number river music game "
    "small large early later known since while before both each long high great place work "
    "history public second several because through well made used called found began became named "
    "north south east west road line team book film season church local area home field life light "
    "stone green black white red blue old young open free full clear short wide simple strong quiet"
).split()


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int  # exact for token ids; words for text, until the server's usage says otherwise
    max_tokens: int


def build_requests(n: int, *, seed: int, input_len: tuple[int, int], output_len: tuple[int, int],
                   token_ids: bool, prompts_file: str | None = None) -> list[BenchRequest]:
    """`n` requests, the same for the same arguments; lengths are uniform in the inclusive ranges."""
    rng = random.Random(seed)
    if prompts_file is not None:
        return _from_file(Path(prompts_file), n, output_len, rng)
    out = []
    for _ in range(n):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        prompt = [rng.randint(*TOKEN_ID_RANGE) for _ in range(n_in)] if token_ids \
            else " ".join(rng.choices(WORDS, k=n_in))
        out.append(BenchRequest(prompt, n_in, n_out))
    return out


def _from_file(path: Path, n: int, output_len: tuple[int, int], rng: random.Random) -> list[BenchRequest]:
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    except OSError as e:
        raise ConfigError(f"cannot read prompts file {path}: {e.strerror}") from None
    if not lines:
        raise ConfigError(f"prompts file {path} has no lines; each line is a JSON object with a \"prompt\"")
    items = [_parse_line(path, i + 1, ln) for i, ln in enumerate(lines)]
    # Cycle through the file when it is shorter than the run.
    return [BenchRequest(p, _length(p), m if m is not None else rng.randint(*output_len))
            for p, m in (items[i % len(items)] for i in range(n))]


def _parse_line(path: Path, lineno: int, line: str) -> tuple[str | list[int], int | None]:
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError as e:
        raise ConfigError(f"{path}:{lineno}: not JSON ({e})") from None
    prompt = obj.get("prompt") if isinstance(obj, dict) else None
    ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ok_ids:
        raise ConfigError(f"{path}:{lineno}: needs \"prompt\": a non-empty string or list of token ids")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ConfigError(f"{path}:{lineno}: \"max_tokens\" must be a positive integer")
    return prompt, max_tokens


def _length(prompt: str | list[int]) -> int:
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())
