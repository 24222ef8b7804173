"""LLMEngine, the engine's front: add_request / abort / step over one model replica. It builds
the parts once (backend, runner, memory plan, scheduler, speculator) and keeps the request
table (requests.py); each step is the step pipeline's (step_pipeline.py: the scheduler plans,
the batch builder pads, the runner executes one jitted call, the output processor reads the
tokens and the scheduler applies them)."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import os
import threading
import time

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve import backends
from jaxserve.config import EngineConfig, ModelConfig, kv_slot_bytes
from jaxserve.core import kv_groups
from jaxserve.core.limits import RequestRejected
from jaxserve.core.lora import LoRARequest
from jaxserve.core.output_processor import OutputProcessor
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.structured_output import GrammarCompiler, StructuredOutputsParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.sequence import Request
from jaxserve.engine import memory_plan
from jaxserve.engine.assembly import PROBE_PAGES, Assembly
from jaxserve.engine.client import ServedModel
from jaxserve.engine.lora import LoRAAdapters
from jaxserve.engine.pooling import Pooler, pooling_spec
from jaxserve.engine.requests import RequestTable
from jaxserve.engine.speculator import Speculator, load_draft
from jaxserve.engine.startup import StartupTimeline
from jaxserve.engine.step_pipeline import StepPipeline
from jaxserve.engine.weight_update import WeightUpdates
from jaxserve.runtime import memory, sharding
from jaxserve.runtime.params import JNP_DTYPES
from jaxserve.runtime.pooling import PoolingRunner
from jaxserve.runtime.runner import ModelRunner
from jaxserve.tokenizer import tokenize_prompt
from jaxserve.weights import LoadedModel, load_model
from jaxserve.weights.pooling import pooling_only

Prompt = str | list[int] | dict
log = logging.getLogger("jaxserve.engine")
# Warm-up's compile threads: XLA compiles (and loads from the persistent cache) with the GIL
# released, so threads overlap; a background warm-up is ready once the steps of at most
# READY_TOKENS tokens are compiled (docs/serving.md: start-up).
COMPILE_THREADS = max(2, min(os.cpu_count() or 2, 8))
READY_TOKENS = 1


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 draft_loaded: LoadedModel | None = None, *, mesh: Mesh | None = None):
        """`loaded`: the target model (default: config.model, loaded); `draft_loaded`: the
        draft model of speculative method "draft" (default: its config's model, loaded; the
        target's own weights when that is None or the target's name); mesh: the replica's
        devices (sharding.replica_mesh), for a data-parallel front; default the first
        tensor_parallel_size devices."""
        self.startup = StartupTimeline()
        self.config = config  # as requested; what the engine resolves is self.resolved
        load, cache, parallel = config.load, config.cache, config.parallel
        dtype = backends.resolve_dtype(load.dtype)
        if loaded is None:
            with self.startup.phase("load the model"):
                loaded = load_model(load.model, dtype=dtype, lazy=True)
        self.model_config = loaded.config
        sharding.check_fits(loaded.config, parallel.tensor_parallel_size, load.quantization,
                            parallel.enable_expert_parallel)
        if mesh is None:
            if parallel.data_parallel_size > 1:
                raise ValueError("data_parallel_size > 1 is served by several engines: "
                                 "jaxserve.engine.make_engine builds them")
            mesh = sharding.replica_mesh(sharding.make_mesh(parallel.tensor_parallel_size), 0)
        self.tokenizer = loaded.tokenizer
        draft = load_draft(config, loaded, draft_loaded, dtype=dtype)
        # The backend, resolved config and buckets are decided once (assembly.py, as
        # `jaxserve compile` decides them for a TPU) and passed down as objects.
        assembly = Assembly.of(config, loaded.config, mesh.devices.flat[0].platform)
        self.backend = backend = assembly.backend
        self.resolved = resolved = assembly.resolved
        self.buckets = assembly.buckets
        self.max_model_len = resolved.max_model_len
        # LoRA adapters (engine/lora.py): their slots in every step, None: the plain step.
        self.lora = LoRAAdapters.of(config.lora, loaded.config, resolved.scan_layers,
                                    parallel.tensor_parallel_size)
        budget = memory_plan.budget(cache, parallel, jax.default_backend())
        if budget is not None:
            # An engine dropped just before (a notebook's previous LLM) may still hold its pool
            # in a reference cycle; freed during the plan, it would hide this engine's runtime.
            gc.collect()
        held_before = memory.in_use(mesh.devices.flat[0]) if budget is not None else 0
        # With a budget, a probe pool of PROBE_PAGES until the plan has measured the rest.
        num_pages = PROBE_PAGES if budget is not None else resolved.num_pages(
            config, self._pool_bytes_per_token(loaded.config)
            + (self._pool_bytes_per_token(draft.config) if draft else 0))
        # runner "pooling": embeddings, scores, classes (engine/pooling.py's Pooler)
        if load.runner == "generate" and pooling_only(loaded.source):
            raise ValueError(f"{pooling_only(loaded.source)} has no language-model head: "
                             "serve it with runner='pooling' (--runner=pooling)")
        self.pooler = (Pooler(pooling_spec(loaded, load), loaded.config.hidden_size)
                       if load.runner == "pooling" else None)
        runner_class = PoolingRunner if self.pooler else ModelRunner
        with self.startup.phase("place the weights"):
            self.runner = runner_class(loaded.config, loaded.params, num_pages=num_pages,
                                      page_size=cache.page_size, dtype=resolved.dtype,
                                      kv_cache_dtype=resolved.kv_cache_dtype,
                                      backend=backend, quantization=load.quantization,
                                      max_sample_rows=self.buckets.max_sample_rows,
                                      huge_pages=load.huge_pages, mesh=mesh,
                                      scan_layers=resolved.scan_layers,
                                      expert_parallel=parallel.enable_expert_parallel,
                                      fingerprint=loaded.fingerprint,
                                      logprobs_mode=load.logprobs_mode,
                                      **(self.lora.runner_options() if self.lora else {}))
        eos = tuple(sorted(set(loaded.config.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        # Speculation's one owner (Speculator.speculation), which the scheduler asks for drafts.
        self.speculator = Speculator(config, resolved, self.buckets, draft,
                                     num_pages=num_pages, backend=backend, mesh=mesh)
        self.memory_plan = None
        if budget is not None:
            drafter = self.speculator.drafter
            with self.startup.phase("plan memory"):
                self.memory_plan = memory_plan.plan(
                    self.runner, self.buckets, budget, held_before,
                    compiled_shapes=self.runner.warmup_count(self.buckets)
                    + self.speculator.warmup_count(),
                    draft=drafter.model if drafter else None)
            log.info("%s", self.memory_plan.describe(self.max_model_len))
        # The scheduler is built once, on the pool the plan sized.
        self.num_pages = self.runner.num_pages
        self.scheduler = Scheduler(
            config.scheduler, cache, max_model_len=self.max_model_len,
            eos_token_ids=eos, prefill_keys_per_token=resolved.prefill_keys_per_token,
            # A cached page is reused only under the weights and KV format that wrote it.
            model_fingerprint=(f"{loaded.fingerprint}:{resolved.dtype}:{load.quantization}:"
                               f"kv-{resolved.kv_cache_dtype}"),
            kv_window=loaded.config.kv_window, speculation=self.speculator.speculation,
            group_windows=kv_groups.groups_of(loaded.config).windows,
            num_pages=self.num_pages, lora=self.lora.slots if self.lora else None)
        self.outputs = OutputProcessor(self.tokenizer)
        self.requests = RequestTable(self.scheduler, self.outputs)
        self.pipeline = StepPipeline(
            self.buckets, self.scheduler, self.runner, self.speculator, self.outputs,
            self.requests, vocab_size=loaded.config.vocab_size, page_size=cache.page_size,
            async_scheduling=config.scheduler.async_scheduling,
            grammar_limits=lambda: self._grammars.limits if self._grammars else None,
            adapters=self.lora, pooler=self.pooler)
        # Structured outputs' grammars over this tokenizer and vocabulary (made on first use).
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        # Weights replaced in place, memory given back, pause (docs/rl.md).
        self.weights = WeightUpdates(self.runner, self.scheduler, self.requests, self.pipeline,
                                     loaded.config, resolved.dtype)
        self._eos_token_ids = eos
        self._ids = itertools.count()
        self._rng = np.random.default_rng(load.seed)
        self.startup.built()

    # ----------------------------------------------------------------- requests
    @property
    def served_model(self) -> ServedModel:
        """What a front end reads requests for (engine/client.py)."""
        return ServedModel(self.config.load.model, self.tokenizer, self.max_model_len,
                           self.model_config.vocab_size, self.config.cache.cache_salt,
                           tuple(self.lora.modules.values()) if self.lora else (),
                           pooling=self.pooler.spec if self.pooler else None,
                           hidden_size=self.model_config.hidden_size)

    def compile_grammar(self, spec: StructuredOutputsParams):
        """Admit a structured output's grammar from any thread (see `grammars`)."""
        return self.grammars.compile(spec)

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

    def share_grammars(self, other: "LLMEngine") -> None:
        """Use `other`'s grammar compiler and its cache (a data-parallel front's replicas: one
        tokenizer and vocabulary)."""
        with self._grammars_lock:
            self._grammars = other.grammars

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
                    cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> Request:
        """Queue a request. Raises ValueError (RequestRejected) at once if it can never run.
        cache_salt (default: the engine's) isolates prefix-cache sharing per tenant.
        lora_request: the LoRA adapter it runs under (enable_lora; read on first use), or the
        prompt dict's "lora_request" (how a server's request names one)."""
        if lora_request is None and isinstance(prompt, dict):
            lora_request = prompt.get("lora_request")
        if lora_request is not None and self.lora is None:
            raise ValueError("lora_request needs an engine with enable_lora=True")
        self.weights.check_awake()
        text, ids = self.tokenize(prompt)
        if self.pooler is not None:  # a prompt to pool: prefilled, nothing sampled
            params = self.pooler.request_params(params)
        params = dataclasses.replace(params or SamplingParams())
        grammar = self.check_params(params)
        if params.seed is None:  # unseeded: a fresh seed per request, fixed for its lifetime
            params.seed = int(self._rng.integers(0, 2**31 - 1))
        request = Request(request_id=request_id or f"req-{next(self._ids)}", prompt_token_ids=ids,
                          sampling_params=params, priority=params.priority,
                          cache_salt=(cache_salt if cache_salt is not None
                                      else self.config.cache.cache_salt))
        request.grammar = grammar
        if lora_request is not None:
            self.lora.attach(request, lora_request, self.scheduler.live)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add_request(request)
        self.requests.add(request, text)
        return request

    def abort(self, request_id: str) -> bool:
        self.requests.remove(request_id)
        if self.pooler is not None:
            self.pooler.drop(request_id)
        aborted = self.scheduler.abort(request_id)
        if not self.scheduler.has_unfinished():
            self.pipeline.drain()
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
        salt = cache_salt if cache_salt is not None else self.config.cache.cache_salt
        return cache is not None and bool(cache.lookup(token_ids, salt, max_pages=1)[0])

    # ----------------------------------------------------------------- the step
    def step(self) -> list[RequestOutput]:
        """Run one iteration (StepPipeline: plan, build, dispatch, sample, fetch, apply); returns
        a snapshot of every request that progressed or failed; nothing while paused."""
        return [] if self.weights.paused else self.pipeline.step()

    # ----------------------------------------------------------------- weights (docs/rl.md)
    def update_weights(self, weights, in_flight: str = "finish") -> list[RequestOutput]:
        """Replace the weights in place, without compiling: (name, array) pairs in the
        checkpoint's Hugging Face names and layout (whole layers, or all), or a tree like
        params_like(). The requests in the engine finish first under the old weights
        (in_flight="finish") or fail ("abort"): returns the outputs that made. The prefix cache
        is forgotten; later outputs carry weights_version + 1."""
        return self.weights.update(weights, in_flight)

    def params_like(self) -> dict:
        """The step's params as jax.ShapeDtypeStruct (shapes, dtypes, shardings)."""
        return self.runner.params_like()

    @property
    def weights_version(self) -> int:
        return self.runner.weights_version

    @property
    def is_paused(self) -> bool:
        return self.weights.paused

    @property
    def is_sleeping(self) -> bool:
        """Whether sleep() released the pool or the weights and they are not back yet."""
        return self.weights.asleep

    def pause(self) -> None:
        """No new step starts until resume() (requests stay where they are)."""
        self.weights.pause(True)

    def resume(self) -> None:
        self.weights.pause(False)

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool (level 1) and the weights too (level 2); nothing may be in flight."""
        self.weights.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """The pool again; weights freed by sleep(level=2) come back by update_weights."""
        self.weights.wake_up(tags)

    def reset_prefix_cache(self) -> None:
        self.weights.forget_prefixes()

    # ----------------------------------------------------------------- compilation
    def warmup(self, full: bool = False, *, background: bool = False,
               compile_threads: int = COMPILE_THREADS,
               ready_tokens: int = READY_TOKENS) -> dict:
        """Compile step shapes before traffic arrives (Buckets.step_shapes: every shape of a
        packed backend; otherwise every decode-only and prefill-only bucket, and with full=True
        every combination the scheduler can produce), their sampling calls and the
        copy-on-write copies, in `compile_threads` threads. With background=True it returns
        once the steps of at most `ready_tokens` tokens are in; the rest compile on in the
        background, and a step that needs one of them waits for it (stats():
        compilations_pending). No request state changes. Returns counts and seconds."""
        t0, before = time.perf_counter(), self.compilations
        shapes = self.runner.warmup(self.buckets, full, on_shape=self.startup.shape_timer(),
                                    threads=compile_threads,
                                    first_tokens=ready_tokens if background else None,
                                    on_done=self.startup.all_compiled)
        if self.speculator.warmup_count():
            with self.startup.phase("compile the draft model's calls"):
                shapes += self.speculator.warmup()
        seconds = time.perf_counter() - t0
        self.startup.ready(seconds)
        return {"shapes": shapes, "compilations": self.compilations - before, "seconds": seconds,
                "compilations_pending": self.runner.compilations_pending}

    # ----------------------------------------------------------------- introspection
    @property
    def compilations(self) -> int:
        """Shapes compiled: the step's, and the draft model's calls."""
        return self.runner.compilations + self.speculator.compilations

    @property
    def compilations_pending(self) -> int:
        """Warm-up's compiles queued or running (read from any thread: /health/ready asks)."""
        return self.runner.compilations_pending

    def kv_usage(self) -> dict:
        """The KV pool right now (KVManager.usage), with the bytes one slot holds."""
        return {**self.scheduler.kv_usage(),
                "bytes_per_slot": self._pool_bytes_per_token(self.model_config)}

    def _pool_bytes_per_token(self, model: ModelConfig) -> int:
        """One token's KV bytes in this backend's pool layout (padded heads included)."""
        r, tp = self.resolved, self.config.parallel.tensor_parallel_size
        return sharding.pool_bytes_per_token(
            model, self.backend, tp, JNP_DTYPES[r.kv_cache_dtype], JNP_DTYPES[r.dtype],
            *kv_slot_bytes(r.kv_cache_dtype))

    def stats(self) -> dict:
        stats = dict(self.scheduler.stats())
        stats.update(compilations=self.compilations,
                     compilations_pending=self.compilations_pending,
                     **self.pipeline.stats(),
                     **self.startup.stats(),
                     activation_peak_bytes=(self.memory_plan.activation_peak_bytes
                                            if self.memory_plan else None),
                     tensor_parallel_size=self.config.parallel.tensor_parallel_size,
                     **self.runner.memory_stats())
        stats.update(self.speculator.stats())
        return stats

    # ----------------------------------------------------------------- LoRA adapters at runtime
    def _adapters(self) -> LoRAAdapters:
        if self.lora is None:
            raise ValueError("LoRA adapters need an engine with enable_lora=True")
        return self.lora

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter now (read from its directory: ValueError or OSError naming what
        is not served); False if its lora_int_id was registered already."""
        return self._adapters().add_lora(lora_request, self.scheduler.live)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter; False if unknown. Requests under it finish with it; its slot
        is freed once none is left."""
        return self._adapters().remove_lora(lora_int_id, self.scheduler.live)

    def list_loras(self) -> set[int]:
        """The registered adapters' lora_int_ids."""
        return self._adapters().list_loras(self.scheduler.live)


__all__ = ["LLMEngine", "RequestRejected"]
