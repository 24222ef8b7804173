"""The OpenAI-compatible FastAPI app: `build_app(engine, ServerConfig(...))`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with
stream=true), GET /v1/models, GET /health, GET /metrics (Prometheus text), GET /debug/stats (JSON).
Every error is OpenAI's shape {"error": {message, type, param, code}}. Bodies are read by
`parse_body` (size and nesting limits) and validated by the pydantic models of requests.py, which
/openapi.json and /docs show as the request schemas. With an API key, /v1 and
/debug, the docs and /metrics need `Authorization: Bearer <key>` (compared in constant time;
`public_metrics` leaves /metrics open); with several tenants, /metrics and /debug need an
operator key.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import time

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from jaxserve.config.serving import ProtocolConfig, ServingConfig
from jaxserve.engine import DataParallelEngine, LLMEngine
from jaxserve.engine.async_engine import AsyncEngine, RequestGroup
from jaxserve.engine.client import EngineDead, EngineOverloaded
from jaxserve.engine.weight_update import EngineAsleep
from jaxserve.server.auth import OPERATOR, AuthMiddleware, resolve_api_keys
from jaxserve.server.body_limits import BodyLimits
from jaxserve.server.disconnect import unless_disconnected
from jaxserve.server.health import add_health_routes
from jaxserve.server.json_io import StrictJSONResponse, dumps, parse_body
from jaxserve.server.loop_watch import LoopWatch, StartWatch
from jaxserve.server.lora_routes import add_lora_routes
from jaxserve.server.metrics import CONTENT_TYPE, ServerMetrics
from jaxserve.server.pooling import add_pooling_routes, check_runner
from jaxserve.server.protocol import APIError, ProtocolContext, parse_request
from jaxserve.server.reasoning import REASONING_PARSERS
from jaxserve.server.requests import openapi_schemas
from jaxserve.server.responses import ResponseBuilder
from jaxserve.server.tool_parsers import PARSERS
from jaxserve.server.weight_routes import add_weight_routes

log = logging.getLogger("jaxserve.server")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """What the app serves with: `ServingConfig` and `ProtocolConfig` (jaxserve/config/serving.py,
    requested: their defaults and help) resolved by `of`, the key file read into (key, tenant)
    pairs."""

    api_key: str | None = None  # one key, tenant "default"
    # (key, tenant) pairs: each tenant's requests share prefix-cache pages only among themselves
    # (their cache salt is derived from the tenant name), so no tenant can time another's prompts.
    api_keys: tuple[tuple[str, str], ...] = ()
    max_body_bytes: int = ServingConfig.max_body_bytes
    max_tokens_limit: int | None = ProtocolConfig.max_tokens_limit  # None: the context bounds it
    max_prompts_per_request: int = ServingConfig.max_prompts_per_request
    # Checked on the parsed body before it is rendered or tokenized (body_limits.py);
    # max_prompt_chars None: 32 per token of the context.
    max_tools: int = ServingConfig.max_tools
    max_tools_bytes: int = ServingConfig.max_tools_bytes
    max_prompt_chars: int | None = ServingConfig.max_prompt_chars
    served_model_names: tuple[str, ...] | None = None  # default: the engine's model name
    # With keys, /metrics needs one too (it shows every tenant's traffic; Prometheus scrapers
    # send bearer tokens); True leaves it open for a scraper that cannot.
    public_metrics: bool = ServingConfig.public_metrics
    # Keys for /metrics and /debug: they count every tenant's tokens and prefix-cache hits, so
    # with more than one tenant a tenant's key gets 403 there (one tenant sees only itself).
    operator_keys: tuple[str, ...] = ()
    # How tool calls (tool_choice "auto") and reasoning are read from the text: names of
    # tool_parsers.PARSERS ("auto": from the chat template) and reasoning.REASONING_PARSERS.
    tool_call_parser: str = ProtocolConfig.tool_call_parser
    reasoning_parser: str | None = None
    # The weight and memory endpoints of weight_routes.py (RL trainers'): behind a key only.
    enable_weight_updates: bool = ServingConfig.enable_weight_updates
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_routes.py): behind a key only.
    allow_runtime_lora_updates: bool = ServingConfig.allow_runtime_lora_updates

    @classmethod
    def of(cls, serving: ServingConfig, protocol: ProtocolConfig = ProtocolConfig(),
           env_key: str | None = None) -> "ServerConfig":
        """The requested serving options resolved: keys from --api_key, the key file and (when
        neither gives one) env_key, JAXSERVE_API_KEY's value (resolve_api_keys)."""
        context = protocol.context_options()
        return cls(api_keys=resolve_api_keys(list(serving.api_key), serving.api_key_file,
                                             env_key),
                   operator_keys=tuple(serving.operator_key),
                   public_metrics=serving.public_metrics, max_body_bytes=serving.max_body_bytes,
                   max_prompts_per_request=serving.max_prompts_per_request,
                   max_tools=serving.max_tools, max_tools_bytes=serving.max_tools_bytes,
                   max_prompt_chars=serving.max_prompt_chars,
                   max_tokens_limit=context["max_tokens_limit"],
                   served_model_names=context["model_names"],
                   tool_call_parser=context["tool_call_parser"],
                   reasoning_parser=context["reasoning_parser"],
                   enable_weight_updates=serving.enable_weight_updates,
                   allow_runtime_lora_updates=serving.allow_runtime_lora_updates)

    def __post_init__(self):
        if self.tool_call_parser != "auto" and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {['auto', *PARSERS]}, got "
                             f"{self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, "none", *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {['none', *REASONING_PARSERS]},"
                             f" got {self.reasoning_parser!r}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")
        for flag, power in (("enable_weight_updates", "replace the model's weights"),
                            ("allow_runtime_lora_updates", "load files of the server as adapters")):
            if getattr(self, flag) and not (self.keys or self.operator_keys):
                raise ValueError(f"{flag} lets a caller {power}: it needs an API key "
                                 "(--api_key, --api_key_file, JAXSERVE_API_KEY or "
                                 "--operator_key); refusing to start without one")
        seen: dict[str, str] = {}
        for key, tenant in self.keys + tuple((k, OPERATOR) for k in self.operator_keys):
            if not key or not tenant:
                raise ValueError("API keys and tenant names must not be empty")
            if key != key.strip() or len(key.split()) != 1:
                raise ValueError("an API key must not hold whitespace (it travels in a header)")
            if key in seen:  # which tenant would it be? Refused rather than guessed
                raise ValueError(f"an API key is listed twice (tenants {seen[key]!r} and "
                                 f"{tenant!r})")
            seen[key] = tenant

    @property
    def keys(self) -> tuple[tuple[str, str], ...]:
        single = () if self.api_key is None else ((self.api_key, "default"),)
        return single + tuple(self.api_keys)


