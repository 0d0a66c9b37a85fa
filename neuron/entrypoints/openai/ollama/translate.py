"""An Ollama chat or templated generate as the chat path's request (`ChatCompletionRequest`): the
same messages, tools, sampling, structured output and reasoning switch, in its names; and the
chat path's errors renamed back into the Ollama request's."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from neuron.engine.async_engine import AsyncEngine
from neuron.entrypoints.openai.api_errors import APIError, bad_request, renamed, unsupported
from neuron.entrypoints.openai.api_types import ChatCompletionRequest
from neuron.entrypoints.openai.chat_utils import message_text
from neuron.entrypoints.openai.common import check_ready
from neuron.entrypoints.openai.ollama.protocol import OllamaGenerateRequest, OllamaRequest, Options
from neuron.entrypoints.openai.response_parser import THINK_CLOSE, THINK_OPEN, tool_format

_THINK_LEVELS = ("low", "medium", "high")
# The engine's names for what Ollama's requests call otherwise, for the errors the chat path raises.
_OLLAMA_NAMES = {"temperature": "options.temperature", "top_p": "options.top_p", "top_k": "options.top_k",
                 "min_p": "options.min_p", "seed": "options.seed", "stop": "options.stop",
                 "repetition_penalty": "options.repeat_penalty", "repetition_window": "options.repeat_last_n",
                 "presence_penalty": "options.presence_penalty",
                 "frequency_penalty": "options.frequency_penalty", "max_tokens": "options.num_predict",
                 "response_format": "format", "response_format.json_schema.schema": "format",
                 "chat_template_kwargs": "think"}


def check_generate(req: OllamaGenerateRequest) -> None:
    if req.suffix and req.raw:
        raise bad_request("suffix needs the model's fill-in-the-middle format, which raw leaves out; send raw false",
                          param="suffix")
    if req.suffix and req.images:
        raise bad_request("suffix (fill in the middle) takes text alone; leave the images out", param="images")
    if req.template:
        raise unsupported("template", "template is not supported: neuron renders the checkpoint's own chat template "
                                      "(Jinja); send raw true with a prompt you rendered yourself")
    if req.context:
        raise unsupported("context", "context (deprecated by Ollama) is not supported: send the conversation to "
                                     "/api/chat as messages")


def prompt_messages(req: OllamaGenerateRequest) -> list[dict]:
    """A templated generate is a chat of one user turn, after the system prompt when it has one."""
    user = {"role": "user", "content": req.prompt}
    if req.images:
        user["images"] = req.images
    return ([{"role": "system", "content": req.system}] if req.system else []) + [user]


def chat_request(name: str, req: OllamaRequest, engine: AsyncEngine,
                 messages: list | None = None) -> ChatCompletionRequest:
    """The chat path's request for an Ollama chat (or templated generate): the same messages, tools,
    sampling, structured output and reasoning switch, in its names. A final assistant message of
    text is continued, as Ollama does: the reply goes on from it (a prefill)."""
    check_ready(engine)
    tools = getattr(req, "tools", None) or None
    if tools and engine.tokenizer is not None and tool_format(engine.tokenizer) is None:
        raise bad_request("this model's chat template shows no tool-call format neuron reads (Qwen's <tool_call> "
                          "tags, Llama 3.1's JSON or Mistral's [TOOL_CALLS]), so it cannot take tools", param="tools")
    kwargs = _think(req, engine)
    turns = [_message(m, i) for i, m in enumerate(messages or req.messages)]
    prefill = bool(turns) and _continues(turns[-1])
    return ChatCompletionRequest(
        model=name, messages=turns, tools=tools, logprobs=req.logprobs, top_logprobs=req.top_logprobs,
        response_format=response_format(req.format), chat_template_kwargs=kwargs,
        add_generation_prompt=not prefill, continue_final_message=prefill, **sampling_fields(req))


def _continues(turn: dict) -> bool:
    """Whether the chat's last turn is one the reply continues: an assistant's text, calling no tool."""
    return (turn.get("role") == "assistant" and not turn.get("tool_calls")
            and bool(message_text(turn.get("content")).strip()))


def _message(m: Any, i: int) -> dict:
    """An Ollama message as the chat path takes it: images become image parts (data: URIs), tool
    calls the OpenAI shape with their arguments left as objects (chat templates take either), and
    a tool result's `tool_name` its `name` too."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where} must be an object with a role and content", param=where)
    out = {k: v for k, v in m.items() if k not in ("images", "tool_calls")}
    if out.get("content") is None:  # Ollama's messages may leave it out (a turn that only calls tools)
        out["content"] = ""
    if m.get("tool_name") is not None:
        out.setdefault("name", m["tool_name"])
    images = m.get("images")
    if images:
        if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
            raise bad_request(f"{where}.images must be a list of base64 strings", param=f"{where}.images")
        if not isinstance(out["content"], str):
            raise bad_request(f"{where}.content must be a string", param=f"{where}.content")
        parts = [{"type": "image_url", "image_url": {"url": _data_uri(x)}} for x in images]
        out["content"] = parts + [{"type": "text", "text": out["content"]}]
    if m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(m["tool_calls"], where)
    return out


