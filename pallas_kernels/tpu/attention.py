"""The one entry point of the TPU-style (Mosaic) Pallas attention kernels.

  ragged_paged_attention   rows in any order: decode rows, prefill chunks, padding rows

Semantics: `pallas_kernels.reference.ref_ragged_paged_attention`; inputs checked by
`pallas_kernels.validation.validate_inputs` (the contract every platform shares).

Dispatch, on static shapes only: T <= S (no more query tokens than rows, as in a decode step)
goes to the token-at-a-time kernel (decode_attention.py, one program per token and KV head);
otherwise to the ragged blocked kernel (prefill_attention.py, one program per block_q tokens and
KV head). Both are exact for every valid input; the rule only picks the one whose work fits.

Neither kernel has run on a TPU or been timed: they have run in Pallas TPU interpret mode on CPU
and been compiled by XLA and Mosaic for v5e and v6e topologies on a CPU host (libtpu, tested
over the option matrix in tests/test_tpu_compile.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.tpu import scale_rows
from pallas_kernels.tpu.block_sizes import TpuBlockSizes
from pallas_kernels.tpu.decode_attention import decode_attention
from pallas_kernels.tpu.prefill_attention import prefill_attention
from pallas_kernels.validation import validate_inputs


def check_page_major(q, kv_pages, k_scale, kv_scales) -> None:
    """A page-major pool: f[N, B, 2 * Hkv * D] with 2D whole 128-lane tiles, float pages without
    scales or int8 pages with their scale rows kv_scales f32[N, L] (scale_rows.py)."""
    head_dim = q.shape[-1]
    if kv_pages.ndim != 3 or kv_pages.shape[2] % (2 * head_dim) or (2 * head_dim) % 128:
        raise ValueError(f"a page-major pool is f[N, B, 2 * Hkv * D] with 2D a multiple of 128 "
                         f"(D = {head_dim}), got shape {kv_pages.shape}")
    if k_scale is not None:
        raise ValueError("a page-major pool's int8 scales are kv_scales, not k_scale/v_scale")
    if kv_pages.dtype == jnp.int8:
        num_pages, page_size, lanes = kv_pages.shape
        want = (num_pages, scale_rows.row_lanes(lanes // (2 * head_dim), page_size))
        if kv_scales is None or kv_scales.shape != want or kv_scales.dtype != jnp.float32:
            got = "none" if kv_scales is None else f"{kv_scales.dtype}{list(kv_scales.shape)}"
            raise ValueError(f"int8 page-major pages need kv_scales f32{list(want)}, got {got}")
    elif kv_scales is not None or not jnp.issubdtype(kv_pages.dtype, jnp.floating):
        raise ValueError(f"a page-major pool holds float pages without scales or int8 pages "
                         f"with kv_scales, got {kv_pages.dtype}"
                         f"{' with scales' if kv_scales is not None else ''}")


def uses_decode_path(num_tokens: int, num_rows: int) -> bool:
    """The dispatch rule: the token-at-a-time kernel when T <= S."""
    return num_tokens <= num_rows


def ragged_paged_attention(
    q: jax.Array,  # f[T, Hq, D], flat query tokens of all rows, then padding
    k_pages: jax.Array,  # f[Hkv, N, B, D] head-major, this step's K already written; or the
    # page-major pool f[N, B, 2 * Hkv * D] (v_pages None): head h's K at lanes 2hD..2hD+D, its V
    # next (kv_cache.PagedKV; one DMA per page and head moves both), int8 with kv_scales
    v_pages: jax.Array | None,  # f[Hkv, N, B, D] head-major, this step's V already written
    page_tables: jax.Array,  # i32[S, P]
    seq_lens: jax.Array,  # i32[S], KV length of each row after this step; 0 = padding row
    query_start: jax.Array,  # i32[S+1], cumulative; s owns tokens query_start[s]:query_start[s+1]
    *,
    sm_scale: float,
    interpret: bool = False,
    block_sizes: TpuBlockSizes | None = None,
    k_scale: jax.Array | None = None,  # f32[Hkv, N, B] for int8 pages
    v_scale: jax.Array | None = None,  # f32[Hkv, N, B] for int8 pages
    window: int | None = None,  # sliding window: keys at positions > p - window only
    soft_cap: float | None = None,  # scores -> soft_cap * tanh(score / soft_cap)
    sinks: jax.Array | None = None,  # f[Hq]: a logit per query head in the denominator
    kv_scales: jax.Array | None = None,  # f32[N, L]: an int8 page-major pool's scale rows
) -> jax.Array:  # f[T, Hq, D] in q.dtype; tokens >= query_start[S] are zeros
    """Causal paged attention for a ragged batch; see `ref_ragged_paged_attention`.

    The query of row s at position p = seq_lens[s] - q_len + i (its i-th token) attends to KV
    positions 0..p; position j of KV head h is k_pages[h, page_tables[s, j // B], j % B].
    int8 pages i8[Hkv, N, B, D] come with k_scale/v_scale and mean pages * scale[..., None]
    (`pallas_kernels.reference.dequantize_pages`); int8 page-major pages with kv_scales, the same
    scales as rows (`scale_rows.pack(k_scale, v_scale)`); float pages take no scales.
    interpret=True runs in Pallas TPU interpret mode (`pltpu.InterpretParams()`, any backend);
    False compiles with Mosaic, which needs a TPU.
    """
    if v_pages is None:
        check_page_major(q, k_pages, k_scale, kv_scales)
        view = jax.ShapeDtypeStruct((k_pages.shape[2] // (2 * q.shape[2]), *k_pages.shape[:2],
                                     q.shape[2]), k_pages.dtype)
        scale = (jax.ShapeDtypeStruct(view.shape[:3], jnp.float32) if kv_scales is not None
                 else None)
        validate_inputs(q, view, view, page_tables, seq_lens, query_start, scale, scale,
                        window=window, soft_cap=soft_cap, sinks=sinks)
    else:
        if kv_scales is not None:
            raise ValueError("kv_scales belong to a page-major pool (v_pages None)")
        validate_inputs(q, k_pages, v_pages, page_tables, seq_lens, query_start, k_scale,
                        v_scale, window=window, soft_cap=soft_cap, sinks=sinks)
    bs = block_sizes or TpuBlockSizes()
    args = (q, k_pages, v_pages, page_tables, seq_lens, query_start)
    kw = dict(sm_scale=sm_scale, pages_per_block=bs.pages_per_block, interpret=interpret,
              k_scale=k_scale, v_scale=v_scale, kv_scales=kv_scales, window=window,
              soft_cap=soft_cap, sinks=sinks)
    if uses_decode_path(q.shape[0], page_tables.shape[0]):
        return decode_attention(*args, **kw)
    return prefill_attention(*args, block_q=bs.block_q, **kw)
