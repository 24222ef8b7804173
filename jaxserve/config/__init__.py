"""Frozen configuration, one module per concern: the model's shape (model.py), and what was
requested of the engine (engine.py's EngineConfig of load, cache, scheduler, parallel and
speculative sub-configs), kept apart from what the engine resolved (resolved.py)."""

from jaxserve.config.cache import (DEFAULT_MEMORY_UTILIZATION, KV_CACHE_DTYPES, KV_SCALAR_BYTES,
                                   KV_SCALE_BYTES, CacheConfig, kv_slot_bytes)
from jaxserve.config.engine import OPTION_GROUPS, EngineConfig, option_names
from jaxserve.config.load import (ATTENTION_BACKENDS, DTYPES, PALLAS_KERNELS, QUANTIZATIONS,
                                  LoadConfig)
from jaxserve.config.lora import LoRAConfig
from jaxserve.config.model import (LAYER_TYPES, MLP_ACTIVATIONS, ROPE_SCALINGS, ModelConfig,
                                   RopeScaling, kv_heads_per_device)
from jaxserve.config.parallel import ParallelConfig
from jaxserve.config.resolved import ResolvedConfig
from jaxserve.config.scheduler import PRIORITY_POLICIES, SCHEDULING_POLICIES, SchedulerConfig
from jaxserve.config.speculative import (DRAFT_QUANTIZATIONS, MAX_SPECULATIVE_TOKENS,
                                        SPECULATIVE_METHODS, SpeculativeConfig)

__all__ = ["ATTENTION_BACKENDS", "DEFAULT_MEMORY_UTILIZATION", "DRAFT_QUANTIZATIONS", "DTYPES",
           "KV_CACHE_DTYPES", "KV_SCALAR_BYTES", "KV_SCALE_BYTES", "LAYER_TYPES",
           "MAX_SPECULATIVE_TOKENS", "MLP_ACTIVATIONS", "OPTION_GROUPS", "PALLAS_KERNELS",
           "PRIORITY_POLICIES", "QUANTIZATIONS", "ROPE_SCALINGS", "SCHEDULING_POLICIES",
           "SPECULATIVE_METHODS", "CacheConfig", "EngineConfig", "LoadConfig", "LoRAConfig",
           "ModelConfig", "ParallelConfig", "ResolvedConfig", "RopeScaling", "SchedulerConfig",
           "SpeculativeConfig", "kv_heads_per_device", "kv_slot_bytes", "option_names"]
