"""The endpoints a reinforcement-learning trainer drives the server with (docs/rl.md), served
only with `--enable_weight_updates` and behind a key (an operator key with several tenants:
auth.py protects PATHS). vLLM's names where it has them, SGLang's for a load from disk:

    POST /update_weights {"path": ..., "in_flight": "finish"|"abort"}   (also
         /update_weights_from_disk, whose body may name the path "model_path")
    POST /pause, POST /resume, GET /is_paused
    POST /sleep?level=1|2, POST /wake_up[?tags=kv_cache&tags=weights], GET /is_sleeping
    POST /reset_prefix_cache

The path is read on the server (AsyncEngine.update_weights_from: safetensors, a jaxserve orbax
checkpoint or an orbax checkpoint of params_like(), in a worker thread), then the engine loop
swaps the weights between steps. A bad path, a wrong shape or a refused call is a 400 naming
it, and the old weights keep serving."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request

from jaxserve.engine.weight_update import IN_FLIGHT
from jaxserve.server.json_io import parse_object
from jaxserve.server.protocol import APIError

# The paths' prefixes (auth.py): they change or show what every tenant is served.
PATHS = ("/update_weights", "/pause", "/resume", "/is_paused", "/sleep", "/wake_up",
         "/is_sleeping", "/reset_prefix_cache")


def _refused(e: Exception, param: str | None = None) -> APIError:
    return APIError(str(e), param=param, code="invalid_value")


def add_weight_routes(app: FastAPI, aengine, read_body) -> None:
    """The endpoints on `app`, run on `aengine` (an AsyncEngine) between its steps. read_body:
    the app's (its size limit)."""

    async def body_of(request: Request) -> dict:  # an empty body: every field's default
        return parse_object(await read_body(request), empty={})

    async def control(call, param: str | None = None):
        """Await a command; the engine's refusal (ValueError) is a 400 naming it."""
        try:
            return await call
        except ValueError as e:
            raise _refused(e, param) from None

    @app.post("/update_weights")
    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request):
        body = await body_of(request)
        field = "path" if "path" in body else "model_path"
        path, in_flight = body.get(field), body.get("in_flight", "finish")
        if not isinstance(path, str) or not path:
            raise APIError("'path' (or 'model_path') must name a safetensors file or directory "
                           "or an orbax checkpoint on the server", param="path",
                           code="invalid_value")
        if in_flight not in IN_FLIGHT:
            raise APIError(f"in_flight must be one of {list(IN_FLIGHT)}, got {in_flight!r}",
                           param="in_flight", code="invalid_value")
        t0 = time.perf_counter()
        try:
            done = await aengine.update_weights_from(path, in_flight)
        except (ValueError, OSError) as e:
            raise _refused(e, field) from None
        return {"weights_version": done.weights_version, "path": path, "in_flight": in_flight,
                "requests_in_flight": done.settled,
                "seconds": round(time.perf_counter() - t0, 4)}

    @app.post("/pause")
    async def pause():
        await aengine.pause()
        return {"is_paused": True}

    @app.post("/resume")
    async def resume():
        await aengine.resume()
        return {"is_paused": False}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": aengine.is_paused}

    @app.post("/sleep")
    async def sleep(level: str = "1"):
        if level not in ("1", "2"):
            raise APIError(f"level must be 1 (the KV pool) or 2 (and the weights), got "
                           f"{level!r}", param="level", code="invalid_value")
        await control(aengine.sleep(int(level)), "level")
        return {"is_sleeping": aengine.is_sleeping, "level": int(level)}

    @app.post("/wake_up")
    async def wake_up(request: Request):
        tags = request.query_params.getlist("tags") or None
        await control(aengine.wake_up(tags), "tags")
        return {"is_sleeping": aengine.is_sleeping}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": aengine.is_sleeping}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await aengine.call(lambda engine: engine.reset_prefix_cache())
        return {"reset": True}

