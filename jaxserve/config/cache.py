"""The KV cache as requested (CacheConfig): its pages, their dtype, how much memory the pool
gets, prefix sharing and the admission watermark. Sizes of a KV slot per dtype live here too."""

from __future__ import annotations

import dataclasses
import math

from jaxserve.config.options import check_choices, option

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
# An accelerator engine's share of its allocator's memory when no budget or pool size is given:
# vLLM's default, leaving a tenth for what no plan sees (other processes' contexts, fragmentation).
DEFAULT_MEMORY_UTILIZATION = 0.9
# Bytes of a KV slot's scalar, and of the float32 scale an int8 slot keeps per KV head.
KV_SCALAR_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
KV_SCALE_BYTES = {"int8": 4}


def kv_slot_bytes(kv_cache_dtype: str) -> tuple[int, int]:
    """(bytes per KV scalar, bytes of the scale per KV head and token) for a resolved dtype."""
    if kv_cache_dtype not in KV_SCALAR_BYTES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_SCALAR_BYTES)} once "
                         f"resolved, got {kv_cache_dtype!r}")
    return KV_SCALAR_BYTES[kv_cache_dtype], KV_SCALE_BYTES.get(kv_cache_dtype, 0)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    page_size: int = option(16, "KV slots per page.")
    # "int8": symmetric, about 4x the tokens of a float32 pool in the same bytes.
    kv_cache_dtype: str = option("auto", "KV pages; auto: as --dtype. int8: a float32 scale per "
                                 "token and KV head.", choices=KV_CACHE_DTYPES)
    # The engine's memory per device, planned once (engine/memory_plan.py). Neither this nor
    # memory_utilization: DEFAULT_MEMORY_UTILIZATION on accelerators; on CPU the pool sizes below.
    memory_budget_bytes: int | None = option(
        None, "The engine's memory per device (under tensor or data parallelism, each "
        "device's): weights, the largest step's activations and the runtime are measured at "
        "start, the KV pool gets the rest (logged).")
    memory_utilization: float | None = option(
        None, "The same as a fraction of each device's memory (its allocator's limit; on CPU, "
        "of RAM). Default: 0.9 on GPU/TPU; on CPU the pool is sized by --num_pages or its "
        "default.")
    # Overrides of the plan: the pool's size, as pages or KV bytes.
    num_pages: int | None = option(
        None, "KV pages in the pool, scratch page 0 included (overrides a memory budget).")
    kv_cache_bytes: int | None = option(
        None, "KV pool bytes (instead of num_pages; overrides a memory budget).")
    enable_prefix_caching: bool = option(True, "Share full prompt pages.")
    cache_salt: str | None = option(None, "Prefix-cache salt (isolates tenants).")
    watermark: float = option(0.01, "Fraction of pages kept free at admission.")

    def __post_init__(self):
        check_choices(self)
        checks = (
            (self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}"),
            (self.num_pages is None or self.num_pages >= 2,
             f"num_pages must be >= 2 (page 0 is reserved scratch), got {self.num_pages}"),
            (self.kv_cache_bytes is None or self.kv_cache_bytes > 0,
             f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}"),
            (self.num_pages is None or self.kv_cache_bytes is None,
             "give num_pages or kv_cache_bytes, not both"),
            (self.memory_budget_bytes is None or self.memory_budget_bytes > 0,
             f"memory_budget_bytes must be > 0, got {self.memory_budget_bytes}"),
            (self.memory_utilization is None or 0.0 < self.memory_utilization <= 1.0,
             f"memory_utilization must be in (0, 1], got {self.memory_utilization}"),
            (self.memory_budget_bytes is None or self.memory_utilization is None,
             "give memory_budget_bytes or memory_utilization, not both"),
            (0.0 <= self.watermark < 1.0, f"watermark must be in [0, 1), got {self.watermark}"))
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def planned_utilization(self, platform: str) -> float | None:
        """memory_utilization, or the accelerator default when nothing sizes the pool."""
        sized = (self.memory_budget_bytes, self.num_pages, self.kv_cache_bytes)
        if self.memory_utilization is None and platform != "cpu" and sized == (None,) * 3:
            return DEFAULT_MEMORY_UTILIZATION
        return self.memory_utilization

    def resolve_num_pages(self, token_bytes: int | None, *, max_model_len: int,
                          max_num_seqs: int) -> int:
        """Total pages (scratch page 0 included) from num_pages, kv_cache_bytes over pages of
        token_bytes a slot (one token's KV over all layers; a draft model's pool, of as many
        pages, adds its own: the bytes pay for both), or a default that holds max_num_seqs
        sequences of min(max_model_len, 512) tokens each."""
        if self.num_pages is not None:
            return self.num_pages
        if self.kv_cache_bytes is not None:
            if token_bytes is None:
                raise ValueError("kv_cache_bytes needs a resolved KV dtype to count its pages")
            page_bytes = token_bytes * self.page_size
            pages = self.kv_cache_bytes // page_bytes
            if pages < 2:
                raise ValueError(f"kv_cache_bytes={self.kv_cache_bytes} holds {pages} page(s) of "
                                 f"{page_bytes} bytes; at least 2 are needed")
            return int(pages)
        return 1 + max_num_seqs * math.ceil(min(max_model_len, 512) / self.page_size)
