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


def unavailable(message: str, code: str, retry_after_s: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return APIError(503, message, type="server_error", code=code, headers=headers)


def internal(message: str, code: str = "internal_error") -> APIError:
    return APIError(500, message, type="server_error", code=code)


def generation_failed(error: str | None) -> APIError:
    """A request cut short by a failing rank: the server recovers by itself, so retrying helps."""
    return unavailable(f"generation failed: {error}", code="generation_failed", retry_after_s=5)
