"""What an engine is made of, decided once from its config, its model's config and the platform
it serves on, before any device is touched: the attention backend, the resolved config (dtype,
KV dtype, max_model_len, scan_layers, ...) and the step buckets. LLMEngine builds its parts from
it on this host; `jaxserve compile` (aot.py) compiles them for a TPU topology from any host, so
the two cannot resolve a config differently."""

from __future__ import annotations

import dataclasses
import math

from jaxserve import backends
from jaxserve.config import EngineConfig, ModelConfig, ResolvedConfig
from jaxserve.config.resolved import resolve_kv_cache_dtype
from jaxserve.runtime.buckets import Buckets

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
