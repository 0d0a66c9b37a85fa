"""The admin API of a model host: load, unload and list models while the server runs.

On only with `--admin-key` (its paths are unknown, 404, without one), each call checked as a bearer
token apart from `--api-key`:

    GET    /admin/models                      every model: state, devices, memory held, requests in flight, last use
    POST   /admin/models                      a spec (as a --models entry; "wait": false answers 202 at once),
                                              or a LoRA adapter: {"name", "lora": its folder, "base": a model,
                                              "keep_alive": idle seconds before it is unloaded (default: kept)}
    DELETE /admin/models/{name}?drain=SECONDS unload, letting in-flight requests finish for up to that long

A load answers 201 once the model is ready; 409 for a name already served or devices another
model holds, 507 when it does not fit (with the sizes), 400 for a spec or checkpoint that cannot
run, each before any worker starts where it can be known.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from neuron.engine.host import HostError, ModelSpec
from neuron.entrypoints.openai.api_errors import APIError, bad_request, unavailable
from neuron.entrypoints.openai.request_body import read_body, require_json
from neuron.errors import NeuronError

if TYPE_CHECKING:
    from neuron.engine.host import ModelHost

_MAX_SPEC_BYTES = 1 << 20
_MAX_DRAIN_S = 3600.0


def host_error(exc: NeuronError, param: str | None = None) -> APIError:
    """A host's refusal as the API answers it (its `status` and `code`; 400 for a checkpoint or
    spec that cannot run)."""
    status, code = getattr(exc, "status", 400), getattr(exc, "code", "invalid_request")
    if status == 503:
        return unavailable(str(exc), code, retry_after_s=5)
    return APIError(status, str(exc), param=param if status == 404 else None, code=code)


def admin_routes(host: ModelHost, key: str, endpoint: Callable) -> list[Route]:
    admin = _Admin(host, key)
    auth = admin.authenticate
    return [Route("/admin/models", endpoint("admin", admin.list, auth), methods=["GET"]),
            Route("/admin/models", endpoint("admin", admin.load, auth), methods=["POST"]),
            Route("/admin/models/{name:str}", endpoint("admin", admin.unload, auth), methods=["DELETE"])]


class _Admin:
    def __init__(self, host: ModelHost, key: str):
        self.host, self.key = host, key.encode()

    def authenticate(self, request: Request) -> None:
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else None
        if token is None or not hmac.compare_digest(token.encode("latin-1"), self.key):
            raise APIError(401, "missing or invalid admin key: send `Authorization: Bearer <admin key>`",
                           type="authentication_error", code="invalid_admin_key", headers={"WWW-Authenticate": "Bearer"})

    async def list(self, request: Request) -> Response:
        now = time.monotonic()
        data = []
        for name, m in self.host.models.items():
            info = m.describe()
            info.update(name=name, in_flight=m.in_flight, idle_s=round(now - m.last_used, 3),
                        memory=self.host.ledger.held.get(name, {}))
            data.append(info)
        data += [{"name": name, "status": "ready", "lora": path, "base": base} for name, base, path in
                 self.host.adapters()]
        return JSONResponse({"object": "list", "data": data})

    async def load(self, request: Request) -> Response:
        body = await _body(request)
        if not isinstance(body, dict):
            raise bad_request("the body must be a model spec: a JSON object")
        if "lora" in body:
            return await self._load_lora(body)
        wait = body.pop("wait", True)
        if not isinstance(wait, bool):
            raise bad_request("wait must be true or false", param="wait")
        try:
            spec = ModelSpec.parse(body, self.host.defaults, "model spec")
            m = await self.host.load(spec, wait=wait)
        except NeuronError as exc:
            raise host_error(exc) from None
        return JSONResponse({"name": m.name, **m.describe()}, 201 if wait else 202)

    async def _load_lora(self, body: dict) -> Response:
        unknown = sorted(set(body) - {"name", "lora", "base", "keep_alive"})
        if unknown:
            raise bad_request(f"unknown key(s) {', '.join(map(repr, unknown))}; a LoRA adapter takes name, lora, "
                              "base and keep_alive")
        keep_alive = body.get("keep_alive")
        if keep_alive is not None and (isinstance(keep_alive, bool) or not isinstance(keep_alive, (int, float))
                                       or not 0 <= keep_alive <= 1e9):
            raise bad_request(f"keep_alive must be seconds (0 or more), got {keep_alive!r:.80}", param="keep_alive")
        base = body.get("base")
        if base is not None and not isinstance(base, str):
            raise bad_request("base must be the name of a served model", param="base")
        try:
            m = await self.host.load_lora(body.get("name"), body.get("lora"), base, keep_alive)
        except NeuronError as exc:
            raise host_error(exc) from None
        return JSONResponse({"name": body["name"], "status": "ready", "lora": body["lora"], "base": m.name}, 201)

    async def unload(self, request: Request) -> Response:
        name = request.path_params["name"]
        drain = request.query_params.get("drain", "0")
        try:
            drain_s = float(drain)
        except ValueError:
            raise bad_request(f"drain must be seconds, got {drain!r:.40}", param="drain") from None
        if not 0 <= drain_s <= _MAX_DRAIN_S:
            raise bad_request(f"drain must be in 0..{_MAX_DRAIN_S:g} seconds, got {drain_s:g}", param="drain")
        try:
            await self.host.unload(name, drain_s)
        except HostError as exc:
            raise host_error(exc) from None
        return JSONResponse({"name": name, "status": "unloaded"})


async def _body(request: Request) -> Any:
    data = await read_body(request, _MAX_SPEC_BYTES)
    require_json(request)
    try:
        return msgspec.json.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
