"""POST /tokenize and /detokenize, in vLLM's shapes: the token ids the server makes of a prompt or a
chat (as /v1/completions and /v1/chat/completions would), and the text of token ids; and in
llama-server's (`content` in, `tokens` out; the text out as `content` too). Tokenizing
and decoding run in worker threads, a few at a time (prompt_input), so the event loop stays free.
GET /tokenizer_info, vLLM's too: the tokenizer's configuration, which lm-eval's remote tokenizer
reads beside the other two."""

from __future__ import annotations

import anyio
import msgspec
from starlette.responses import Response

from neuron.engine.async_engine import AsyncEngine
from neuron.engine.tokenizer import TokenizerError
from neuron.entrypoints.openai.api_errors import bad_request, unsupported
from neuron.entrypoints.openai.api_types import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from neuron.entrypoints.openai.chat_utils import check_template_kwargs, normalise_messages
from neuron.entrypoints.openai.common import check_ready
from neuron.entrypoints.openai.guided import function_tools
from neuron.entrypoints.openai.prompt_input import check_prompt_chars, check_vocabulary, off_loop


async def tokenize(engine: AsyncEngine, req: TokenizeRequest, limiter: anyio.CapacityLimiter) -> Response:
    if req.content is not None:
        return await _llamacpp_tokenize(engine, req, limiter)
    _check(engine, req.model, "prompt" if req.messages is None else "messages")
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of prompt (text) and messages (a chat)", param="prompt")
    check_template_kwargs(req.chat_template_kwargs)
    if req.tools:
        function_tools(req.tools)
    ids = await off_loop(limiter, _token_ids, engine, req)
    strs = [engine.tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
    return _json(TokenizeResponse(ids, len(ids), engine.max_model_len, strs))


async def _llamacpp_tokenize(engine: AsyncEngine, req: TokenizeRequest, limiter: anyio.CapacityLimiter) -> Response:
    """llama-server's shape: `{"tokens": [ids]}`, or with `with_pieces` each id with its piece (its
    text, or its bytes where they are not whole UTF-8)."""
    _check(engine, req.model, "content")
    if req.prompt is not None or req.messages is not None:
        raise bad_request("send content (llama-server's field) or prompt or messages, not both", param="content")
    if not req.parse_special:
        raise unsupported("parse_special", "parse_special false is not supported: special tokens written in the "
                                           "text are always read as those tokens")
    check_prompt_chars(engine, len(req.content), "content")
    tok = engine.tokenizer
    ids = await off_loop(limiter, lambda: tok.encode(req.content, add_special_tokens=req.add_special))
    if not req.with_pieces:
        return _json({"tokens": ids})
    return _json({"tokens": [{"id": t, "piece": _piece(tok.token_bytes(t))} for t in ids]})


def _piece(raw: bytes) -> str | list[int]:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return list(raw)


def _token_ids(engine, req: TokenizeRequest) -> list[int]:
    """The ids the request's prompt runs as: a text prompt as /v1/completions encodes it (with the
    special tokens its tokenizer adds, unless add_special_tokens is false), a chat as its template
    renders it (and the tokenizer's special tokens only with add_special_tokens true), as vLLM's."""
    if req.messages is None:
        return engine.encode_prompt(req.prompt, req.add_special_tokens is not False)
    text = rendered_chat(engine, req.messages, req.add_generation_prompt, req.continue_final_message, req.tools,
                         req.chat_template_kwargs)
    return engine.tokenizer.encode(text, add_special_tokens=req.add_special_tokens is True)


def rendered_chat(engine, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                  tools: list[dict] | None, template_kwargs: dict | None) -> str:
    """A chat of text as the model's template renders it (images are refused: this counts text).
    CPU-heavy: run it off the event loop."""
    if engine.tokenizer is None:
        raise bad_request("this checkpoint has no tokenizer.json, so the server cannot render a chat",
                          param="messages")
    messages, images = normalise_messages(messages, vision=engine.vision is not None)
    if images:
        raise bad_request("a chat rendered without generating holds text only; leave the images out of the messages",
                          param="messages")
    try:
        return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                    continue_final_message=continue_final_message, tools=tools,
                                                    **(template_kwargs or {}))
    except TokenizerError as exc:
        raise bad_request(str(exc), param="messages") from None


async def detokenize(engine: AsyncEngine, req: DetokenizeRequest, limiter: anyio.CapacityLimiter) -> Response:
    _check(engine, req.model, "tokens")
    check_vocabulary(engine, req.tokens, "tokens")
    text = await off_loop(limiter, lambda: engine.tokenizer.decode(req.tokens, skip_special_tokens=False))
    return _json(DetokenizeResponse(text, text))


# Always present, null where the checkpoint names none: clients test for the key (lm-eval, eos_token).
_ALWAYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def tokenizer_info(engine: AsyncEngine) -> Response:
    """The tokenizer's configuration as tokenizer_config.json holds it (vLLM's TokenizerInfo): its
    named special tokens, chat template and added tokens, with `model_max_length` the context this
    server serves the model with."""
    _check(engine, None, "model")
    tok = engine.tokenizer
    named = tok.named_tokens
    body = {"tokenizer_class": "PreTrainedTokenizerFast", **{k: named.get(k) for k in _ALWAYS}, **named,
            "chat_template": tok.chat_template, "model_max_length": engine.max_model_len,
            "added_tokens_decoder": tok.added_tokens_decoder()}
    return _json(body)


def _check(engine: AsyncEngine, model: str | None, param: str) -> None:
    """Refuse unless the model is ready and its checkpoint has a tokenizer (which model: the one the
    request names, routed by the app, or the server's one model when it names none, as vLLM allows)."""
    check_ready(engine)
    if engine.tokenizer is None:
        raise bad_request("this checkpoint has no tokenizer.json, so the server cannot tokenize", param=param)


def _json(body) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")
