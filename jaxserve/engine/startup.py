"""The start-up timeline: what an engine's start spends its seconds on, logged at info level as
it goes (the process's imports before the engine, loading the weights, placing them, the memory
plan, each warm-up shape compiled or loaded from JAX's persistent compilation cache, ready) and
kept for stats() (`start_seconds`: the engine's construction and warm-ups; `process_start_seconds`:
from the process's start to the end of the last warm-up)."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time

import jax
import psutil

log = logging.getLogger("jaxserve.engine")


class _CompileEvents:
    """Counts of JAX's compilation events in this process (backend compiles and persistent
    cache hits), from jax.monitoring's listeners (registered once: they cannot be removed),
    in all and per thread (the listeners run in the thread that compiles)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.compiles = self.cache_hits = 0
        self.compile_seconds = 0.0
        self.local = threading.local()

    def on_event(self, event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            with self.lock:
                self.cache_hits += 1
            self.local.cache_hits = getattr(self.local, "cache_hits", 0) + 1

    def on_duration(self, event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            with self.lock:
                self.compiles += 1
                self.compile_seconds += seconds
            self.local.compiles = getattr(self.local, "compiles", 0) + 1

    def snapshot(self) -> tuple[int, int]:
        with self.lock:
            return self.compiles, self.cache_hits

    def thread_snapshot(self) -> tuple[int, int]:
        """This thread's counts."""
        return getattr(self.local, "compiles", 0), getattr(self.local, "cache_hits", 0)


@functools.cache
def compile_events() -> _CompileEvents:
    events = _CompileEvents()
    jax.monitoring.register_event_listener(events.on_event)
    jax.monitoring.register_event_duration_secs_listener(events.on_duration)
    return events


class StartupTimeline:
    def __init__(self):
        self.events = compile_events()
        self.began = time.perf_counter()
        self.process_began = time.time() - psutil.Process().create_time()  # seconds before us
        self.seconds = 0.0  # construction and warm-ups
        self.process_seconds = self.process_began  # to the end of construction or a warm-up
        log.info("start-up: %.2f s from the process's start to the engine's (imports)",
                 self.process_began)

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        yield
        log.info("start-up: %s %.2f s", name, time.perf_counter() - start)

    def built(self) -> None:
        self.seconds = time.perf_counter() - self.began
        self.process_seconds = self.process_began + self.seconds
        log.info("start-up: engine built in %.2f s", self.seconds)

    def shape_timer(self):
        """A callback for each warm-up shape, called in the thread that compiled it: (what,
        seconds) -> logged as compiled or loaded from the compilation cache (by that thread's
        events since its previous shape)."""
        before = threading.local()
        before.counts = self.events.thread_snapshot()

        def done(what: str, seconds: float) -> None:
            compiles, hits = self.events.thread_snapshot()
            compiles_before, hits_before = getattr(before, "counts", (0, 0))
            new_compiles, new_hits = compiles - compiles_before, hits - hits_before
            before.counts = compiles, hits
            how = ("compiled" if new_compiles > new_hits else
                   "loaded from the compilation cache" if new_hits else "ran (already compiled)")
            log.info("start-up: %s %s in %.2f s", what, how, seconds)
        return done

    def ready(self, warmup_seconds: float) -> None:
        """A warm-up ended: its seconds count, and the process's time to it."""
        self.seconds += warmup_seconds
        self.process_seconds = self.process_began + time.perf_counter() - self.began
        log.info("start-up: ready, %.2f s since the process started (engine %.2f s)",
                 self.process_seconds, self.seconds)

    def all_compiled(self) -> None:
        """The background warm-up compiled its last shape."""
        log.info("start-up: every warm-up shape compiled, %.2f s since the process started",
                 time.time() - psutil.Process().create_time())

    def stats(self) -> dict:
        return {"start_seconds": self.seconds, "process_start_seconds": self.process_seconds}
