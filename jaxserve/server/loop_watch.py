"""How long the server's event loop was held: what every stream it serves saw as a frozen gap.

A task on the loop sleeps 10 ms at a time and records how late it woke (the loop was running
something else, or the whole process was stopped). Garbage collections stop every thread, the
loop's too, so the process's longest collection is recorded beside it to tell the causes apart.
A hold of a second or more is logged with the collection time it overlapped. /debug/stats shows
both (`event_loop_max_lag_s`, `gc_max_pause_s`)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

logger = logging.getLogger("jaxserve.server")

_TICK = 0.01  # the watch's sleep: holds shorter than this are not seen
_LOGGED_HOLD = 1.0


class _GcPauses:
    """The process's collections (gc.callbacks, installed once): the longest pause, and the
    total so far, so a hold can say how much of it was collection."""

    def __init__(self):
        self.max_s = 0.0
        self.total_s = 0.0
        self._start = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            pause = time.perf_counter() - self._start
            self.max_s, self.total_s, self._start = max(self.max_s, pause), self.total_s + pause, None


_gc_pauses: _GcPauses | None = None


class LoopWatch:
    """One per app; started on the loop by the first request it sees (`started_by` middleware),
    since `jaxserve serve` runs its app without a lifespan."""

    def __init__(self):
        global _gc_pauses
        if _gc_pauses is None:
            _gc_pauses = _GcPauses()
        self.gc = _gc_pauses
        self.max_lag_s = 0.0
        self.holds_over_100ms = 0
        self._task = None

    def ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            t, gc_before = time.perf_counter(), self.gc.total_s
            await asyncio.sleep(_TICK)
            lag = time.perf_counter() - t - _TICK
            self.max_lag_s = max(self.max_lag_s, lag)
            self.holds_over_100ms += lag >= 0.1
            if lag >= _LOGGED_HOLD:
                logger.warning("event loop held %.2f s (garbage collection %.2f s of it); every "
                               "stream paused", lag, self.gc.total_s - gc_before)

    def stats(self) -> dict:
        return {"event_loop_max_lag_s": round(self.max_lag_s, 4),
                "event_loop_holds_over_100ms": self.holds_over_100ms,
                "gc_max_pause_s": round(self.gc.max_s, 4)}


class StartWatch:
    """ASGI middleware: starts the app's LoopWatch on the loop its requests run on."""

    def __init__(self, app, watch: LoopWatch):
        self.app, self.watch = app, watch

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.watch.ensure_started()
        await self.app(scope, receive, send)
