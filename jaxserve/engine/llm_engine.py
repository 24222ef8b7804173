"""LLMEngine: add_request / abort / step. Each step: the scheduler plans, the batch builder pads,
the runner executes one jitted call, the output processor reads the tokens and the scheduler
applies them."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import threading
import time

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve import backends
from jaxserve.config import EngineConfig
from jaxserve.core.limits import RequestRejected
from jaxserve.core.output_processor import OutputProcessor
from jaxserve.core.outputs import RequestMetrics, RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.structured_output import GrammarCompiler, grammar_error
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import Request
from jaxserve.core.step_plan import StepPlan
from jaxserve.engine import memory_plan
from jaxserve.engine.in_flight import Launched, StepFailed
from jaxserve.engine.speculator import Speculator, load_draft
from jaxserve.runtime import memory, sharding
from jaxserve.runtime.batch import build_batch, page_copies
from jaxserve.runtime.buckets import Buckets
from jaxserve.runtime.distributed import PeerLostError
from jaxserve.runtime.logit_controls import step_controls
from jaxserve.runtime.runner import ModelRunner
from jaxserve.tokenizer import tokenize_prompt
from jaxserve.weights import LoadedModel, load_model

Prompt = str | list[int] | dict
log = logging.getLogger("jaxserve.engine")
PROBE_PAGES = 2


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 draft_loaded: LoadedModel | None = None, *, mesh: Mesh | None = None):
        """`loaded`: the target model (default: config.model, loaded); `draft_loaded`: the
        draft model of speculative method "draft" (default: its config's model, loaded; the
        target's own weights when that is None or the target's name); mesh: the replica's
        devices (sharding.replica_mesh), for a data-parallel front; default the first
        tensor_parallel_size devices."""
        config = dataclasses.replace(config, dtype=backends.resolve_dtype(config.dtype))
        config = dataclasses.replace(config, kv_cache_dtype=config.resolved_kv_cache_dtype)
        self.config = config
        loaded = loaded or load_model(config.model, dtype=config.dtype, lazy=True)
        self.model_config = loaded.config
        sharding.check_fits(loaded.config, config.tensor_parallel_size, config.quantization)
        if mesh is None:
            if config.data_parallel_size > 1:
                raise ValueError("data_parallel_size > 1 is served by several engines: "
                                 "jaxserve.engine.make_engine builds them")
            mesh = sharding.replica_mesh(sharding.make_mesh(config.tensor_parallel_size), 0)
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        draft = load_draft(config, loaded, draft_loaded)
        # The backend is chosen here, once, and passed down as an object.
        self.backend = backend = backends.get(backends.resolve(
            config.attention_backend, config.dtype, config.quantization,
            kv_cache_dtype=config.kv_cache_dtype,
            pallas_kernels=config.pallas_kernels, head_dim=loaded.config.head_dim,
            page_size=config.page_size, tensor_parallel_size=config.tensor_parallel_size))
        config = dataclasses.replace(config, prefill_keys_per_token=(
            config.resolved_prefill_keys_per_token(loaded.config, backend.attention_cost)))
        self.config = config
        self.buckets = Buckets.for_engine(
            config.max_num_seqs, config.max_num_batched_tokens,
            math.ceil(self.max_model_len / config.page_size),
            query_block=backend.query_block, packed=backend.packed,
            spec_tokens=(config.speculative_config.num_speculative_tokens
                         if config.speculative_config else 0))
        budget = memory_plan.budget(config, jax.default_backend())
        held_before = memory.in_use(mesh.devices.flat[0]) if budget is not None else 0
        # With a budget, a probe pool of PROBE_PAGES until the plan has measured the rest.
        num_pages = PROBE_PAGES if budget is not None else config.resolve_num_pages(
            loaded.config, self.max_model_len, draft=draft.config if draft else None)
        self.runner = ModelRunner(loaded.config, loaded.params, num_pages=num_pages,
                                  page_size=config.page_size, dtype=config.dtype,
                                  kv_cache_dtype=config.kv_cache_dtype,
                                  backend=backend, quantization=config.quantization,
                                  max_sample_rows=self.buckets.max_sample_rows,
                                  huge_pages=config.huge_pages, mesh=mesh)
        eos = tuple(sorted(set(loaded.config.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        scheduler = functools.partial(
            Scheduler, config, max_model_len=self.max_model_len, eos_token_ids=eos,
            # A cached page is reused only under the weights and KV format that wrote it.
            model_fingerprint=(f"{loaded.fingerprint}:{config.dtype}:{config.quantization}:"
                               f"kv-{config.kv_cache_dtype}"),
            kv_window=loaded.config.kv_window)
        self.scheduler = scheduler(num_pages=num_pages)
        self.speculator = Speculator(config, self.scheduler, self.buckets, draft,
                                     num_pages=num_pages, backend=backend, mesh=mesh)
        self.memory_plan = None
        if budget is not None:
            drafter = self.speculator.drafter
            self.memory_plan = memory_plan.plan(
                self.runner, self.buckets, budget, held_before,
                compiled_shapes=self.runner.warmup_count(self.buckets)
                + self.speculator.warmup_count(),
                draft=drafter.model if drafter else None)
            log.info("%s", self.memory_plan.describe(self.max_model_len))
            self.scheduler = scheduler(num_pages=self.runner.num_pages)  # the planned pool
            self.speculator.attach(self.scheduler)
        self.num_pages = self.runner.num_pages
        self._in_flight: Launched | None = None  # the step on the device, not yet fetched
        self._unapplied: list[StepPlan] = []  # plans launched and not yet applied
        self._failed: list[Request] = []  # failed on their own since the last step() returned
        self.outputs = OutputProcessor(self.tokenizer)
        # Structured outputs' grammars over this tokenizer and vocabulary (made on first use).
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._eos_token_ids = eos
        self._requests: dict[str, tuple[Request, str | None]] = {}
        self._ids = itertools.count()
        self._rng = np.random.default_rng(config.seed)
        self.num_steps = 0
        # Wall time of step() split into host work (schedule, build, dispatch, outputs) and waiting
        # for the device; host_overlapped_seconds is the host work done while a step ran.
        self.host_seconds = 0.0
        self.host_overlapped_seconds = 0.0
        self.device_seconds = 0.0

    # ----------------------------------------------------------------- requests
    @property
    def grammars(self) -> GrammarCompiler:
        """Thread-safe: a server admits (compiles, first mask, limits) a request's grammar in a
        worker thread before add_request, which then finds it cached."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.backend.to_str(),
                                                 self.model_config.vocab_size,
                                                 self._eos_token_ids)
        return self._grammars

    def check_params(self, params: SamplingParams):
        """ValueError unless the model can honour params: logit_bias ids within the vocabulary,
        a structured output the matcher can serve (GrammarCompiler.compile: valid, matches
        some output, within the limits at its first token). Returns the grammar (or None)."""
        vocab = self.model_config.vocab_size
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids must be below the vocabulary size {vocab}, "
                             f"got {bad[:5]}")
        spec = params.structured_outputs
        return None if spec is None else self.grammars.compile(spec)

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt, self.model_config.vocab_size)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, *,
                    request_id: str | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None) -> Request:
        """Queue a request. Raises ValueError (RequestRejected) at once if it can never run.
        cache_salt (default: the engine's) isolates prefix-cache sharing per tenant."""
        text, ids = self.tokenize(prompt)
        params = dataclasses.replace(params or SamplingParams())
        grammar = self.check_params(params)
        if params.seed is None:  # unseeded: a fresh seed per request, fixed for its lifetime
            params.seed = int(self._rng.integers(0, 2**31 - 1))
        request = Request(request_id=request_id or f"req-{next(self._ids)}", prompt_token_ids=ids,
                          sampling_params=params, priority=params.priority,
                          cache_salt=cache_salt if cache_salt is not None else self.config.cache_salt)
        request.grammar = grammar
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add_request(request)
        self._requests[request.request_id] = (request, text)
        return request

    def abort(self, request_id: str) -> bool:
        entry = self._requests.pop(request_id, None)
        aborted = self.scheduler.abort(request_id)
        if entry is not None:
            self.outputs.release(entry[0])
        if not self.scheduler.has_unfinished():
            try:
                self._settle()
            except StepFailed as e:
                self._recover(e)
        return aborted

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def follow(self) -> int:
        """Process k > 0 of several: run process 0's steps on this process's devices until
        process 0 calls stop_followers(); returns the steps run."""
        return self.runner.follow()

    def stop_followers(self) -> None:
        self.runner.stop_followers()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def caches_first_page(self, token_ids: list[int], cache_salt: str | None = None) -> bool:
        """Whether the prefix cache holds the first full page of token_ids (under the salt, the
        engine's by default): a data-parallel router's affinity."""
        cache = self.scheduler.cache
        salt = cache_salt if cache_salt is not None else self.config.cache_salt
        return cache is not None and bool(cache.lookup(token_ids, salt, max_pages=1)[0])

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns a snapshot of every request that progressed or failed.

        With async_scheduling the next step is planned and launched before this one's tokens are
        read back (Scheduler.schedule_next: when nothing waits and every running sequence
        decodes), so the host's planning, batch building and dispatch overlap the device.

        A request whose own row cannot be built or processed fails alone (finish_reason
        "error", RequestOutput.error). A failing device step fails the requests whose KV it
        held, and the engine goes on with a fresh pool (`_recover`)."""
        try:
            results = self._step()
        except StepFailed as e:
            self._recover(e)
            results = []
        if self._failed:
            results += self._snapshots(self._failed, time.monotonic())
            self._failed = []
        return results

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self._in_flight is None:
            self.speculator.choose()
            plan = self.scheduler.schedule()
            if plan.is_empty:  # still reported: requests schedule() finished (outgrew the pool)
                return self._snapshots(self.scheduler.update(plan, []), time.monotonic())
            self._in_flight = self._launch(plan)
        t_launched = time.perf_counter()
        current = self._in_flight
        self._in_flight = None
        if self.config.async_scheduling and not self.speculator.choose():
            plan = self.scheduler.schedule_next(current.plan)
            if plan is not None:
                self._in_flight = self._launch(plan, after=current.out)
        t1 = time.perf_counter()
        out = self._fetch(current)
        t2 = time.perf_counter()
        results = self._apply(current, out)
        if self._in_flight is not None and self._in_flight.unsampled is not None:
            self._sample(self._in_flight)  # its controls follow from the tokens just applied
        ahead = self._in_flight is not None
        if ahead and not self.scheduler.has_unfinished():
            self._settle()  # everything it computes was finished meanwhile: drop it now
        t3 = time.perf_counter()
        self.speculator.observe(current, t0, t3)
        # Host work while a step ran on the device overlapped it: planning the next step while
        # `current` ran, and applying `current` while the next one runs.
        self.host_seconds += (t1 - t0) + (t3 - t2)
        self.host_overlapped_seconds += (t1 - t_launched) + ((t3 - t2) if ahead else 0.0)
        self.device_seconds += t2 - t1
        return results

    def _controls(self, plan: StepPlan, num_rows: int):
        return step_controls(plan, num_rows, self.model_config.vocab_size)

    def _build(self, plan: StepPlan, ahead: bool = False):
        """The plan's padded batch, real sample rows, chunk offsets and logit controls. A plan
        made `ahead` of the previous step's tokens with a row whose controls depend on them
        (a grammar, penalties) has its controls built later (controls "later")."""
        batch, num_rows, offsets = build_batch(plan, self.buckets, self.config.page_size)
        if ahead and any(seq.sampling_params.needs_previous_token for _, seq in plan.sample_rows):
            return batch, num_rows, offsets, "later"
        return batch, num_rows, offsets, self._controls(plan, batch.logits_indices.shape[0])

    def _launch(self, plan: StepPlan, after=None) -> Launched:
        """Build and dispatch a plan. Planned ahead of the previous step's read-back with rows
        whose controls need that step's tokens, only its forward pass goes out now: its
        sampling follows once those tokens are applied (`_sample`), so the device computes the
        forward pass while the host reads the previous step and fills the masks."""
        self._unapplied.append(plan)
        ahead = after is not None
        try:
            catch_up = self.speculator.propose(plan)
        except Exception as e:  # noqa: BLE001 - the draft pool was donated to the failed call
            raise StepFailed(f"the draft model's step failed: {e!r}") from e
        try:
            batch, num_rows, offsets, controls = self._build(plan, ahead)
        except Exception as e:  # noqa: BLE001 - a row's values: fail its request, keep the step
            self._fail_unbuildable(plan, e)
            batch, num_rows, offsets, controls = self._build(plan, ahead)
        later = isinstance(controls, str)
        copies = page_copies(plan.copies, self.buckets) if plan.copies else None
        try:
            out = self.runner.dispatch(batch, copies, after, None if later else controls,
                                       sample=not later)
        except PeerLostError:  # another process is gone: nothing to recover here
            raise
        except Exception as e:  # noqa: BLE001
            raise StepFailed(f"the device step failed: {e!r}") from e
        return Launched(plan, out, num_rows, offsets, catch_up,
                         unsampled=batch if later else None,
                        verifying=self.scheduler.spec_k > 0)

    def _sample(self, launched: Launched) -> None:
        """Launch the deferred sampling of a step with its controls, now that the tokens before
        it are applied; a request whose controls cannot be built fails alone."""
        batch, launched.unsampled = launched.unsampled, None
        r = batch.logits_indices.shape[0]
        try:
            controls = self._controls(launched.plan, r)
        except Exception as e:  # noqa: BLE001
            self._fail_unbuildable(launched.plan, e)
            controls = self._controls(launched.plan, r)
        try:
            self.runner.sample(launched.out, batch.sampling, controls)
        except PeerLostError:
            raise
        except Exception as e:  # noqa: BLE001
            raise StepFailed(f"the device step failed: {e!r}") from e

    def _fetch(self, launched: Launched):
        if launched.unsampled is not None:
            self._sample(launched)
        try:
            return self.runner.fetch(launched.out, launched.num_rows)
        except Exception as e:  # noqa: BLE001
            raise StepFailed(f"the device step failed: {e!r}") from e

    def _fail(self, request_id: str, error: str) -> None:
        entry = self._requests.get(request_id)
        if self.scheduler.abort(request_id, error) and entry is not None:
            log.warning("request %s failed: %s", request_id, error)
            self._failed.append(entry[0])

    def _fail_unbuildable(self, plan: StepPlan, error: Exception) -> None:
        """build_batch raised: fail the requests whose chunks fail alone (their rows are then
        padding, build_batch skips finished sequences); StepFailed if none does."""
        culprits = []
        for chunk in plan.chunks:
            try:
                self._build(StepPlan(chunks=[chunk]))
            except Exception as e:  # noqa: BLE001
                culprits.append((chunk.seq.request.request_id, e))
        if not culprits:
            raise StepFailed(f"building the step's batch failed: {error!r}") from error
        for request_id, e in culprits:
            self._fail(request_id, f"building its batch row failed: {e!r}")

    def _recover(self, failure: StepFailed) -> None:
        """After a failed step: every request whose KV was in the pool fails with the cause,
        plans in flight are applied with their tokens dropped, and the runner gets a fresh pool
        (the prefix cache is emptied with it: the pool donated to a failed step is gone)."""
        cause = str(failure)
        log.error("%s; failing the running requests and starting a fresh KV pool "
                  "(the prefix cache is emptied)", cause)
        failed = self.scheduler.drop_kv(cause)
        self._failed += [r for r in failed if r.request_id in self._requests]
        for plan in self._unapplied:
            self.scheduler.update(plan, [0] * len(plan.sample_rows))
        self._unapplied, self._in_flight = [], None
        self.runner.reset_pool()
        self.speculator.reset()

    def _apply(self, launched: Launched, out) -> list[RequestOutput]:
        """The output processor reads the step's rows first (logprobs, text, stop strings), then
        the scheduler applies them with the stop strings found."""
        plan = launched.plan
        self._unapplied.remove(plan)
        errors = {}
        if out.prompt_logprobs is not None:
            errors = self.outputs.record_prompt_logprobs(plan, launched.offsets, out)
        now = time.monotonic()
        tokens = [int(t) for t in out.token_ids]
        stops, row_errors = self.outputs.process(self.scheduler.accepted_rows(plan, tokens), out,
                                                 now)
        for request_id, error in {**errors, **row_errors}.items():
            self._fail(request_id, error)
        changed = self.scheduler.update(plan, tokens, stops)
        self.num_steps += 1
        results = self._snapshots(changed, now)
        self._fail_broken_grammars(plan)
        return results

    def _fail_broken_grammars(self, plan: StepPlan) -> None:
        """A sequence whose matcher erred on the token just applied (a grammar limit hit
        mid-generation) fails its request alone, before a mask is filled from that state."""
        if self._grammars is None:  # no grammar yet
            return
        for _, seq in plan.sample_rows:
            error = None if seq.is_finished else grammar_error(seq, self._grammars.limits)
            if error is not None:
                self._fail(seq.request.request_id, error)

    def _settle(self) -> None:
        """Read back and apply the step in flight, if any (its sequences are all finished or
        aborted, so its tokens are dropped): afterwards no plan is outstanding."""
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            self._apply(launched, self._fetch(launched))

    def _snapshots(self, changed: list[Request], now: float) -> list[RequestOutput]:
        results = []
        for request in changed:
            if request.is_finished and request.finished_time is None:
                request.finished_time = now
            entry = self._requests.get(request.request_id)
            try:
                results.append(self.outputs.snapshot(request, entry[1] if entry else None))
            except Exception as e:  # noqa: BLE001 - fails this request alone
                self.scheduler.abort(request.request_id, f"building its output failed: {e!r}")
                results.append(RequestOutput(
                    request.request_id, None, list(request.prompt_token_ids), [], finished=True,
                    metrics=RequestMetrics(request.arrival_time), error=request.error))
            if request.is_finished:
                self._requests.pop(request.request_id, None)
                self.outputs.release(request)
        return results

    # ----------------------------------------------------------------- compilation
    def warmup(self, full: bool = False) -> dict:
        """Compile step shapes before traffic arrives (Buckets.step_shapes: every shape of a
        packed backend; otherwise every decode-only and prefill-only bucket, and with full=True
        every combination the scheduler can produce) and the copy-on-write copies. No request
        state changes. Returns counts and seconds."""
        t0, before = time.perf_counter(), self.compilations
        shapes = self.runner.warmup(self.buckets, full)
        shapes += self.speculator.warmup()
        return {"shapes": shapes, "compilations": self.compilations - before,
                "seconds": time.perf_counter() - t0}

    # ----------------------------------------------------------------- introspection
    @property
    def compilations(self) -> int:
        """Shapes compiled: the step's, and the draft model's calls."""
        return self.runner.compilations + self.speculator.compilations

    def kv_usage(self) -> dict:
        """The KV pool right now (KVManager.usage), with the bytes one slot holds."""
        return {**self.scheduler.kv_usage(),
                "bytes_per_slot": self.config.kv_bytes_per_token(self.model_config)}

    def stats(self) -> dict:
        stats = dict(self.scheduler.stats())
        stats.update(compilations=self.compilations, steps=self.num_steps,
                     host_seconds=self.host_seconds, device_seconds=self.device_seconds,
                     host_overlapped_seconds=self.host_overlapped_seconds,
                     activation_peak_bytes=(self.memory_plan.activation_peak_bytes
                                            if self.memory_plan else None),
                     tensor_parallel_size=self.config.tensor_parallel_size,
                     **self.runner.memory_stats())
        stats.update(self.speculator.stats())
        return stats


__all__ = ["LLMEngine", "RequestRejected"]
