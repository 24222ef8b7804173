"""ResolvedConfig: what the engine decided from a requested EngineConfig and the model and
device it found (dtype "auto" made concrete, the KV dtype, max_model_len, the prefill weighting,
the attention backend's name). Built once by LLMEngine; the requested config stays as asked.
Host-only arithmetic: the device's answers (its dtype, its backend) are passed in."""

from __future__ import annotations

import dataclasses
import logging

from jaxserve.config.cache import kv_slot_bytes
from jaxserve.config.engine import EngineConfig
from jaxserve.config.model import ModelConfig


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """kv_cache_dtype with auto meaning dtype (which must be resolved already)."""
    kv = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    if kv == "auto":
        raise ValueError("dtype 'auto' is resolved per device (backends.resolve_dtype) first")
    return kv


def resolve_prefill_keys_per_token(requested: int | None, model: ModelConfig,
                                   attention_cost: float) -> int:
    """requested, or for None: the model's weight FLOPs per token over its attention FLOPs per
    key, divided by attention_cost (how many times longer a FLOP of the attention backend takes
    than one of its matmuls, backends.Backend.attention_cost)."""
    if requested is not None:
        return requested
    keys = model.flops_per_token() / (model.attention_flops_per_key() * attention_cost)
    return max(1, round(keys))


def resolve_scan_layers(requested: str, platform: str) -> bool:
    """LoadConfig.scan_layers on a platform ("cpu", "gpu", "tpu"). auto: on for TPU, where the
    step compiles 2-3.5x faster (v6e, compile-only); off on the CPU, where XLA copies each
    layer's weight slice out of the stack before a matmul custom call or dot (decode up to
    half as fast), and on GPU, unmeasured, where a cuBLAS call would copy them alike
    (docs/serving.md, scan_layers)."""
    if requested != "auto":
        return requested == "on"
    return platform == "tpu"


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    dtype: str  # weights and activations
    kv_cache_dtype: str  # the KV pool's pages
    max_model_len: int  # the requested one, at most the model's context
    prefill_keys_per_token: int  # SchedulerConfig.prefill_keys_per_token, None resolved
    backend: str  # the attention backend's name
    scan_layers: bool = False  # the layers run by lax.scan (LoadConfig.scan_layers resolved)

    def __post_init__(self):
        if self.dtype == "auto":
            raise ValueError("a resolved dtype is concrete, not 'auto'")
        kv_slot_bytes(self.kv_cache_dtype)  # a resolved KV dtype, or ValueError

    @classmethod
    def of(cls, config: EngineConfig, model: ModelConfig, *, dtype: str, backend: str,
           attention_cost: float, platform: str = "cpu") -> "ResolvedConfig":
        """config resolved for `model` on a device (its platform) whose dtype ("auto" already
        resolved) and attention backend (its name and Backend.attention_cost) the engine
        chose."""
        context = model.max_position_embeddings
        asked = config.scheduler.max_model_len
        if asked is not None and asked > context:  # said once, not silently (issue 54)
            logging.getLogger("jaxserve.engine").warning(
                "max_model_len=%d is more than the model was trained for (max_position_"
                "embeddings=%d in its config): capped to %d", asked, context, context)
        return cls(dtype=dtype,
                   kv_cache_dtype=resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype),
                   max_model_len=min(asked or context, context),
                   prefill_keys_per_token=resolve_prefill_keys_per_token(
                       config.scheduler.prefill_keys_per_token, model, attention_cost),
                   backend=backend,
                   scan_layers=resolve_scan_layers(config.load.scan_layers, platform))

    def kv_bytes_per_token(self, model: ModelConfig) -> int:
        """One token's KV bytes over all layers of `model`, scales included."""
        return model.kv_bytes_per_token(*kv_slot_bytes(self.kv_cache_dtype))

    def num_pages(self, config: EngineConfig, token_bytes: int) -> int:
        """The pool's pages without a memory plan (CacheConfig.resolve_num_pages), token_bytes
        being one token's KV bytes as the pool stores them (a draft model's pool has as many
        pages, of its own shape: a byte budget pays for both)."""
        return config.cache.resolve_num_pages(token_bytes, max_model_len=self.max_model_len,
                                              max_num_seqs=config.scheduler.max_num_seqs)
