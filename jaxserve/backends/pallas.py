"""The Pallas backends: each platform's `ragged_paged_attention` from pallas_kernels/ (gpu/ in
Triton, tpu/ in Mosaic), compiled on its device or interpreted on a CPU. The entry point takes
rows in any order, so batches are packed (decode rows and prefill chunks back to back, one step
shape per token bucket) and the engine calls nothing else.

The TPU family's pool is page-major (kv_cache.PagedKV): [N, B, 2 * Hkv', D], whole multi-head
pages per DMA, where JAX's own TPU kernel applies (pallas_kernels/tpu/jax_kernel.py: float pages,
head dim a multiple of 128; compiled, never interpreted); the same bytes as lanes
[N, B, 2 * Hkv * D] for this package's TPU kernels on other pages with 2D a multiple of 128
(head dim 64: one DMA per page and head moves its K and V; int8 pages with their scales as one
lane-dense row per page, pallas_kernels/tpu/scale_rows.py); head-major [Hkv, N, B, D] for other
head dims."""

from __future__ import annotations

import functools

from jaxserve.backends import Backend
from jaxserve.model.kv_cache import KVLayout, PagedKV


@functools.cache
def backend(family: str, *, interpret: bool) -> Backend:
    if family == "gpu":
        from pallas_kernels.gpu import ragged_paged_attention
    elif family == "tpu":
        from pallas_kernels.tpu import jax_kernel, ragged_paged_attention
    else:
        raise ValueError(f"no Pallas kernel family {family!r} (gpu or tpu)")

    def attention(q, cache, md, *, sm_scale: float, window: int | None = None,
                  soft_cap: float | None = None, sinks=None):
        if isinstance(cache, PagedKV) and cache.kv.ndim == 4:
            if sinks is not None:  # kv_layout keeps models with sinks off JAX's kernel
                raise ValueError("JAX's TPU kernel has no attention sinks")
            return jax_kernel.ragged_paged_attention(
                q, cache.kv, md.page_tables, md.seq_lens, md.query_start,
                num_kv_heads=cache.num_kv_heads, sm_scale=sm_scale, window=window,
                soft_cap=soft_cap)
        if isinstance(cache, PagedKV):  # flat lanes, our TPU kernels (gpu/ takes no PagedKV)
            return ragged_paged_attention(q, cache.kv, None, md.page_tables, md.seq_lens,
                                          md.query_start, sm_scale=sm_scale, interpret=interpret,
                                          window=window, soft_cap=soft_cap, sinks=sinks,
                                          kv_scales=cache.scales)
        return ragged_paged_attention(q, cache.k, cache.v, md.page_tables, md.seq_lens,
                                      md.query_start, sm_scale=sm_scale, interpret=interpret,
                                      k_scale=cache.k_scale, v_scale=cache.v_scale,
                                      window=window, soft_cap=soft_cap, sinks=sinks)

    def kv_layout(num_kv_heads: int, head_dim: int, dtype, *, num_q_heads: int,
                  q_dtype, sinks: bool = False) -> KVLayout:
        # JAX's kernel does not run interpreted (jax_kernel.py), nor has attention sinks: there
        # ours serve.
        if family == "tpu" and not interpret and not sinks and jax_kernel.applies(
                head_dim, dtype, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                q_dtype=q_dtype):
            return KVLayout(jax_kernel.padded_kv_heads(num_kv_heads, dtype), page_major=True,
                            model_heads=num_kv_heads)
        if family == "tpu" and (2 * head_dim) % 128 == 0:  # ours, same bytes (int8: + scale rows)
            return KVLayout(num_kv_heads, page_major=True, flat=True)
        return KVLayout(num_kv_heads)

    name = f"pallas-{family}" + ("-interpret" if interpret else "")
    return Backend(name=name, attention=attention, packed=True, kv_layout=kv_layout)
