"""The one entry point of the TPU-style (Mosaic) Pallas attention kernels.

  ragged_paged_attention   rows in any order: decode rows, prefill chunks, padding rows

Semantics: `pallas_kernels.reference.ref_ragged_paged_attention`. For now every call goes to the
ragged kernel (prefill_attention.py), which treats a decode row as a 1-token chunk.
"""

from __future__ import annotations

import jax

from pallas_kernels.tpu.block_sizes import PrefillBlockSizes
from pallas_kernels.tpu.prefill_attention import ragged_prefill_attention, validate_prefill_inputs


def validate_inputs(q, k_pages, v_pages, page_tables, seq_lens, query_start) -> None:
    """All checks of `ragged_paged_attention`'s inputs; outside jit also page-table values,
    lengths and offsets."""
    validate_prefill_inputs(q, k_pages, v_pages, page_tables, seq_lens, query_start)


def ragged_paged_attention(
    q: jax.Array,  # f[T, Hq, D], flat query tokens of all rows, then padding
    k_pages: jax.Array,  # f[Hkv, N, B, D] head-major, this step's K already written
    v_pages: jax.Array,  # f[Hkv, N, B, D] head-major, this step's V already written
    page_tables: jax.Array,  # i32[S, P]
    seq_lens: jax.Array,  # i32[S], KV length of each row after this step; 0 = padding row
    query_start: jax.Array,  # i32[S+1], cumulative; s owns tokens query_start[s]:query_start[s+1]
    *,
    sm_scale: float,
    interpret: bool = False,
    block_sizes: PrefillBlockSizes | None = None,
) -> jax.Array:  # f[T, Hq, D] in q.dtype; tokens >= query_start[S] are zeros
    """Causal paged attention for a ragged batch; see `ref_ragged_paged_attention`.

    interpret=True runs the kernel in Pallas TPU interpret mode (`pltpu.InterpretParams()`), on
    any backend; False compiles it with Mosaic (a TPU is needed).
    """
    return ragged_prefill_attention(q, k_pages, v_pages, page_tables, seq_lens, query_start,
                                    sm_scale=sm_scale, block_sizes=block_sizes,
                                    interpret=interpret)
