"""Health, in the shape orchestrators expect. /health/live: 200 while the process and its engine
loop are up. /health/ready (and /health): 200 only while requests are served at once, otherwise
503 with the reason (AsyncEngine.readiness: warming up, stalled, draining, dead); its body says
how many warm-up shapes are still compiling. `StartingApp` is what the socket serves from the
first moment, before the engine exists (live, and ready's "starting"), and then the app."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.responses import JSONResponse


def _unavailable(reason: str, **extra) -> JSONResponse:
    return JSONResponse({"status": "unavailable", "reason": reason, **extra}, status_code=503,
                        headers={"Retry-After": "1"})


def add_health_routes(app: FastAPI, aengine) -> None:
    """The two endpoints on `app`, answered from `aengine` (an AsyncEngine) without its loop."""

    @app.get("/health/live")
    async def live():
        if not aengine.alive:
            return JSONResponse({"status": "dead", "error": repr(aengine.last_error)},
                                status_code=503)
        return {"status": "live"}

    @app.get("/health/ready")
    @app.get("/health")
    async def ready():
        reason, pending = aengine.readiness(), aengine.compilations_pending
        if reason is not None:
            return _unavailable(reason, compilations_pending=pending)
        return {"status": "ok", "compilations_pending": pending}


class StartingApp:
    """The ASGI app a server listens with while its engine is built: /health/live 200,
    /health/ready and /health 503 "starting", anything else 503 in OpenAI's error shape;
    `serve(app)` hands every later request to `app`, `failed(reason)` says why none will come.
    uvicorn runs it with lifespan="off": the app's own lifespan never runs."""

    def __init__(self):
        self.app = None
        self.reason = "starting: loading the model and building the engine"

    def serve(self, app) -> None:
        self.app = app

    def failed(self, reason: str) -> None:
        self.reason = f"failed to start: {reason}"

    async def __call__(self, scope, receive, send):
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health/live":
            response = JSONResponse({"status": "live", "reason": self.reason})
        elif path in ("/health/ready", "/health"):
            response = _unavailable(self.reason)
        else:
            response = JSONResponse({"error": {
                "message": f"the server is not serving yet ({self.reason}); retry later",
                "type": "server_error", "param": None, "code": "starting"}},
                status_code=503, headers={"Retry-After": "1"})
        await response(scope, receive, send)
