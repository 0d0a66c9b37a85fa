"""Checks on a request before it is queued: the prompt against the model's context and
vocabulary, its images and their placeholders, sampling constraints that could leave nothing to
sample, its structured-output grammar and its cache salt. Runs on the caller's thread (the
server's worker threads, the offline API), never on the engine's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from neuron.engine.sampling_params import GrammarError, SamplingParams
from neuron.engine.structured_output import CompiledGrammar, GrammarMatcher, StructuredOutput
from neuron.errors import NeuronError
from neuron.multimodal.image import (
    ImageError,
    ImageInput,
    VisionSpec,
    check_image,
    expand_placeholders,
    image_spans,
    vision_activation_bytes,
    vision_unsupported,
)
from neuron.utils.procfs import available_memory

# A cache salt is a client's secret (a random 256-bit salt is 43 characters of base64); past this
# length it is refused rather than hashed.
MAX_CACHE_SALT_CHARS = 1024


def kept_tokens(keep: int | None, max_model_len: int) -> int | None:
    """How many tokens vLLM's truncate_prompt_tokens keeps: -1 as many as the context holds,
    None no bound."""
    return max_model_len if keep == -1 else keep


class RequestError(NeuronError):
    """A request the engine refuses before any device work; `code` is the OpenAI error code."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


def check_cache_salt(salt) -> None:
    """A request's cache salt is None or a non-empty string of at most MAX_CACHE_SALT_CHARS
    characters. The message says what was wrong without showing the salt: it is a secret."""
    if salt is None or (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        return
    got = f"{len(salt)} characters" if isinstance(salt, str) else type(salt).__name__
    raise RequestError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters, "
                       f"got {got}", param="cache_salt")


