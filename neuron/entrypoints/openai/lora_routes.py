"""vLLM's routes for LoRA adapters at run time, for its clients:

    POST /v1/load_lora_adapter     {"lora_name": ..., "lora_path": ..., "base_model_name": optional}
    POST /v1/unload_lora_adapter   {"lora_name": ...}

Served only with --allow-runtime-lora-updating (as vLLM's need VLLM_ALLOW_RUNTIME_LORA_UPDATING):
with them any client of the API may load adapters from this machine's paths; the admin API's
`POST /admin/models {"name", "lora", "base"}` does the same behind the admin key.
A loaded adapter is served as a model named `lora_name` (its `parent` in /v1/models is the base).
Both answer 200 with a line of text, as vLLM's do; a bad adapter gets 400 naming why, an unknown
name 404, a name already served 409. Unloading cancels the adapter's requests in flight with an
error (finish_reason `error`), cleanly; the admin API's DELETE takes `?drain=SECONDS` first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from msgspec import Struct
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from neuron.entrypoints.openai.admin import host_error
from neuron.entrypoints.openai.api_errors import bad_request
from neuron.errors import NeuronError

if TYPE_CHECKING:
    from neuron.engine.host import ModelHost


class LoadLoraRequest(Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None  # neuron's: which model, where several serve adapters
    load_inplace: bool = False  # vLLM's: replace an adapter of the same name (neuron: unload it first)


class UnloadLoraRequest(Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's clients may send it; names are what neuron keys on


def lora_routes(host: ModelHost, endpoint: Callable, decode: Callable) -> list[Route]:
    async def load(request: Request) -> Response:
        req = await decode(request, LoadLoraRequest)
        if req.load_inplace:
            raise bad_request("load_inplace is not supported: unload the adapter first, then load it",
                              param="load_inplace")
        try:
            await host.load_lora(req.lora_name, req.lora_path, req.base_model_name)
        except NeuronError as exc:
            raise host_error(exc, param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload(request: Request) -> Response:
        req = await decode(request, UnloadLoraRequest)
        try:
            await host.unload_lora(req.lora_name)
        except NeuronError as exc:
            raise host_error(exc, param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return [Route("/v1/load_lora_adapter", endpoint("load_lora_adapter", load), methods=["POST"]),
            Route("/v1/unload_lora_adapter", endpoint("unload_lora_adapter", unload), methods=["POST"])]
