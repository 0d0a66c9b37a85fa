"""What the entrypoints may ask of the model, and nothing more: vLLM's `EngineClient`.

HTTP handlers see `AsyncEngine` only through this surface (and `open`, which submits a request):
the model's limits and tokenizer, request checks, image checks and expansion, tokenizing and
grammar compilation. None of it touches the ranks or the scheduler, so none of it waits for the
engine thread; the CPU-heavy calls (tokenizing, templates, images, grammars) are the caller's to
make from a worker thread. Everything here is plain data in and out, so the engine could live in
another process behind the same surface.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from neuron.engine.sampling_params import GuidedDecodingParams, SamplingParams

if TYPE_CHECKING:
    from neuron.engine.llm_engine import LLMEngine
    from neuron.engine.structured_output import CompiledGrammar
    from neuron.engine.tokenizer import Tokenizer
    from neuron.multimodal.image import ImageInput, VisionSpec


class EngineClient:
    """The model-facing half of AsyncEngine. `engine` is the loaded LLMEngine, None until the first
    load ends; callers check readiness first (AsyncEngine.state)."""

    engine: LLMEngine | None

    @property
    def loaded(self) -> bool:
        """A model has loaded (it may be recovering since; AsyncEngine.state says)."""
        return self.engine is not None

    def _loaded(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("the model is not loaded")
        return self.engine

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._loaded().tokenizer

    @property
    def max_model_len(self) -> int:
        return self._loaded().max_model_len

    @property
    def quantization(self) -> str | None:
        """How the weights are held when not in the model dtype ("int8", a GGUF file's types)."""
        return self._loaded().model.quantization

    @property
    def speculative(self) -> dict | None:
        """Speculative decoding's method and settings (SpeculativeConfig.summary); None when off."""
        spec = self._loaded().model.speculative
        return spec.summary() if spec is not None else None

    @property
    def tasks(self) -> frozenset[str]:
        """What the model serves: "generate", "embed" or both (engine/pooling.py)."""
        return self._loaded().model.tasks

    @property
    def encoder(self) -> bool:
        """Whether the model is an encoder (models/bert.py), which can never be served to generate."""
        return self._loaded().model.encoder

    @property
    def hidden_size(self) -> int:
        """An embedding's length before `dimensions` truncates it."""
        return self._loaded().model.hidden_size

    @property
    def classifier(self):
        """A classification model's head (engine/classifier.py: its labels, their probabilities);
        None for any other model."""
        return self._loaded().model.classifier

    def join_pair(self, first: list[int], second: list[int],
                  max_tokens: int | None = None) -> tuple[list[int], int | None]:
        """A cross-encoder's input for two texts' ids, and where its second token type starts
        (Tokenizer.join_pair); RequestError without a tokenizer, when it is longer than the context
        without `max_tokens`, or when `max_tokens` leaves the texts no room."""
        tokenizer = self._pair_tokenizer()
        if max_tokens is None:
            self._check_pair_length(len(first) + len(second) + tokenizer.pair_overhead())
        return _bounded(tokenizer.join_pair, first, second, max_tokens)

    @property
    def templated_pairs(self) -> bool:
        """Whether a pair to score is rendered by the server's --chat-template (a query message and
        a document message), as vLLM renders one where a template is given."""
        return self._loaded().model.spec.chat_template is not None

    def pair_as_text(self, first: str, second: str, max_tokens: int | None = None,
                     template_kwargs: dict | None = None) -> list[int]:
        """An input for a pair of texts made from one text, as vLLM makes an LLM reranker's: the
        pair rendered by --chat-template where one is given, else the two texts joined; its ids
        with the special tokens of one text (Tokenizer.join_single). RequestError without a
        tokenizer, when it is longer than the context without `max_tokens`, when `max_tokens`
        leaves it no room, or when the template fails. `template_kwargs` reach the template.
        CPU-heavy."""
        from neuron.engine.llm_engine import RequestError
        from neuron.engine.tokenizer import TokenizerError

        tokenizer = self._pair_tokenizer()
        template = tokenizer.chat_template if self.templated_pairs else None
        try:
            ids = tokenizer.encode(pair_text(tokenizer, first, second, template, template_kwargs))
        except TokenizerError as exc:  # the template's failure on these texts
            raise RequestError(str(exc), param="input") from None
        if max_tokens is None:
            self._check_pair_length(len(ids) + tokenizer.single_overhead())
        return _bounded(tokenizer.join_single, ids, max_tokens)

    def cut_text(self, text: str, max_tokens: int) -> str:
        """`text` cut after its first `max_tokens` tokens, at the end of the last one kept (vLLM's
        max_tokens_per_query and max_tokens_per_doc); RequestError without a tokenizer. CPU-heavy."""
        return self._pair_tokenizer().cut(text, max_tokens)

    def _pair_tokenizer(self) -> "Tokenizer":
        """The tokenizer that makes a scored pair's input; RequestError without one."""
        from neuron.engine.llm_engine import RequestError

        tokenizer = self._loaded().tokenizer
        if tokenizer is None:
            raise RequestError("this checkpoint has no tokenizer.json: a pair of texts cannot be scored",
                               param="model")
        return tokenizer

    def _check_pair_length(self, n: int) -> None:
        """A pair of `n` tokens past the context, with no bound asked for, is refused."""
        from neuron.engine.llm_engine import RequestError

        if n > self.max_model_len:
            raise RequestError(f"this model's maximum context length is {self.max_model_len} tokens, but the pair "
                               f"has {n} tokens: shorten it, or send truncate_prompt_tokens",
                               code="context_length_exceeded", param="input")

    def validate_embedding(self, prompt_token_ids: list[int]) -> None:
        """Refuse an embedding input that cannot run (RequestError)."""
        self._loaded().inputs.admit_pooling(prompt_token_ids)

    @property
    def vocab_size(self) -> int:
        return self._loaded().vocab_size

    @property
    def vision(self) -> VisionSpec | None:
        """How the model takes images; None for a text-only model."""
        return self._loaded().model.vision

    def kernels(self) -> dict[str, str]:
        """What runs each fused kernel piece, and why a reference where one does."""
        return self._loaded().executor.kernels()

    def memory(self) -> list[dict[str, int]]:
        """Each rank's weight, KV cache and resident bytes (Executor.memory)."""
        return self._loaded().executor.memory()

    @property
    def model_path(self) -> str:
        """Where the model was loaded from: its GGUF file, else its folder."""
        model = self._loaded().model
        return str(model.gguf or model.model_dir)

    def default_sampling(self) -> dict:
        """generation_config.json's sampling defaults."""
        return self._loaded().model.default_sampling()

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A completion prompt's token ids (RequestError without a tokenizer). CPU-heavy."""
        from neuron.engine.llm_engine import encode_prompt

        return encode_prompt(self._loaded(), text, add_special_tokens)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 images: list[ImageInput] | None = None) -> int:
        """Refuse a request that cannot run (RequestError); its max_tokens clamped to the context."""
        return self._loaded().inputs.validate(prompt_token_ids, params, images)

    def truncated(self, prompt_token_ids: list[int], keep: int | None,
                  images: list[ImageInput] | None = None) -> list[int]:
        """The prompt's last `keep` tokens, vLLM's truncate_prompt_tokens (RequestError where it cannot)."""
        return self._loaded().inputs.truncated(prompt_token_ids, keep, images)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every token that ends a sequence (generation_config.json's and the tokenizer's)."""
        return self._loaded().inputs.eos_token_ids

    def check_images(self, uris: list, placeholders: int | None = None) -> list[ImageInput]:
        """Size, bound and decode a request's images (ImageError). CPU-heavy."""
        return self._loaded().inputs.check_images(uris, placeholders)

    def expand_images(self, prompt_token_ids: list[int], images: list[ImageInput]) -> list[int]:
        return self._loaded().inputs.expand_images(prompt_token_ids, images)

    @property
    def has_structured_output(self) -> bool:
        return self._loaded().structured is not None

    def compile_grammar(self, guided: GuidedDecodingParams) -> CompiledGrammar:
        """The request's grammar compiled (GrammarError), for `open` to take beside its params.
        CPU-heavy, and one at a time."""
        structured = self._loaded().structured
        if structured is None:
            raise RuntimeError("this model has no tokenizer, so no structured output: check has_structured_output")
        return structured.compile(guided)


