"""OpenAI error envelopes: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

import msgspec
from starlette.responses import Response


class APIError(Exception):
    """An error the client should see as-is; anything else that escapes a handler is a 500."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(msgspec.json.encode(self.body()), self.status, self.headers, media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def renamed(exc: APIError, names: dict[str, str], param_only: tuple[str, ...] = ()) -> APIError:
    """`exc`, raised by the chat path for a request translated from another API, naming that API's
    fields: `names` maps the chat path's fields to the request's. The longest that the param is or
    begins (`stop` holds for `stop[0]`, not `stop_token_ids`) renames the param and, unless it is in
    `param_only`, its first mention in the message (where the chat path's errors name the field;
    a later one may be the client's own text)."""
    param = exc.param or ""
    found = [c for c in names if param == c or param.startswith((c + ".", c + "["))]
    if not found:
        return exc
    chat_name = max(found, key=len)
    exc.param = names[chat_name] + param[len(chat_name):]
    if chat_name not in param_only:
        exc.message = exc.message.replace(chat_name, names[chat_name], 1)
    return exc


def unavailable(message: str, code: str, retry_after_s: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(503, message, type="server_error", code=code, headers=headers)


def internal(message: str, code: str = "internal_error") -> APIError:
    return APIError(500, message, type="server_error", code=code)


def generation_failed(error: str | None) -> APIError:
    """A request cut short by a failing rank: the server recovers by itself, so retrying helps."""
    return unavailable(f"generation failed: {error}", code="generation_failed", retry_after_s=5)
