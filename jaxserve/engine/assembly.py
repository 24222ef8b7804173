"""What an engine is made of, decided once from its config, its model's config and the platform
it serves on, before any device is touched (`Assembly.of`: the attention backend, the resolved
config (dtype, KV dtype, max_model_len, scan_layers, ...) and the step buckets), and the parts
built from that on this host (`EngineParts.build`: the weights placed, the memory plan, the
runner, speculator, scheduler and step pipeline), which LLMEngine keeps. `jaxserve compile`
(aot.py) compiles the same Assembly for a TPU topology from any host, so the two cannot resolve
a config differently."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import math
from typing import Callable

import jax
from jax.sharding import Mesh

from jaxserve import backends
from jaxserve.config import EngineConfig, ModelConfig, ResolvedConfig, kv_slot_bytes
from jaxserve.config.resolved import resolve_kv_cache_dtype
from jaxserve.core import kv_groups
from jaxserve.core.output_processor import OutputProcessor
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine import memory_plan
from jaxserve.engine.lora import LoRAAdapters
from jaxserve.engine.memory_plan import MemoryPlan
from jaxserve.engine.pooling import Pooler, pooling_spec
from jaxserve.engine.requests import RequestTable
from jaxserve.engine.speculator import Speculator, load_draft
from jaxserve.engine.startup import StartupTimeline
from jaxserve.engine.step_pipeline import StepPipeline
from jaxserve.engine.weight_update import WeightUpdates
from jaxserve.runtime import memory, sharding
from jaxserve.runtime.buckets import Buckets
from jaxserve.runtime.params import JNP_DTYPES
from jaxserve.runtime.pooling import PoolingRunner
from jaxserve.runtime.runner import ModelRunner
from jaxserve.tokenizer import Tokenizer
from jaxserve.weights import LoadedModel, load_model
from jaxserve.weights.pooling import pooling_only

log = logging.getLogger("jaxserve.engine")

# The KV pool a memory plan measures the engine on before it sizes the real one.
PROBE_PAGES = 2


@dataclasses.dataclass(frozen=True)
class Assembly:
    backend: backends.Backend
    resolved: ResolvedConfig
    buckets: Buckets

    @classmethod
    def of(cls, config: EngineConfig, model: ModelConfig, platform: str) -> "Assembly":
        """config for `model` on `platform` ("cpu", "gpu", "tpu"); ValueError for what that
        platform's engine would refuse."""
        load, cache, parallel = config.load, config.cache, config.parallel
        dtype = backends.resolve_dtype(load.dtype, platform)
        tp = parallel.tensor_parallel_size
        backend = backends.get(backends.resolve(
            load.attention_backend, dtype, load.quantization,
            kv_cache_dtype=resolve_kv_cache_dtype(cache.kv_cache_dtype, dtype),
            pallas_kernels=load.pallas_kernels, head_dim=model.head_dim,
            page_size=cache.page_size, tensor_parallel_size=tp, platform=platform))
        if load.batch_invariant:  # reductions in a fixed order (model/batch_invariant.py)
            backend = backends.batch_invariant(backend, model, tp)
        resolved = ResolvedConfig.of(config, model, dtype=dtype, backend=backend.name,
                                     attention_cost=backend.attention_cost, platform=platform)
        spec = config.speculative
        buckets = Buckets.for_engine(
            config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
            math.ceil(resolved.max_model_len / cache.page_size),
            query_block=backend.query_block, packed=backend.packed,
            spec_tokens=spec.num_speculative_tokens if spec else 0)
        if config.lora.enable_lora:  # every step carries each token's adapter slot
            buckets = dataclasses.replace(buckets, lora=True)
        return cls(backend, resolved, buckets)


def pool_bytes_per_token(model: ModelConfig, backend: backends.Backend,
                         resolved: ResolvedConfig, tensor_parallel_size: int) -> int:
    """One token's KV bytes of `model` in this backend's pool layout (padded heads included)."""
    r = resolved
    return sharding.pool_bytes_per_token(
        model, backend, tensor_parallel_size, JNP_DTYPES[r.kv_cache_dtype], JNP_DTYPES[r.dtype],
        *kv_slot_bytes(r.kv_cache_dtype))


