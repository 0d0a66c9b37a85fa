"""The OpenAI API's request and response bodies, as msgspec structs.

Requests ignore fields they do not know (clients send many optional ones); fields we know but do
not implement are refused with a 400 by the handlers rather than silently ignored.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

# ---- requests ----


class StreamOptions(Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries its choice's usage so far


class SamplingRequest(Struct, kw_only=True):
    """Fields the chat and completions endpoints share (vLLM's names for the extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    repetition_window: int | None = None  # neuron's: the repetition penalty over the last this many tokens
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # vLLM's; changes nothing with tokenizer.json (SamplingParams)
    include_stop_str_in_output: bool = False
    n: int | None = None
    best_of: int | None = None  # OpenAI's completions field; vLLM takes it on chat too
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    allowed_token_ids: list[int] | None = None  # vLLM's: the only tokens that may be sampled
    bad_words: list[str] | None = None  # vLLM's: words never written
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    # Structured output, one at most: OpenAI's response_format, vLLM's guided_* (and tool_choice on chat).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: requests share cached prompt prefixes only with requests of the same salt (checked and
    # combined with the server's --prefix-cache-isolation in common.request_salt)
    cache_salt: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last this many tokens (-1: all that fit)
    # vLLM's beam search (entrypoints/openai/beam.py): the n best of n beams
    use_beam_search: bool = False
    length_penalty: float = 1.0
    priority: int = 0  # vLLM's; scheduling is first come, first served, so other values are refused
    request_id: str | None = None  # vLLM's: the response's id is `chatcmpl-<request_id>` (`cmpl-` for completions)
    # vLLM's extensions neuron does not implement: named here so that setting one is a 400, not ignored
    structural_tag: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None
    logits_processors: Any = None
    mm_processor_kwargs: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None  # arguments for vLLM's custom logits processors, which neuron has none of


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI has it
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: refused, as vLLM refuses it unless told to trust it
    # vLLM's: the template's turn for the reply, or the reply continuing the last (assistant) message,
    # whose text `echo` puts before the reply's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs, on the response
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens too, beyond the template's
    documents: list[dict[str, Any]] | None = None  # vLLM's: for templates that render retrieved documents


class CompletionRequest(SamplingRequest, kw_only=True):
    prompt: Any  # a string, token ids, or a list of either (several prompts)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's extension: the prompt tokens' logprobs on the choice
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (Llama's, Mistral's) before a text prompt


# ---- responses ----


class UsageInfo(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob]


class FunctionCall(Struct):
    name: str
    arguments: str


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(Struct, omit_defaults=True):
    """`tool_calls` is left out when there are none, as OpenAI does."""

    role: str
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Struct):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatChoiceWithIds(ChatChoice):
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the choice's tokens


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    prompt_logprobs: list[dict[str, dict] | None] | None = None  # vLLM's, when the request asked


class ChatCompletionResponseWithIds(ChatCompletionResponse):
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids


class DeltaFunctionCall(Struct, omit_defaults=True):
    """A call's name opens it; later deltas of the same call bring more of its arguments only."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """The first delta of a call carries its id and type; later ones only its index."""

    index: int
    function: DeltaFunctionCall
    id: str | None = None
    type: str | None = None


class DeltaMessage(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatChunkChoiceWithIds(ChatChunkChoice):
    token_ids: list[int] | None = None  # vLLM's return_token_ids: this chunk's tokens


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    object: str = "chat.completion.chunk"


class ChatCompletionChunkWithIds(ChatCompletionChunk):
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: on a stream's first chunk


class CompletionLogprobs(Struct):
    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)  # None: an echoed first prompt token
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, dict] | None] | None = None  # vLLM's, when the request asked


class CompletionChoiceWithIds(CompletionChoice):
    """A choice with vLLM's return_token_ids: the prompt's ids (a stream's first chunk of it) and
    the choice's own (a chunk's)."""

    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None
    object: str = "text_completion"


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int | None
    quantization: str | None = None  # how the weights are held, when not in the model dtype
    owned_by: str = "neuron"
    object: str = "model"
    # the host's view: available, loading, ready, recovering, failed (with `error`) or unloading
    status: str = "ready"
    tp: int = 1
    devices: list[str] = []
    weight_bytes: int | None = None  # every rank's together, once loaded
    error: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    root: str | None = None  # a LoRA adapter's folder


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


# ---- vLLM's /tokenize and /detokenize ----


class TokenizeRequest(Struct, kw_only=True):
    """Either `prompt` (text, as /v1/completions tokenizes it) or `messages` (a chat through the
    template); or llama-server's `content`, with its `add_special`, `parse_special` and `with_pieces`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: a prompt as /v1/completions reads it (the tokenizer's special tokens: true), a chat
    # through its template alone (false)
    add_special_tokens: bool | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    content: str | None = None
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class TokenizeResponse(Struct, omit_defaults=True):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(Struct):
    prompt: str
    content: str  # the same text under llama-server's name


# ---- /v1/embeddings ----


class EmbeddingRequest(Struct, kw_only=True):
    """OpenAI's embeddings request: `input` a string, a list of strings, token ids, or a list of
    token-id lists; `dimensions` keeps the first values of each vector (Matryoshka)."""

    input: Any
    model: str | None = None
    encoding_format: str = "float"  # or "base64": little-endian float32, as OpenAI sends it
    dimensions: int | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    cache_salt: str | None = None  # as on completions: which requests may share cached prefixes
    truncate_prompt_tokens: int | None = None  # as on completions: embed each input's last this many tokens
    use_activation: bool | None = None  # vLLM's: false, each vector as pooled, not normalized


class EmbeddingData(Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Struct):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
    object: str = "list"
