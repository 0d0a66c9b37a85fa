"""OpenAI's Responses API: request and response bodies and stream events, as msgspec structs.

Requests ignore fields they do not know; the items of `input` and `tools` are checked one by one
where they are translated (serving_responses.py), so that each refusal names the item it is about.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

# ---- requests ----


class ReasoningConfig(Struct, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None  # neuron returns the reasoning itself, never a summary of it


class TextConfig(Struct, kw_only=True):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(Struct, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    # Known and not served: refused by name rather than ignored.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
    # neuron's, with the names the chat route gives them (vLLM's)
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None


# ---- responses ----


class OutputText(Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(Struct, tag="reasoning_text", tag_field="type"):
    text: str


class MessageItem(Struct, tag="message", tag_field="type", kw_only=True):
    id: str
    status: str
    role: str = "assistant"
    content: list[OutputText] = []


class ReasoningItem(Struct, tag="reasoning", tag_field="type", kw_only=True):
    """The model's reasoning as it wrote it (`content`); neuron writes no summaries."""

    id: str
    status: str
    summary: list[Any] = []
    content: list[ReasoningText] = []


class FunctionCallItem(Struct, tag="function_call", tag_field="type", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


OutputItem = MessageItem | ReasoningItem | FunctionCallItem


class InputTokensDetails(Struct):
    cached_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct):
    reason: str


class ResponseError(Struct):
    code: str
    message: str


class ResponseObject(Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    completed_at: int | None = None
    instructions: str | None
    max_output_tokens: int | None
    previous_response_id: str | None
    parallel_tool_calls: bool
    reasoning: dict[str, Any]
    store: bool
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: str = "disabled"
    metadata: dict[str, str] = {}
    user: str | None = None
    background: bool = False
    object: str = "response"


class DeletedResponse(Struct):
    id: str
    object: str = "response.deleted"
    deleted: bool = True


# ---- stream events: `type` names the event, `sequence_number` counts them from 0 ----


class LifecycleEvent(Struct):
    """response.created, .in_progress, .completed, .incomplete and .failed."""

    type: str
    response: ResponseObject
    sequence_number: int = 0


class OutputItemEvent(Struct):
    """response.output_item.added and .done."""

    type: str
    output_index: int
    item: OutputItem
    sequence_number: int = 0


class ContentPartEvent(Struct):
    """response.content_part.added and .done."""

    type: str
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText
    sequence_number: int = 0


class OutputTextDelta(Struct):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []
    type: str = "response.output_text.delta"
    sequence_number: int = 0


class OutputTextDone(Struct):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []
    type: str = "response.output_text.done"
    sequence_number: int = 0


class ReasoningTextDelta(Struct):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    type: str = "response.reasoning_text.delta"
    sequence_number: int = 0


class ReasoningTextDone(Struct):
    item_id: str
    output_index: int
    content_index: int
    text: str
    type: str = "response.reasoning_text.done"
    sequence_number: int = 0


class ArgumentsDeltaEvent(Struct):
    item_id: str
    output_index: int
    delta: str
    type: str = "response.function_call_arguments.delta"
    sequence_number: int = 0


class ArgumentsDoneEvent(Struct):
    item_id: str
    output_index: int
    name: str
    arguments: str
    type: str = "response.function_call_arguments.done"
    sequence_number: int = 0


class ErrorEvent(Struct):
    code: str | None
    message: str
    param: str | None
    type: str = "error"
    sequence_number: int = 0