class _EventStream(StreamingResponse):
    """Server-sent events that stop (and close the generator, aborting its requests) as soon as
    the client disconnects, whatever ASGI version the server speaks."""

    def __init__(self, content):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send):
        async with anyio.create_task_group() as tg:
            async def stream():
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()
        with contextlib.suppress(Exception):
            await self.body_iterator.aclose()


class RequestFailed(Exception):
    """The engine failed this request alone (RequestOutput.error)."""


def _failure(e: Exception) -> APIError:
    """The API error for a request that the engine could not finish."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDead):
        return APIError(str(e), status=503, type="server_error", code="engine_unavailable")
    if isinstance(e, RequestFailed):
        return APIError(f"the request failed: {e}", status=500, type="internal_error",
                        code="request_failed")
    return APIError(f"the engine failed: {e!r}", status=500, type="internal_error",
                    code="engine_error")


def build_app(engine: LLMEngine | DataParallelEngine | AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    """The app around one engine. Pass an AsyncEngine to share one engine loop between apps."""
    config = config or ServerConfig()
    owned = isinstance(engine, (LLMEngine, DataParallelEngine))
    aengine = AsyncEngine(engine) if owned else engine
    ctx = ProtocolContext.for_engine(aengine, config.served_model_names,
                                     config.max_tokens_limit, config.tool_call_parser,
                                     config.reasoning_parser)
    metrics = ServerMetrics()
    aengine.observers.append(metrics)
    limits = BodyLimits.of(config.max_prompts_per_request, config.max_tools,
                           config.max_tools_bytes, config.max_prompt_chars, ctx.max_model_len)
    ctx = dataclasses.replace(ctx, max_prompt_chars=limits.max_prompt_chars)
    # A body's validation, chat template, tokenizing and grammar run here, off the event loop
    # (a 3.9 MB prompt froze every stream for seconds). Few threads: each holds the GIL in
    # turn with the loop, so the more there are, the longer the loop waits for it.
    workers = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="jaxserve-prepare")

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(
            workers, functools.partial(fn, *args))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        aengine.start()
        yield
        with contextlib.suppress(ValueError):
            aengine.observers.remove(metrics)
        workers.shutdown(wait=False, cancel_futures=True)
        if owned:
            aengine.shutdown()

    app = FastAPI(title="jaxserve", lifespan=lifespan,
                  default_response_class=StrictJSONResponse)
    app.state.engine = aengine
    app.state.metrics = metrics
    app.state.ctx = ctx
    if config.keys or config.operator_keys:
        app.add_middleware(AuthMiddleware,
                           keys=config.keys + tuple((k, OPERATOR) for k in config.operator_keys),
                           public=("/metrics",) if config.public_metrics else ())
    loop_watch = LoopWatch()  # how long the event loop was held: /debug/stats
    app.add_middleware(StartWatch, watch=loop_watch)  # outermost: any request starts it
    base_salt = aengine.served_model.cache_salt or ""

    def cache_salt(request: Request) -> str | None:
        """The tenant's prefix-cache salt, derived server-side from its name (None: no keys,
        one tenant: the engine's salt)."""
        tenant = getattr(request.state, "tenant", None)
        return None if tenant is None else f"{base_salt}\x00tenant:{tenant}"

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        metrics.http_rejected.labels(status=str(e.status)).inc()
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return StrictJSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(EngineDead)  # /metrics and /debug, which read the engine's stats
    async def engine_dead(request, e: EngineDead):
        return await api_error(request, _failure(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        kind = "not_found" if e.status_code == 404 else "invalid_request_error"
        return StrictJSONResponse(APIError(str(e.detail), status=e.status_code,
                                           type=kind).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        log.exception("internal error")
        return StrictJSONResponse(APIError(f"internal server error: {type(e).__name__}",
                                           status=500, type="internal_error").body(),
                                  status_code=500)

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        too_big = APIError(f"request body exceeds {config.max_body_bytes} bytes", status=413,
                           code="request_too_large")
        if length and length.isdigit() and int(length) > config.max_body_bytes:
            raise too_big
        data, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > config.max_body_bytes:
                    raise too_big
                data.append(chunk)
        except ClientDisconnect:  # gone, or closed by --read_timeout: no traceback for that
            raise APIError("the client went away before its body arrived", status=499,
                           code="client_closed") from None
        return b"".join(data)

    async def submit(parsed, salt: str | None) -> RequestGroup:
        prompts = parsed.prompts
        lora = ctx.adapters.get(parsed.model)
        if lora is not None:  # a LoRA adapter's name: its prompts run under it
            prompts = [{**p, "lora_request": lora} for p in prompts]
        elif parsed.model is not None and parsed.model not in ctx.model_names:
            raise APIError(f"The model `{parsed.model}` does not exist (unloaded). Served: "
                           f"{list(ctx.served_names)}", status=404, param="model",
                           code="model_not_found")
        try:
            return await aengine.add(prompts, parsed.params, cache_salt=salt)
        except EngineOverloaded as e:
            raise APIError(str(e), status=503, type="server_overloaded",
                           code="overloaded") from None
        except EngineDead as e:
            raise APIError(str(e), status=503, type="server_error", code="engine_dead") from None
        except EngineAsleep as e:  # /sleep released the pool or the weights
            raise APIError(str(e), status=503, type="server_error", code="engine_asleep") from None
        except ValueError as e:  # RequestRejected: can never run under this configuration
            raise APIError(str(e), code="invalid_value") from None

    async def events(group: RequestGroup, builder: ResponseBuilder):
        """SSE chunks; any failure, the engine's or this request's own, ends the stream with an
        error event and then [DONE]."""
        try:
            try:
                async for index, out in group:
                    if out.error is not None:
                        raise RequestFailed(out.error)
                    for chunk in builder.chunks(index, out):
                        yield f"data: {dumps(chunk)}\n\n"
                if builder.p.include_usage:
                    yield f"data: {dumps(builder.usage_chunk())}\n\n"
            except Exception as e:  # noqa: BLE001 - answered in the stream
                yield f"data: {dumps(_failure(e).body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            group.abort()

    async def collect(group: RequestGroup, builder: ResponseBuilder) -> dict:
        final = [None] * group.size
        async for index, out in group:
            if out.error is not None:
                raise RequestFailed(out.error)
            if out.finished:
                final[index] = out
        return builder.response(final)

    async def compile_grammar(parsed) -> None:
        """Admit a structured output's grammar (GrammarCompiler.compile: compile, first mask,
        the matcher's limits) in a worker thread, off the engine's step loop: add_request then
        finds it cached. One the matcher cannot serve is a 400 naming why."""
        spec = parsed.params.structured_outputs
        if spec is not None:
            try:
                await off_loop(aengine.compile_grammar, spec)
            except ValueError as e:
                raise APIError(str(e), param=parsed.constraint_field,
                               code="invalid_value") from None

    def prepare(kind: str, data: bytes):
        """The engine's request from a body (in a worker thread): JSON parsed, the cheap
        limits checked, then validation, templating and tokenizing."""
        body = parse_body(data)
        limits.check(body)
        return parse_request(kind, body, ctx)

    async def serve(kind: str, request: Request):
        check_runner(aengine.served_model, kind)  # a pooling model: a 400
        parsed = await off_loop(prepare, kind, await read_body(request))
        await compile_grammar(parsed)
        group = await submit(parsed, cache_salt(request))
        builder = ResponseBuilder(parsed, ctx)
        if parsed.stream:
            return _EventStream(events(group, builder))
        work = await unless_disconnected(collect(group, builder), request, group)
        if work is None:
            return Response(status_code=499)  # the client went away
        try:
            return StrictJSONResponse(work.result())
        except Exception as e:  # noqa: BLE001 - an OpenAI-shaped error, never a bare 500
            raise _failure(e) from None

    def body_schema(name: str) -> dict:
        """The route's request body in OpenAPI (read by `read_body`, validated by
        parse_request, not by FastAPI: its errors keep OpenAI's shape)."""
        return {"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{name}"}}}}}

    @app.post("/v1/completions", openapi_extra=body_schema("CompletionRequest"))
    async def completions(request: Request):
        return await serve("completion", request)

    @app.post("/v1/chat/completions", openapi_extra=body_schema("ChatCompletionRequest"))
    async def chat_completions(request: Request):
        return await serve("chat", request)

    add_pooling_routes(app, aengine, ctx, read_body=read_body, off_loop=off_loop, submit=submit,
                       cache_salt=cache_salt, max_prompts=config.max_prompts_per_request)

    fastapi_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:  # FastAPI's, once, with the request models added
            schema = fastapi_openapi()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                openapi_schemas())
        return app.openapi_schema

    app.openapi = openapi

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "jaxserve",
             "max_model_len": ctx.max_model_len,
             **({"parent": ctx.model_names[0], "root": ctx.adapters.get(name).lora_path}
                if name not in ctx.model_names else {})} for name in ctx.served_names]}

    add_health_routes(app, aengine)
    if config.enable_weight_updates:
        add_weight_routes(app, aengine, read_body)
    if config.allow_runtime_lora_updates:
        add_lora_routes(app, aengine, ctx, read_body)

    @app.get("/metrics")
    async def prometheus():
        metrics.set_engine_stats(await aengine.stats())
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/debug/stats")
    async def debug_stats():
        return {**await aengine.stats(kv_usage=True), **loop_watch.stats()}

    return app
