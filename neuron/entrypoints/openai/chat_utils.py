"""Chat messages in: OpenAI messages validated and shaped for a chat template.

What comes out (reasoning, content, tool calls) is parsed by the engine's output processor.
"""

from __future__ import annotations

from neuron.entrypoints.openai.api_errors import APIError, bad_request

_ROLES = ("system", "user", "assistant", "tool")
# What the server sets itself when it renders a template, so no request's chat_template_kwargs may:
# the messages and their framing, and the template (a request's own is code the server would run).
_TEMPLATE_ARGS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                            "chat_template"})


def check_template_kwargs(kwargs: dict | None) -> None:
    """A 400 for chat_template_kwargs that set what the server sets itself (_TEMPLATE_ARGS)."""
    reserved = _TEMPLATE_ARGS & set(kwargs or ())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
                          param="chat_template_kwargs")
_IMAGE_PARTS = ("image_url", "input_image", "image")


def normalise_messages(messages: list[dict], vision: bool = False) -> tuple[list[dict], list[str]]:
    """Validate OpenAI chat messages and shape them for a chat template. Returns the messages and
    the URLs of their images in order of appearance; without `vision`, an image is a 400."""
    if not messages:
        raise bad_request("messages must contain at least one message", param="messages")
    images: list[str] | None = [] if vision else None
    out = [_message(m, i, images) for i, m in enumerate(messages)]
    return out, images or []


def _message(m: dict, i: int, images: list[str] | None) -> dict:
    where = f"messages[{i}]"
    role = m.get("role")
    if role == "developer":  # OpenAI's newer name for the system turn
        role = "system"
    if role not in _ROLES:
        raise bad_request(f"{where}.role must be one of system, developer, user, assistant, tool; got {role!r}",
                          param=f"{where}.role")
    if m.get("content") is None and not (role == "assistant" and m.get("tool_calls")):
        raise bad_request(f"{where}.content must be a string or a list of content parts; only an assistant "
                          "message with tool_calls may leave it null", param=f"{where}.content")
    out = {**m, "role": role, "content": _content(m.get("content"), f"{where}.content", images)}
    if role == "assistant" and out.get("tool_calls") is not None and not isinstance(out["tool_calls"], list):
        raise bad_request(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    return out


def template_content_chars(messages: list[dict]) -> int:
    """Characters of text in the messages' contents, which chat templates render in full: a lower
    bound on the rendered prompt's length, known before rendering it. Assistant turns are left out,
    since a template may drop part of one (Qwen3's drops the reasoning of earlier turns); the
    rendered prompt is measured again before it is tokenized."""
    total = 0
    for m in messages:
        content = m.get("content") if m.get("role") != "assistant" else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total


def message_text(content) -> str:
    """A message's text: a string as it is, text parts joined by newlines (as `_content` joins them)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _content(content, where: str, images: list[str] | None) -> str | list[dict] | None:
    """A string, null, or a list of parts. Text parts alone are joined by newlines (templates expect
    a string); with images the list stays, as `{"type": "text"}` and `{"type": "image"}` parts,
    which Qwen-style templates render as text and image placeholders."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", param=where)
    parts = [_part(part, f"{where}[{j}]", images) for j, part in enumerate(content)]
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _part(part, where: str, images: list[str] | None) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _IMAGE_PARTS:
        if images is None:
            raise APIError(400, "this model does not accept images; send text content only", param=where,
                           code="vision_unsupported")
        images.append(_image_url(part, where))
        return {"type": "image"}
    if kind != "text" or not isinstance(part.get("text"), str):
        also = "" if images is None else " or an image part (type image_url)"
        raise bad_request(f"{where} must be a text part {{\"type\": \"text\", \"text\": ...}}{also}", param=where)
    return {"type": "text", "text": part["text"]}


def _image_url(part: dict, where: str) -> str:
    """`{"image_url": {"url": ...}}` (chat completions) or `{"image_url": "..."}` (input_image)."""
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where} needs an image URL: {{\"type\": \"image_url\", \"image_url\": {{\"url\": "
                          "\"data:image/png;base64,...\"}}", param=f"{where}.image_url")
    return url
