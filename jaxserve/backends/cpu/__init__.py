"""The CPU backend: C++ XLA FFI kernels built with the machine's compiler (kernels.py), weights
packed for its matmul at load (packing.py), and the weights' host memory in 2 MiB pages
(huge_pages.py)."""

from __future__ import annotations

from jaxserve.backends import Backend
from jaxserve.backends.cpu import kernels, packing

KV_CACHE_DTYPES = ("float32", "bfloat16", "int8")  # the pages its attention reads in place


def attention(q, cache, md, *, sm_scale: float, window: int | None = None,
              soft_cap: float | None = None, sinks=None):
    """Decode and prefill tokens alike in one custom call: each token attends its row's pages
    causally (within its sliding window, scores soft-capped, sinks in the denominator), read
    in place (no gathered copy). Any layout works (a padding token's row is S);
    the batch packs chunks back to back so that no slot is alignment padding."""
    out = kernels.paged_attention(q, cache.k, cache.v, md.page_tables, md.seq_lens,
                                  md.token_row, md.positions, sm_scale=sm_scale,
                                  k_scale=cache.k_scale, v_scale=cache.v_scale, window=window,
                                  soft_cap=soft_cap, sinks=sinks)
    return out.astype(q.dtype)


def write_kv(cache, k, v, slot_mapping):
    """This step's keys and values (f[T, Hkv, D]) into their slots in one custom call, written
    in place (int8 quantized as kv_cache.quantize_kv)."""
    return type(cache)(*kernels.write_kv(k, v, slot_mapping, cache.k, cache.v, cache.k_scale,
                                         cache.v_scale))


# attention_cost: a (token, key) pair of a 512-token chunk deep into SmolLM2-135M's context
# took 4x the time per FLOP of its matmuls (docs/performance-history.md, 2026-12-06).
BACKEND = Backend(name="cpu", attention=attention, write_kv=write_kv, packed=True,
                  pack_params=packing.pack_params, argmax=kernels.argmax, attention_cost=4.0)