def _data_uri(image: str) -> str:
    return image if image.startswith("data:") else f"data:image/*;base64,{image}"


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f'{where}.tool_calls[{j}] must be {{"function": {{"name": ..., "arguments": {{...}}}}}}',
                              param=f"{where}.tool_calls[{j}]")
        out.append({"id": call.get("id") or f"call_{j}", "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", {})}})
    return out


def response_format(fmt: str | dict | None) -> dict | None:
    """`format`: "json" (any JSON object) or a JSON schema, as the chat path's response_format."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise bad_request(f'format must be "json" or a JSON schema object, got {fmt!r:.40}', param="format")


def _think(req: OllamaRequest, engine: AsyncEngine) -> dict | None:
    """`think` as the chat template's reasoning switch (`enable_thinking`, and gpt-oss's
    `reasoning_effort` for a level); a model that cannot think is refused it, as Ollama refuses."""
    think = req.think
    if think is None:
        return None
    if isinstance(think, str) and think not in _THINK_LEVELS:
        raise bad_request(f"think must be true, false, or one of {', '.join(_THINK_LEVELS)}, got {think!r:.40}",
                          param="think")
    tok = engine.tokenizer
    if think and (tok is None or tok.token_to_id(THINK_OPEN) is None or tok.token_to_id(THINK_CLOSE) is None):
        raise bad_request(f'"{engine.model_name}" does not support thinking', param="think")
    if isinstance(think, str):
        return {"enable_thinking": True, "reasoning_effort": think}
    return {"enable_thinking": think}


def sampling_fields(req: OllamaRequest) -> dict:
    """The options as the OpenAI request's fields; those neuron cannot honour are refused by name."""
    o = req.options or Options()
    for name, off in (("mirostat", 0), ("tfs_z", 1.0), ("typical_p", 1.0)):
        if getattr(o, name) not in (None, off):
            raise unsupported(f"options.{name}", f"options.{name} is not supported (neuron samples with "
                                                 f"temperature, top_k, top_p and min_p); leave it at {off}")
    penalty, window = repetition(o.repeat_penalty, o.repeat_last_n, "options.repeat_last_n")
    if o.num_predict is not None and not (o.num_predict >= 1 or o.num_predict in (-1, -2)):
        raise bad_request(f"options.num_predict must be >= 1, or -1 for no limit, got {o.num_predict}",
                          param="options.num_predict")
    max_tokens = o.num_predict if o.num_predict is not None and o.num_predict > 0 else None
    return dict(temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, min_p=o.min_p, seed=o.seed, stop=o.stop,
                repetition_penalty=penalty, repetition_window=window, presence_penalty=o.presence_penalty,
                frequency_penalty=o.frequency_penalty, max_tokens=max_tokens, stream=req.stream)


# Ollama's and llama-server's window for the repetition penalty when a request names none.
DEFAULT_REPEAT_LAST_N = 64


def repetition(penalty: float | None, last_n: int | None, param: str) -> tuple[float | None, int | None]:
    """Ollama's and llama-server's repeat_penalty and repeat_last_n as the repetition penalty and its
    window: the last 64 tokens unless given, -1 all of them, 0 no penalty."""
    if last_n == 0:
        return None, None
    if last_n is not None and last_n < -1:
        raise bad_request(f"{param} must be -1 (the whole context), 0 (no penalty) or > 0, got {last_n}", param=param)
    return penalty, DEFAULT_REPEAT_LAST_N if last_n is None else None if last_n == -1 else last_n


async def opened(opening: Awaitable):
    """The chat path's opening, its errors naming the Ollama request's fields."""
    try:
        return await opening
    except APIError as exc:
        raise in_ollama_names(exc) from None


def in_ollama_names(exc: APIError) -> APIError:
    """An error of the chat or completions path, naming the Ollama request's fields."""
    return renamed(exc, _OLLAMA_NAMES)
