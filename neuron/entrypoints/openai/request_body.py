"""A request's body as the routes read it: declared JSON, and no larger than a limit, refused as
soon as either is known."""

from __future__ import annotations

from starlette.requests import Request

from neuron.entrypoints.openai.api_errors import APIError, bad_request


def require_json(request: Request) -> None:
    """415 unless the body is declared JSON. A browser page may send text/plain or form bodies to any
    origin without asking first (a CORS "simple" request), but never `application/json`. A body that
    is not JSON at all is a 400 before this, whatever its type says."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = repr(media_type) if media_type else "none"
        raise APIError(415, f"the request body must be sent as Content-Type: application/json, not {shown}",
                       code="unsupported_media_type")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with a 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request(f"invalid Content-Length header {declared!r}")
        if int(declared) > limit:
            raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")