def pair_text(tokenizer: "Tokenizer", first: str, second: str, template: str | None,
              template_kwargs: dict | None = None) -> str:
    """A scored pair as one text: rendered by `template` (Jinja: a `query` message, then a
    `document` one, as vLLM's score templates take them, with `template_kwargs` such as its
    `instruction`) where one is given, else by the tokenizer's pair_format (a GGUF reranker's, as
    llama-server fills it in; each placeholder once, the texts not searched again), else joined."""
    if template is None and tokenizer.pair_format is not None:
        texts = {"{query}": first, "{document}": second}
        return re.sub(r"\{query\}|\{document\}", lambda m: texts[m[0]], tokenizer.pair_format)
    if template is None:
        return first + second
    return tokenizer.apply_chat_template([{"role": "query", "content": first}, {"role": "document", "content": second}],
                                         add_generation_prompt=False, chat_template=template, **(template_kwargs or {}))


def _bounded(join, *args):
    """`join(*args)` (a Tokenizer's join_pair or join_single, whose last argument is the bound),
    its refusal of a bound that leaves no room as the request's RequestError."""
    from neuron.engine.llm_engine import RequestError
    from neuron.engine.tokenizer import TokenizerError

    try:
        return join(*args)
    except TokenizerError as exc:
        raise RequestError(str(exc), param="truncate_prompt_tokens") from None