@dataclasses.dataclass(frozen=True)
class EngineParts:
    """An LLMEngine's parts, built once on this host; the engine keeps each as its attribute of
    the same name."""

    startup: StartupTimeline
    model_config: ModelConfig
    tokenizer: Tokenizer
    backend: backends.Backend
    resolved: ResolvedConfig
    buckets: Buckets
    max_model_len: int
    lora: LoRAAdapters | None  # their slots in every step; None: the plain step
    pooler: Pooler | None  # runner "pooling": embeddings, scores, classes
    runner: ModelRunner
    speculator: Speculator  # speculation's one owner, which the scheduler asks for drafts
    memory_plan: MemoryPlan | None  # None: no budget, the pool sized from the config
    num_pages: int  # the pool's, as the plan sized it
    scheduler: Scheduler
    outputs: OutputProcessor
    requests: RequestTable
    pipeline: StepPipeline
    weights: WeightUpdates  # weights replaced in place, memory given back, pause (docs/rl.md)
    eos_token_ids: tuple[int, ...]  # the model's and the tokenizer's

    @classmethod
    def build(cls, config: EngineConfig, loaded: LoadedModel | None = None,
              draft_loaded: LoadedModel | None = None, *, mesh: Mesh | None = None,
              grammar_limits: Callable = lambda: None) -> "EngineParts":
        """The parts of an engine for `config` (LLMEngine's arguments; grammar_limits: the
        structured outputs' limits, which the step pipeline reads each step), each start-up
        phase timed on the returned `startup`."""
        startup = StartupTimeline()
        load, cache, parallel = config.load, config.cache, config.parallel
        dtype = backends.resolve_dtype(load.dtype)
        if loaded is None:
            with startup.phase("load the model"):
                loaded = load_model(load.model, dtype=dtype, lazy=True)
        model = loaded.config
        sharding.check_fits(model, parallel.tensor_parallel_size, load.quantization,
                            parallel.enable_expert_parallel)
        if mesh is None:
            if parallel.data_parallel_size > 1:
                raise ValueError("data_parallel_size > 1 is served by several engines: "
                                 "jaxserve.engine.make_engine builds them")
            mesh = sharding.replica_mesh(sharding.make_mesh(parallel.tensor_parallel_size), 0)
        draft = load_draft(config, loaded, draft_loaded, dtype=dtype)
        assembly = Assembly.of(config, model, mesh.devices.flat[0].platform)
        backend, resolved, buckets = assembly.backend, assembly.resolved, assembly.buckets
        lora = LoRAAdapters.of(config.lora, model, resolved.scan_layers,
                               parallel.tensor_parallel_size)
        budget = memory_plan.budget(cache, parallel, jax.default_backend())
        if budget is not None:
            # An engine dropped just before (a notebook's previous LLM) may still hold its pool
            # in a reference cycle; freed during the plan, it would hide this engine's runtime.
            gc.collect()
        held_before = memory.in_use(mesh.devices.flat[0]) if budget is not None else 0
        # With a budget, a probe pool of PROBE_PAGES until the plan has measured the rest.
        token_bytes = functools.partial(pool_bytes_per_token, backend=backend, resolved=resolved,
                                        tensor_parallel_size=parallel.tensor_parallel_size)
        num_pages = PROBE_PAGES if budget is not None else resolved.num_pages(
            config, token_bytes(model) + (token_bytes(draft.config) if draft else 0))
        if load.runner == "generate" and pooling_only(loaded.source):
            raise ValueError(f"{pooling_only(loaded.source)} has no language-model head: "
                             "serve it with runner='pooling' (--runner=pooling)")
        pooler = (Pooler(pooling_spec(loaded, load), model.hidden_size)
                  if load.runner == "pooling" else None)
        if pooler and lora:  # the pooling step takes no adapter stack
            raise ValueError("enable_lora serves runner='generate' only; runner='pooling' "
                             "takes no LoRA adapters yet")
        with startup.phase("place the weights"):
            runner = (PoolingRunner if pooler else ModelRunner)(
                model, loaded.params, num_pages=num_pages, page_size=cache.page_size,
                dtype=resolved.dtype, kv_cache_dtype=resolved.kv_cache_dtype, backend=backend,
                quantization=load.quantization, max_sample_rows=buckets.max_sample_rows,
                huge_pages=load.huge_pages, mesh=mesh, scan_layers=resolved.scan_layers,
                expert_parallel=parallel.enable_expert_parallel, fingerprint=loaded.fingerprint,
                logprobs_mode=load.logprobs_mode, **(lora.runner_options() if lora else {}))
        eos = tuple(sorted(set(model.eos_token_ids) | set(loaded.tokenizer.eos_token_ids)))
        speculator = Speculator(config, resolved, buckets, draft, num_pages=num_pages,
                                backend=backend, mesh=mesh)
        plan = None
        if budget is not None:
            drafter = speculator.drafter
            with startup.phase("plan memory"):
                plan = memory_plan.plan(
                    runner, buckets, budget, held_before,
                    compiled_shapes=runner.warmup_count(buckets) + speculator.warmup_count(),
                    draft=drafter.model if drafter else None)
            log.info("%s", plan.describe(resolved.max_model_len))
        # The scheduler is built once, on the pool the plan sized.
        scheduler = Scheduler(
            config.scheduler, cache, max_model_len=resolved.max_model_len, eos_token_ids=eos,
            prefill_keys_per_token=resolved.prefill_keys_per_token,
            # A cached page is reused only under the weights and KV format that wrote it.
            model_fingerprint=(f"{loaded.fingerprint}:{resolved.dtype}:{load.quantization}:"
                               f"kv-{resolved.kv_cache_dtype}"),
            kv_window=model.kv_window, speculation=speculator.speculation,
            group_windows=kv_groups.groups_of(model).windows, num_pages=runner.num_pages,
            lora=lora.slots if lora else None)
        outputs = OutputProcessor(loaded.tokenizer)
        requests = RequestTable(scheduler, outputs)
        pipeline = StepPipeline(
            buckets, scheduler, runner, speculator, outputs, requests,
            vocab_size=model.vocab_size, page_size=cache.page_size,
            async_scheduling=config.scheduler.async_scheduling, grammar_limits=grammar_limits,
            adapters=lora, pooler=pooler)
        weights = WeightUpdates(runner, scheduler, requests, pipeline, model, resolved.dtype)
        return cls(startup, model, loaded.tokenizer, backend, resolved, buckets,
                   resolved.max_model_len, lora, pooler, runner, speculator, plan,
                   runner.num_pages, scheduler, outputs, requests, pipeline, weights, eos)
