"""LLMEngine, the engine's front: add_request / abort / step over one model replica. It keeps
the parts built once (assembly.py's EngineParts: backend, runner, memory plan, scheduler,
speculator, the request table of requests.py); each step is the step pipeline's
(step_pipeline.py: the scheduler plans, the batch builder pads, the runner executes one jitted
call, the output processor reads the tokens and the scheduler applies them)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time

import numpy as np
from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.core.limits import RequestRejected
from jaxserve.core.lora import LoRARequest
from jaxserve.core.outputs import RequestOutput
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.structured_output import GrammarCompiler, StructuredOutputsParams
from jaxserve.core.sequence import Request
from jaxserve.engine.assembly import EngineParts, pool_bytes_per_token
from jaxserve.engine.client import ServedModel
from jaxserve.engine.lora import LoRAAdapters
from jaxserve.tokenizer import tokenize_prompt
from jaxserve.weights import LoadedModel

Prompt = str | list[int] | dict
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
        self.config = config  # as requested; what the engine resolves is self.resolved
        # Structured outputs' grammars over this tokenizer and vocabulary (made on first use).
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        # Resolved, loaded, placed, planned and wired once (assembly.py); each part is kept as
        # the attribute of its name (self.runner, self.scheduler, self.pipeline, ...).
        parts = EngineParts.build(
            config, loaded, draft_loaded, mesh=mesh,
            grammar_limits=lambda: self._grammars.limits if self._grammars else None)
        for part in dataclasses.fields(parts):
            setattr(self, part.name, getattr(parts, part.name))
        self._ids = itertools.count()
        self._rng = np.random.default_rng(config.load.seed)
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
                                                 self.eos_token_ids)
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
                "bytes_per_slot": pool_bytes_per_token(
                    self.model_config, self.backend, self.resolved,
                    self.config.parallel.tensor_parallel_size)}

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
