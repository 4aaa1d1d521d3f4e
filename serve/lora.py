"""vLLM's routes that load and unload LoRA adapters while the server runs:
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``, there
only where ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true (vLLM's switch), as
anyone who may call them can change what every client's model name means.

Owns the two request bodies and the handlers: the engine reads and checks
the adapter on its own loop (``LLMEngine.add_lora``), and only once it took
it does the name reach ``ModelInfo.lora_modules``, which requests and
``/v1/models`` read."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import Field, StrictInt, StrictStr

from fluidserve.serve.errors import APIError
from fluidserve.serve.protocol import _Request

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(_Request):
    lora_name: StrictStr = Field(min_length=1)
    lora_path: StrictStr = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Request):
    lora_name: StrictStr = Field(min_length=1)
    lora_int_id: StrictInt | None = None  # vLLM's; the name alone says which


def lora_routes(server: Any) -> dict[str, Callable]:
    """``"METHOD /path" -> handler`` for the server's route table."""

    async def load(request: Request) -> PlainTextResponse:
        req = await server.parse(request, LoadLoRAAdapterRequest)
        served = server.model.lora_modules
        if req.lora_name in served and not req.load_inplace:
            raise APIError(400, f"The lora adapter '{req.lora_name}' has already been loaded.", param="lora_name")
        if req.lora_name in server.model.names and req.lora_name not in served:
            raise APIError(400, f"lora_name: {req.lora_name!r} is the base model's name", param="lora_name")
        engine = _engine_calls(server)
        try:
            # Read beside the steps; the engine's loop only puts it in a slot. load_inplace: the new
            # weights under the old name, the old ones kept if they fail.
            adapter = await engine.read_lora(req.lora_path)
            loaded = await engine.call("add_lora", req.lora_name, adapter, req.lora_name in served)
        except ValueError as exc:
            message = str(exc)
            param = message.split(":", 1)[0] if message.startswith(("lora_name:", "lora_path:")) else None
            raise APIError(400, message, param=param) from None
        served[req.lora_name] = loaded.path
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload(request: Request) -> PlainTextResponse:
        req = await server.parse(request, UnloadLoRAAdapterRequest)
        if req.lora_name not in server.model.lora_modules:
            raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        # Gone from the name table first: no request naming it is accepted from here on.
        server.model.lora_modules.pop(req.lora_name)
        await _engine_calls(server).call("remove_lora", req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return {"POST /v1/load_lora_adapter": load, "POST /v1/unload_lora_adapter": unload}


def _engine_calls(server: Any) -> Any:
    engine = server.engine
    if not callable(getattr(engine, "call", None)):
        raise APIError(400, "loading LoRA adapters at runtime is not supported with --data-parallel-size > 1: "
                            "give them to --lora-modules", param="lora_name")
    return engine
