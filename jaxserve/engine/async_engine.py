"""AsyncEngine: one background thread owns the LLMEngine and drives step(); asyncio handlers talk to
it through a command queue and receive RequestOutputs on per-group asyncio queues.

LLMEngine is not thread-safe, so every engine call (add_request, abort, step, stats, kv_usage)
runs on the loop thread. A handler submits a group of prompts sharing one SamplingParams
(`await add(...)`, which raises at once if the engine refuses them), iterates the group's outputs,
and aborts what is unfinished when it stops listening (client disconnect): the abort is applied
before the next step, so the request's pages are freed at once. A group has at most as many
prompts in the engine as it can run at once (max_num_seqs): the rest wait in its backlog and
go in as its earlier ones finish, so a request that arrives later queues behind that many of a
huge group's prompts, not behind all of them. `readiness()` says why it should
not get traffic now: dead, draining, warming up, or stalled (the loop has not come round for
`stall_timeout` seconds: a step or a command holding it). Weight updates, pause / resume and
sleep / wake_up (docs/rl.md) are commands too, run between steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable

from jaxserve.config.serving import ServingConfig
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.structured_output import StructuredOutputsParams
from jaxserve.engine.client import (EngineDead, EngineOverloaded, EngineStalled, Observer,
                                    ServedModel)
from jaxserve.engine.commands import Abort, Add, Answered, Call, Command, FailAll, Wake
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.request_group import RequestGroup
from jaxserve.engine.weight_files import read_update
from jaxserve.weights import numpy_dtype


log = logging.getLogger("jaxserve.engine")


@dataclasses.dataclass(frozen=True)
class WeightsUpdated:
    """AsyncEngine.update_weights' answer."""
    weights_version: int  # the new one
    settled: int  # requests in flight that it finished or failed first


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, idle_wait_s: float = 0.05,
                 stall_timeout: float = ServingConfig.stall_timeout,
                 ready_after: str = ServingConfig.ready_after,
                 max_waiting: int | None = ServingConfig.max_waiting):
        """stall_timeout, ready_after (readiness()), max_waiting (add()): ServingConfig's."""
        self.engine = engine
        self.max_waiting = max_waiting
        config = engine.config
        # a group's prompts in the engine at once: what the engine can run at once
        self.group_quota = config.scheduler.max_num_seqs * config.parallel.data_parallel_size
        self._backlogged = 0  # prompts in the groups' backlogs (loop thread)
        self.observers: list[Observer] = []
        self.idle_wait_s = idle_wait_s
        self.stall_timeout, self.ready_after = stall_timeout, ready_after
        self._beat = time.monotonic()  # the loop's last round (idle, it comes round every wait)
        self.max_round_s = 0.0  # the loop's longest round (commands and step): every stream waits
        self.last_error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, tuple[RequestGroup, int]] = {}  # loop thread only
        self._progress: dict[str, tuple[int, int]] = {}  # request id -> (prompt, output tokens)
        self._ids = itertools.count()
        self._stop = threading.Event()
        self.draining = False  # shutting down: no new requests; live ones finish or time out
        self.warming_up = False  # compiling step shapes (queued requests wait behind it)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ---- lifecycle
    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxserve-engine",
                                                daemon=True)
                self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(Wake())
        if self._thread is not None:
            self._thread.join(timeout)

    def warm_up(self, full: bool = False, background: bool = True,
                **options) -> concurrent.futures.Future:
        """Compile the step shapes from the loop thread, ahead of anything queued after it;
        `readiness()` says "warming up" until it is done: with background=True, until the
        smallest steps are in (LLMEngine.warmup), the rest compiling on while requests are
        served (a step whose shape is not compiled yet waits for it); options go to
        LLMEngine.warmup. The future holds the warm-up report."""
        self.start()
        self.warming_up = True

        def run(engine: LLMEngine) -> dict:
            try:
                return engine.warmup(full=full, background=background, **options)
            finally:  # the loop held by warm-up is no stall
                self._beat, self.warming_up = time.monotonic(), False

        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(Call(run, future))
        return future

    def readiness(self) -> str | None:
        """None when serving; otherwise why not: dead (with the cause), draining, warming up
        (with ready_after="all", until every warm-up shape is compiled), asleep (sleep()),
        stalled. Reads no engine state but flags, so it answers while the loop is stuck."""
        if not self.alive:
            return f"dead: {self.last_error!r}"
        if self.draining:
            return "draining for shutdown"
        if self.warming_up:
            return "warming up (compiling step shapes)"
        pending = self.compilations_pending
        if pending and self.ready_after == "all":
            return f"warming up: {pending} step shapes still compiling (ready_after=all)"
        if self.is_sleeping:
            return "asleep: sleep() released the KV pool or the weights (wake_up, update_weights)"
        return self._stalled()

    def _stalled(self) -> str | None:
        stuck = time.monotonic() - self._beat
        if stuck > self.stall_timeout and not self.warming_up:
            return (f"stalled: the engine loop has not come round for {stuck:.0f} s "
                    f"({len(self._live)} requests live)")
        return None

    @property
    def served_model(self) -> ServedModel:
        return self.engine.served_model

    def compile_grammar(self, spec: StructuredOutputsParams):
        """Admit a structured output's grammar (thread-safe; a server does it in a worker
        thread before `add`, which then finds it cached). ValueError: why it cannot serve."""
        return self.engine.compile_grammar(spec)

    async def stats(self, kv_usage: bool = False) -> dict:
        """The engine's stats(), with its kv_usage() if asked, read on the loop thread;
        EngineStalled at once if that loop is stalled (it would not answer)."""
        if (stalled := self._stalled()) is not None:
            raise EngineStalled(stalled)
        return await self.call(lambda e: {**e.stats(), **({"kv_usage": e.kv_usage()}
                                                           if kv_usage else {}),
                                          "engine_loop_max_round_s": round(self.max_round_s, 4)})

    @property
    def compilations_pending(self) -> int:
        """Warm-up shapes still queued or compiling in the background."""
        return self.engine.compilations_pending

    def drain(self, timeout: float) -> None:
        """Refuse new requests from now on; fail what is still live after `timeout` seconds
        (with EngineDead: an OpenAI-shaped error for each client)."""
        self.draining = True
        timer = threading.Timer(timeout, self.abort_all,
                                args=(f"the server shut down after waiting {timeout:g} s",))
        timer.daemon = True
        timer.start()

    def abort_all(self, reason: str) -> None:
        """Fail every live request at once with EngineDead(reason)."""
        self.draining = True
        self._submit(FailAll(reason))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the asyncio side
    async def add(self, prompts: list[dict], params: SamplingParams,
                  cache_salt: str | None = None) -> RequestGroup:
        """Queue the prompts as one group. Raises ValueError (RequestRejected) if the engine can
        never run one of them, EngineOverloaded if the waiting queue is full; nothing is queued
        then."""
        group = RequestGroup(self, f"g{next(self._ids)}", len(prompts))
        await self._call(lambda future: Add(group, prompts, params, cache_salt, future))
        return group

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the loop thread (stats, kv_usage...) and return its result."""
        return await self._call(lambda future: Call(fn, future))

    # ---- weights and memory (engine/client.RolloutControl, docs/rl.md), between steps
    async def update_weights(self, weights, in_flight: str = "finish") -> WeightsUpdated:
        """The engine's update_weights on the loop thread between steps: requests queued after
        it run under the new weights; the outputs of those it finished or failed reach their
        groups. Returns the new weights_version and how many requests were in flight."""
        def update(engine) -> WeightsUpdated:
            outputs = engine.update_weights(weights, in_flight)
            self._dispatch(outputs)
            return WeightsUpdated(engine.weights_version,
                                  len({o.request_id for o in outputs if o.finished}))

        return await self.call(update)

    async def update_weights_from(self, path: str, in_flight: str = "finish") -> WeightsUpdated:
        """update_weights from a safetensors or orbax path on this machine (weight_files.py),
        read in a worker thread while the loop runs on. ValueError naming the path or the
        weight; nothing changes then."""
        like, num_layers, dtype = await self.call(
            lambda engine: (engine.params_like(), engine.model_config.num_layers,
                            numpy_dtype(engine.resolved.dtype)))
        weights = await asyncio.to_thread(read_update, path, like, num_layers, dtype)
        return await self.update_weights(weights, in_flight)

    async def pause(self) -> None:
        """No engine step starts until resume(); requests stay queued and live."""
        await self.call(lambda engine: engine.pause())

    async def resume(self) -> None:
        await self.call(lambda engine: engine.resume())

    async def sleep(self, level: int = 1) -> None:
        """Free the KV pool (level 1) and the weights too (level 2); ValueError while requests
        are unfinished."""
        await self.call(lambda engine: engine.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.call(lambda engine: engine.wake_up(tags))

    @property
    def is_paused(self) -> bool:  # (a flag the loop thread writes: read as it is)
        return self.engine.is_paused

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    async def _call(self, make: Callable[[concurrent.futures.Future], Command]) -> Any:
        """Submit make(future) and await the loop's answer (the loop started if need be)."""
        self.start()
        if not self.alive or self._stop.is_set():
            raise EngineDead(f"the engine loop is not running ({self.last_error!r})")
        future: concurrent.futures.Future = concurrent.futures.Future()
        command = make(future)
        if self.draining and isinstance(command, Add):
            raise EngineDead("the server is shutting down")
        self._submit(command)
        return await asyncio.wrap_future(future)

    def _submit(self, command: Command) -> None:
        self._commands.put(command)

    # ---- the loop thread
    def _run(self) -> None:
        reason = "the engine is shutting down"
        try:
            while not self._stop.is_set():
                try:
                    self._iterate()
                except Exception as e:  # a bug: fail every live request rather than hang them
                    log.exception("engine loop error; failing the live requests")
                    self.last_error = e
                    self._fail_all(e)
        except BaseException as e:
            self.last_error = e
            reason = f"the engine loop stopped: {e!r}"
            raise
        finally:
            self._fail_all(EngineDead(reason), refuse_queued=True)

    def _iterate(self) -> None:
        """Apply the queued commands, then run one engine step if anything is unfinished."""
        engine = self.engine
        self._beat = time.monotonic()
        try:  # paused, it waits for a command as when idle
            command = (self._commands.get_nowait() if self._busy()
                       else self._commands.get(timeout=self.idle_wait_s))
        except queue.Empty:
            command = None
        t0, compilations, warming = time.perf_counter(), engine.compilations, self.warming_up
        while command is not None:
            self._execute(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                command = None
        t1 = time.perf_counter()
        if not self._stop.is_set() and self._busy():
            self._dispatch(engine.step())
        if not warming:  # the warm-up's own round holds no request
            self._timed_round(t0, t1, compilations)

    def _timed_round(self, t0: float, t1: float, compilations: int) -> None:
        """Keeps the longest round; one of a second or more (every stream froze that long) is
        logged with what it held: commands, the step, compilations."""
        took = time.perf_counter() - t0
        self.max_round_s = max(self.max_round_s, took)
        if took >= 1.0:
            log.warning("engine loop round took %.2f s: commands %.2f s, step %.2f s, %d "
                        "compilations; %d waiting", took, t1 - t0,
                        took - (t1 - t0), self.engine.compilations - compilations,
                        self.engine.num_waiting)

    def _busy(self) -> bool:
        return self.engine.has_unfinished() and not self.engine.is_paused

    def _execute(self, command: Command) -> None:
        match command:
            case Wake():
                return
            case Abort(group, rids):
                self._backlogged -= len(group.backlog)
                group.backlog.clear()
                for rid in rids:
                    self._abort(rid)
                return
            case FailAll(reason):
                self._fail_all(EngineDead(reason))
                return
        if not command.future.set_running_or_notify_cancel():
            return
        try:
            match command:
                case Call(fn, future):
                    future.set_result(fn(self.engine))
                case Add(group, prompts, params, cache_salt, future):
                    self._add(group, prompts, params, cache_salt)
                    future.set_result(None)
        except BaseException as e:  # handed to the awaiting handler
            command.future.set_exception(e)

    def _add(self, group: RequestGroup, prompts: list[dict], params: SamplingParams,
             cache_salt: str | None) -> None:
        if self.max_waiting is not None:
            if len(prompts) > self.max_waiting:  # a 400, not "retry later": it never fits
                raise ValueError(f"the request holds {len(prompts)} prompts and at most "
                                 f"max_waiting={self.max_waiting} may wait; send fewer")
            waiting = self.engine.num_waiting + self._backlogged
            if waiting + len(prompts) > self.max_waiting:
                raise EngineOverloaded(
                    f"the server is overloaded: {waiting} requests are waiting and the limit is "
                    f"{self.max_waiting}; retry later")
        # The longest prompt goes in first: the engine refuses a prompt for its length (and
        # the shared params), so if it is taken, the backlog's will be too.
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]["prompt_token_ids"]))
        order = [longest] + [i for i in range(len(prompts)) if i != longest]
        now, later = order[:self.group_quota], order[self.group_quota:]
        added = []
        try:
            for i in now:
                self._add_one(group, i, prompts[i], params, cache_salt)
                added.append(group.request_ids[i])
        except BaseException:
            for rid in added:
                self.engine.abort(rid)
                self._live.pop(rid, None)
                self._progress.pop(rid, None)
            raise
        group.params, group.cache_salt = params, cache_salt
        group.backlog.extend((i, prompts[i]) for i in later)
        self._backlogged += len(later)

    def _add_one(self, group: RequestGroup, i: int, prompt: dict, params: SamplingParams,
                 cache_salt: str | None) -> None:
        rid = group.request_ids[i]
        self.engine.add_request(prompt, params, request_id=rid, cache_salt=cache_salt)
        self._live[rid] = (group, i)
        self._progress[rid] = (len(prompt["prompt_token_ids"]), 0)

    def _feed(self, group: RequestGroup) -> None:
        """One of the group's prompts finished: the next from its backlog goes in."""
        if group.backlog:
            i, prompt = group.backlog.popleft()
            self._backlogged -= 1
            try:
                self._add_one(group, i, prompt, group.params, group.cache_salt)
            except ValueError as e:  # not expected: the longest was taken
                self._post(group, [e])

    def _abort(self, rid: str) -> None:
        if self._live.pop(rid, None) is None:
            return  # already finished
        aborted = self.engine.abort(rid)
        prompt_tokens, output_tokens = self._progress.pop(rid, (0, 0))
        if aborted:
            for obs in self.observers:
                obs.on_aborted(prompt_tokens, output_tokens)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        per_group: dict[RequestGroup, list] = {}
        for out in outputs:
            entry = self._live.get(out.request_id)
            if entry is None:
                continue
            group, index = entry
            per_group.setdefault(group, []).append((index, out))
            if out.finished:
                self._live.pop(out.request_id, None)
                self._progress.pop(out.request_id, None)
                self._feed(group)
                for obs in self.observers:
                    obs.on_finished(out)
            else:
                self._progress[out.request_id] = (
                    len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs))
        for group, items in per_group.items():
            self._post(group, items)

    def _post(self, group: RequestGroup, items: list) -> None:
        def deliver():
            for item in items:
                group._deliver(item)

        try:
            group.loop.call_soon_threadsafe(deliver)
        except Exception:  # noqa: BLE001 - the handler's event loop is closed
            pass

    def _fail_all(self, error: BaseException, refuse_queued: bool = False) -> None:
        groups = {g for g, _ in self._live.values()}
        for rid in list(self._live):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                log.exception("aborting %s", rid)
        self._live.clear()
        self._progress.clear()
        for group in groups:
            self._backlogged -= len(group.backlog)
            group.backlog.clear()
            self._post(group, [error])
        while refuse_queued:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, Answered) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(EngineDead(repr(error)))
