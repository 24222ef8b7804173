"""Loading and unloading LoRA adapters while serving (vLLM's endpoints and bodies), served only
with `--allow_runtime_lora_updates` and behind a key (an operator key with several tenants:
auth.py protects PATHS):

    POST /v1/load_lora_adapter   {"lora_name": ..., "lora_path": a PEFT directory on the server}
    POST /v1/unload_lora_adapter {"lora_name": ...}

A load reads the adapter on the engine's loop between steps (LLMEngine.add_lora) and serves it
by name once read; a bad path, a refused adapter or a name already served is a 400 naming it.
An unload stops serving the name at once (requests naming it 404 from then on, an unknown
name is a 404); the requests already running or waiting under it finish with it, and its slot
is freed after (LLMEngine.remove_lora)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from jaxserve.server.json_io import parse_object
from jaxserve.server.protocol import APIError, ProtocolContext

# The paths' prefixes (auth.py): they change what every tenant is served.
PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def _name(body: dict, field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value.strip():
        raise APIError(f"'{field}' must be a non-empty string", param=field,
                       code="invalid_value")
    return value


def _lora_engine(engine):
    """The engine whose adapters change: one LLMEngine (a data-parallel engine's replicas each
    hold their own, which runtime loading does not reach yet)."""
    if not hasattr(engine, "add_lora"):
        raise ValueError("loading LoRA adapters at runtime is not supported with "
                         "data_parallel_size > 1 yet")
    return engine


def add_lora_routes(app: FastAPI, aengine, ctx: ProtocolContext, read_body) -> None:
    """The endpoints on `app`, changing ctx.adapters (the served names) and `aengine`'s
    adapters (an AsyncEngine over an engine with enable_lora). read_body: the app's."""

    async def body_of(request: Request) -> dict:
        return parse_object(await read_body(request))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await body_of(request)
        name, path = _name(body, "lora_name"), _name(body, "lora_path")
        if name in ctx.model_names:
            raise APIError(f"{name!r} is the base model's name", param="lora_name",
                           code="invalid_value")
        try:
            lora = ctx.adapters.reserve(name, path)
        except ValueError as e:
            raise APIError(str(e), param="lora_name", code="invalid_value") from None
        try:
            await aengine.call(lambda engine: _lora_engine(engine).add_lora(lora))
        except (ValueError, OSError) as e:  # LoRAAdapterError names the path and why
            ctx.adapters.released(lora)
            raise APIError(f"LoRA adapter {name!r} not loaded: {e}", param="lora_path",
                           code="invalid_value") from None
        except BaseException:
            ctx.adapters.released(lora)
            raise
        ctx.adapters.added(lora)
        return {"lora_name": name, "lora_path": path, "lora_int_id": lora.lora_int_id,
                "loaded": True}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        name = _name(await body_of(request), "lora_name")
        try:
            await aengine.call(_lora_engine)
        except ValueError as e:
            raise APIError(str(e), code="invalid_value") from None
        lora = ctx.adapters.remove(name)  # no request names it from here on
        if lora is None:
            raise APIError(f"The LoRA adapter `{name}` is not loaded. Loaded: "
                           f"{list(ctx.adapters.names())}", status=404, param="lora_name",
                           code="lora_adapter_not_found")

        def remove(engine) -> int:
            running = engine.scheduler.live.count_under(lora.lora_int_id)
            engine.remove_lora(lora.lora_int_id)
            return running

        in_flight = await aengine.call(remove)
        return {"lora_name": name, "unloaded": True, "requests_in_flight": in_flight}
