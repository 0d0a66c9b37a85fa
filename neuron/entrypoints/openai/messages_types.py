"""Anthropic's Messages API: request and response bodies and stream events, as msgspec structs.

Requests ignore fields they do not know; the blocks inside `system`, `messages` and `tools` are
checked one by one where they are translated (serving_messages.py), so that each refusal names
the block it is about.
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct

# ---- requests ----


class CountTokensRequest(Struct, kw_only=True):
    """POST /v1/messages/count_tokens: a message request without what only generation needs."""

    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    # Known and not served: refused by name rather than ignored.
    mcp_servers: list[Any] | None = None
    container: Any = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its `format` (a JSON schema) through structured output
    stream: bool = False
    # neuron's, as on the OpenAI routes: a sampling seed, and cached prompt prefixes shared only
    # between requests of the same salt
    seed: int | None = None
    cache_salt: str | None = None


# ---- responses ----


class TextBlock(Struct, tag="text", tag_field="type"):
    text: str


class ThinkingBlock(Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""  # the model's reasoning is not signed: a client sends it back as it came


class ToolUseBlock(Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class Usage(Struct):
    input_tokens: int
    output_tokens: int


class Message(Struct, tag="message", tag_field="type"):
    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    role: str = "assistant"


class TokenCount(Struct):
    input_tokens: int


# ---- stream events (each sent as `event: <type>` with itself as the data) ----


class TextDelta(Struct, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class InputJsonDelta(Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


class MessageStart(Struct, tag="message_start", tag_field="type"):
    message: Message


class ContentBlockStart(Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: ContentBlock


class ContentBlockDelta(Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(Struct, tag="content_block_stop", tag_field="type"):
    index: int


class StopDelta(Struct):
    stop_reason: str | None
    stop_sequence: str | None


class OutputUsage(Struct):
    output_tokens: int


class MessageDelta(Struct, tag="message_delta", tag_field="type"):
    delta: StopDelta
    usage: OutputUsage


class MessageStop(Struct, tag="message_stop", tag_field="type"):
    pass


class Ping(Struct, tag="ping", tag_field="type"):
    pass
