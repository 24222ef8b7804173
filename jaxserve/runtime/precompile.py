"""Ahead-of-time compiles in a thread pool: each job compiles one executable (`jit(f).lower(...)
.compile()` on the call's real arguments, so the jitted function's own cache then holds it).
XLA compiles, and loads from the persistent cache, with the GIL released, so the jobs overlap.

A job is compiled exactly once: by a pool thread, or by the caller of `wait` that needs it before
a thread has picked it up (it claims the job and runs it itself); a caller that needs a job a
thread is running waits for that thread."""

from __future__ import annotations

import atexit
import collections
import threading
import weakref
import time
from typing import Callable, Hashable


class _Job:
    def __init__(self, name: str, compile_fn: Callable[[], object]):
        self.name, self.compile_fn = name, compile_fn
        self.claimed = False
        self.done = threading.Event()
        self.result = self.error = None
        self.seconds = 0.0

    def run_if_unclaimed(self, lock: threading.Lock) -> bool:
        with lock:
            if self.claimed:
                return False
            self.claimed = True
        start = time.perf_counter()
        try:
            self.result = self.compile_fn()
        except BaseException as e:  # handed to whoever waits for this executable
            self.error = e
        self.seconds = time.perf_counter() - start
        self.compile_fn = None  # its closure holds arrays
        self.done.set()
        return True


class Precompiler:
    """Jobs keyed by the call signature they compile, run in the order submitted (the shapes
    needed first, first) by up to `threads` daemon threads, which end when none is left; with
    threads=0, by the callers of `wait` alone."""

    def __init__(self, threads: int, on_done: Callable[[Hashable, str, float], None]):
        """on_done(key, name, seconds) runs in the compiling thread after each job."""
        self._jobs: dict[Hashable, _Job] = {}
        self._lock = threading.Lock()
        self._queue: collections.deque = collections.deque()
        self._threads, self._live = threads, 0
        self._workers: list[threading.Thread] = []
        self._on_done = on_done
        _LIVE.add(self)

    def submit(self, key: Hashable, name: str, compile_fn: Callable[[], object]) -> bool:
        """Queue a compile unless one of `key` is already known; returns whether it was queued."""
        with self._lock:
            if key in self._jobs:
                return False
            job = self._jobs[key] = _Job(name, compile_fn)
            self._queue.append((key, job))
            if self._live < self._threads:
                self._live += 1
                worker = threading.Thread(target=self._work, name="jaxserve-compile", daemon=True)
                self._workers.append(worker)
                worker.start()
        return True

    def stop(self) -> None:
        """Start no further job and wait for the threads' current ones: a process must not
        exit while XLA compiles in a daemon thread (the C++ runtime aborts mid-teardown).
        Jobs left queued still run in a caller that waits for them."""
        with self._lock:
            self._queue.clear()
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.join()

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._live -= 1
                    return
                key, job = self._queue.popleft()
            self._run(key, job)

    def _run(self, key: Hashable, job: _Job) -> None:
        if job.run_if_unclaimed(self._lock) and job.error is None:
            self._on_done(key, job.name, job.seconds)

    def wait(self, key: Hashable):
        """What the job of `key` returned, once it is done (None for a key never submitted):
        run here if no thread has started it yet, else waited for. Re-raises its error."""
        job = self._jobs.get(key)
        if job is None:
            return None
        if not job.done.is_set():  # the usual case in a step: done long ago
            self._run(key, job)
            job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def wait_all(self, keys) -> None:
        for key in keys:
            self.wait(key)

    def pending(self) -> int:
        """Jobs not finished yet (queued or compiling)."""
        return sum(1 for job in list(self._jobs.values()) if not job.done.is_set())


_LIVE: "weakref.WeakSet[Precompiler]" = weakref.WeakSet()
atexit.register(lambda: [p.stop() for p in list(_LIVE)])