@dataclass(slots=True)
class InputProcessor:
    """What a request is checked against: the model's limits, vocabulary and EOS ids, its vision
    tower, the grammar compiler, and what one step can carry to the ranks."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    vision: VisionSpec | None
    structured: StructuredOutput | None
    max_image_bytes: Callable[[], int]  # encoded image bytes one step's protocol line can carry (a live setting)
    device: str  # rank 0's device, where the vision tower's activations must fit
    dtype: str
    ranks_on_device: int = 1  # ranks that run their own vision tower in that device's memory
    # an encoder's: the special tokens its tokenizer puts before and after one text, which a cut
    # keeps, cutting the text's end as the tokenizer's truncation does (None: keep the last tokens)
    frame: tuple[list[int], list[int]] | None = None
    token_types: int = 0  # how many token types an encoder embeds (ModelConfig.token_types)

    def truncated(self, prompt_token_ids: list[int], keep: int | None,
                  images: list[ImageInput] | None = None) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as the
        context holds; None: all); an encoder's first ones, its text's end cut inside the special
        tokens that frame it ([CLS] ... [SEP]), as its tokenizer truncates. A count beyond the
        context is refused, as is a cut through a prompt with images (their placeholders must stay
        whole)."""
        if keep is None:
            return prompt_token_ids
        if keep > self.max_model_len:
            raise RequestError(f"truncate_prompt_tokens ({keep}) is greater than this model's context "
                               f"({self.max_model_len} tokens)", param="truncate_prompt_tokens")
        keep = kept_tokens(keep, self.max_model_len)
        if len(prompt_token_ids) <= keep:
            return prompt_token_ids
        if images:
            raise RequestError(f"truncate_prompt_tokens ({keep}) would cut this prompt of {len(prompt_token_ids)} "
                               "tokens, and a prompt with images is not cut", param="truncate_prompt_tokens")
        if self.frame is not None:
            return _cut_inside(prompt_token_ids, keep, *self.frame)
        return prompt_token_ids[len(prompt_token_ids) - keep:]

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 images: list[ImageInput] | None = None) -> int:
        """Refuse a request that cannot run; return its max_tokens clamped to the context."""
        return self.admit(prompt_token_ids, params, images)[0]

    def admit(self, prompt_token_ids: list[int], params: SamplingParams, images: list[ImageInput] | None = None,
              compiled: CompiledGrammar | None = None) -> tuple[int, GrammarMatcher | None]:
        """`validate`, and the new sequence's place in its grammar (None without structured output):
        `compiled`'s when the caller compiled the params' grammar already."""
        if params.n != 1 or params.best_of not in (None, 1):
            raise RequestError("the engine runs one sample per request: split n and best_of into one request per "
                               "sample first (parallel_sampling.sample_params)", param="n")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has {n} "
                "tokens (no room to generate)", code="context_length_exceeded", param="messages")
        self._check_tokens(prompt_token_ids, "prompt")
        self._check_placeholders(prompt_token_ids, images or [])
        if images and params.prompt_logprobs is not None:  # an image placeholder has no logprob to speak of
            raise RequestError("prompt_logprobs are not supported for prompts with images", param="prompt_logprobs")
        self._check_samplable(params)
        grammar = self.grammar(params, compiled)
        room = self.max_model_len - n
        return (room if params.max_tokens is None else min(params.max_tokens, room)), grammar

    def admit_pooling(self, prompt_token_ids: list[int], types_from: int | None = None) -> None:
        """Refuse an embedding input that cannot run: empty, past the model length (it may fill
        it: nothing is generated), with ids that are no tokens of the vocabulary, or with a second
        token type (`types_from`, where it starts) that the model lacks or that starts outside it."""
        n = len(prompt_token_ids)
        if types_from is not None and self.token_types < 2:
            raise RequestError("this model embeds one token type: an input of two types is for an encoder that "
                               "embeds two (BERT's)", param="token_type_ids")
        if types_from is not None and (type(types_from) is not int or not 0 <= types_from <= n):
            raise RequestError(f"the second token type must start inside the input's {n} tokens, got {types_from!r}",
                               param="token_type_ids")
        if n > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the input has {n} "
                "tokens: shorten it or split it into several inputs", code="context_length_exceeded", param="input")
        self._check_tokens(prompt_token_ids, "input")

    def _check_tokens(self, prompt_token_ids: list[int], param: str) -> None:
        if not prompt_token_ids:
            raise RequestError(f"the {param} is empty", param=param)
        if not all(type(t) is int for t in prompt_token_ids):  # bools, floats, numpy scalars: convert first
            kind = next(type(t).__name__ for t in prompt_token_ids if type(t) is not int)
            raise RequestError(f"token ids must be Python ints, got a {kind}", param=param)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                               param=param)

    def _check_samplable(self, params: SamplingParams) -> None:
        """Refuse constraints that leave the first token nothing to be. Until min_tokens tokens exist
        the sampler masks every EOS id (ignore_eos or not) and every stop_token_id; nothing else a
        request sets can empty a distribution (top_k, top_p and min_p keep the most likely token)
        but allowed_token_ids, when min_tokens masks them all. logit_bias and allowed_token_ids
        name tokens of the vocabulary."""
        for name in ("logit_bias", "allowed_token_ids"):
            bad = next((t for t in getattr(params, name) or () if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise RequestError(f"{name} holds token id {bad}, outside the vocabulary (0..{self.vocab_size - 1})",
                                   param=name)
        stops = params.stop_token_ids or ()
        if params.allowed_token_ids is not None and params.min_tokens > 0:
            if set(params.allowed_token_ids) <= {*stops, *self.eos_token_ids}:
                raise RequestError(f"min_tokens ({params.min_tokens}) blocks EOS and stop_token_ids, and every one of "
                                   "allowed_token_ids is one of them, so no token could be sampled",
                                   param="allowed_token_ids")
        if params.min_tokens == 0 or len(stops) + len(self.eos_token_ids) < self.vocab_size:
            return
        masked = {t for t in (*stops, *self.eos_token_ids) if 0 <= t < self.vocab_size}
        if len(masked) == self.vocab_size:
            raise RequestError(
                f"min_tokens ({params.min_tokens}) blocks EOS and stop_token_ids, and together they cover "
                f"all {self.vocab_size} tokens of the vocabulary, so no token could be sampled: lower "
                "min_tokens to 0 or leave some ids out of stop_token_ids", param="stop_token_ids")

    def check_images(self, uris: list, placeholders: int | None = None) -> list[ImageInput]:
        """Size, bound and decode a request's images before any device work, cheapest checks first:
        the placeholder count (when the caller knows it), the encoded size, each image's header
        (pixels, and the context its tokens take), the vision tower's memory, and only then the
        pixels themselves. Raises ImageError: 400 for a model without vision, a URI that is not
        base64 `data:`, bytes that are no image, placeholders that do not match, or images that
        overflow the context; 413 over NEURON_VISION_MAX_PIXELS or the step's line; 503 when the
        vision tower's activations cannot fit the device (or, on CPU, the memory left)."""
        if self.vision is None:
            raise vision_unsupported()
        if placeholders is not None and placeholders != len(uris):
            raise ImageError(f"the prompt has {placeholders} image placeholder(s) but {len(uris)} image(s) were given")
        size, limit = sum(len(u) for u in uris if isinstance(u, str)), self.max_image_bytes()
        if size > limit:  # the images travel to every worker in one protocol line
            raise ImageError(f"the request's images take {size} bytes encoded; at most {limit} fit one step "
                             "(NEURON_MAX_LINE_BYTES)", status=413, code="image_too_large")
        sized = [check_image(uri, self.vision, decode=False) for uri in uris]
        tokens = sum(i.num_tokens for i in sized)
        if tokens >= self.max_model_len:
            raise ImageError(f"the images take {tokens} tokens of context; this model's maximum context length is "
                             f"{self.max_model_len} tokens. Send fewer or smaller images",
                             code="context_length_exceeded")
        self._check_vision_memory(sized)
        return [check_image(uri, self.vision) for uri in uris]

    def _check_vision_memory(self, images: list[ImageInput]) -> None:
        """503 when the vision tower's activations for `images`, on every rank that shares this
        device (all of them on CPU), exceed what the device has free."""
        if not images:
            return
        width = 2 if self.dtype in ("bfloat16", "float16") or (self.dtype == "auto" and self.device != "cpu") else 4
        need = vision_activation_bytes(self.vision, images, width) * self.ranks_on_device
        if self.device.startswith("cuda"):
            free, where = torch.cuda.mem_get_info(self.device)[0], "GPU memory"
        else:
            free, where = available_memory(), "memory"
        if free is not None and need > free:
            raise ImageError(f"the images need about {need / 2**20:.0f} MiB of {where} for the vision tower; "
                             f"{free / 2**20:.0f} MiB are free. Send fewer or smaller images",
                             status=503, code="insufficient_memory" if where == "memory" else "insufficient_vram")

    def expand_images(self, prompt_token_ids: list[int], images: list[ImageInput]) -> list[int]:
        """The prompt with its one placeholder per image widened to the tokens the image fills."""
        if self.vision is None:
            raise vision_unsupported()
        return expand_placeholders(list(prompt_token_ids), self.vision.image_token_id, images)

    def grammar(self, params: SamplingParams, compiled: CompiledGrammar | None = None) -> GrammarMatcher | None:
        """A new sequence's place in its structured output's grammar: `compiled`'s (the server
        compiles off the event loop), else the params' GuidedDecodingParams compiled here, in the
        caller's thread (cached)."""
        if compiled is not None:
            return compiled.matcher()
        if params.guided_decoding is None:
            return None
        if self.structured is None:
            raise RequestError("structured output needs the checkpoint's tokenizer.json", param="guided_decoding")
        try:
            return self.structured.compile(params.guided_decoding).matcher()
        except GrammarError as exc:
            raise RequestError(str(exc), param=exc.param) from None

    def _check_placeholders(self, prompt_token_ids: list[int], images: list[ImageInput]) -> None:
        if self.vision is None:
            if images:
                raise vision_unsupported()
            return
        try:
            image_spans(prompt_token_ids, self.vision.image_token_id, [i.num_tokens for i in images])
        except ValueError as exc:
            raise RequestError(f"the prompt's image placeholders do not match its images: {exc}",
                               param="prompt") from None


def _cut_inside(ids: list[int], keep: int, before: list[int], after: list[int]) -> list[int]:
    """`ids` cut to `keep` tokens at the end of the text inside its frame: the special tokens
    `before` and `after` it stay where the prompt has them (a prompt without them is cut at its end)."""
    head = len(before) if ids[:len(before)] == before else 0
    tail = len(after) if after and len(ids) - head >= len(after) and ids[len(ids) - len(after):] == after else 0
    room = keep - head - tail
    if room < 1:
        raise RequestError(f"truncate_prompt_tokens ({keep}) leaves no room for the text inside its {head + tail} "
                           "special tokens", param="truncate_prompt_tokens")
    return ids[:head + room] + ids[len(ids) - tail:]
