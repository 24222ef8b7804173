"""Token-at-a-time paged attention (the decode path): one program per query token and KV head.

Grid (T, Hkv), both parallel. Program (t, h) holds the G = Hq // Hkv query heads of token t that
share KV head h (grouped-query attention without repeating K/V in memory) and walks the pages of
the token's row up to its position, pages_per_block pages per key block, double buffered
(common.pipelined_kv_loop). Each token's row and absolute position are computed with cheap jnp
ops outside the kernel and passed by scalar prefetch (`pltpu.PrefetchScalarGridSpec`) with the
page table; position -1 marks tokens of no row (past query_start[S]), which give zeros. The
token at position p sees keys 0..p, so the path is exact for every input the ragged contract
allows; it is the fast one when rows have one token each (decode), since a row of n tokens has
its pages read n times.

int8 pages (k_scale/v_scale given) have their scale pages copied alongside and are dequantized
in VMEM after the copy (common.py, "int8 pages").

What has been run: Pallas TPU interpret mode on CPU (`pltpu.InterpretParams()`), jax 0.10.2, and
compiled by XLA and Mosaic for v5e and v6e topologies on a CPU host (libtpu; tests/
test_tpu_compile.py). Nothing here has run on a TPU or been timed. Known gaps for real hardware: one
DMA per page and KV head (K and V each for the head-major pool, together for the page-major
one) (e.g. 16 * 128 * 2 B = 4 KiB in bf16), so small pages
mean many small copies; the pipeline restarts in every program (the next program's first block
is not prefetched); G query rows per program leave the MXU mostly idle for small G; the reshape
(pages, B, D) -> (pages*B, D) assumes Mosaic-friendly B (a multiple of 8) and D (ideally a
multiple of 128).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu.common import (LANES, attention_cost, finish, init_carry, kv_scratch, masked_scores,
                                       in_window, online_softmax_step, pages_read,
                                       pipelined_kv_loop, scale_bytes_read,
                                       pool_layout, pool_operands, resolve_interpret,
                                       sink_operand, split_refs, window_start)


def token_rows_and_positions(seq_lens, query_start, num_tokens: int):
    """i32[T] row of each token and i32[T] its absolute position (-1: a token of no row)."""
    num_seqs = seq_lens.shape[0]
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    # The last s with query_start[s] <= t: rows without queries are skipped.
    row = jnp.clip(jnp.searchsorted(query_start, tokens, side="right") - 1, 0,
                   num_seqs - 1).astype(jnp.int32)
    first_pos = seq_lens[row] - (query_start[row + 1] - query_start[row])
    position = first_pos + tokens - query_start[row]
    return row, jnp.where(tokens < query_start[num_seqs], position, -1).astype(jnp.int32)


def _decode_kernel(row_ref, position_ref, table_ref,  # scalar prefetch: i32[T] x2, i32[S * P']
                   q_ref,  # [G, D] query heads of token t that share KV head h
                   *refs,  # sinks f32[G, 128] of this KV head's query heads (has_sinks only);
                   # pool in HBM: K, V [Hkv, N, B, D] (+ K, V scales f32[Hkv, N, 1, B]);
                   # o_ref [G, D]; VMEM buffers K, V [2, pages_per_block, B, D] (+ scales
                   # f32[2, pages_per_block, 1, B]); DMA semaphores (buffers, 2 slots)
                   sm_scale: float, table_width: int, num_pool: int, window: int | None,
                   soft_cap: float | None, has_sinks: bool):
    sink = refs[0][...] if has_sinks else None
    pool, o_ref, bufs, sems = split_refs(refs[has_sinks:], num_pool=num_pool)
    t, h = pl.program_id(0), pl.program_id(1)
    row, position = row_ref[t], position_ref[t]
    pages_per_block, page_size = bufs[0].shape[1:3]
    block_len = pages_per_block * page_size
    q = q_ref[...].astype(jnp.float32)
    group, head_dim = q.shape

    first = window_start(position, window, block_len)  # blocks before the window: not read

    def body(i, k, v, carry):
        block = first + i
        key_pos = block * block_len + jax.lax.broadcasted_iota(jnp.int32, (group, block_len), 1)
        v_pos = block * block_len + jax.lax.broadcasted_iota(jnp.int32, (block_len, 1), 0)
        valid = in_window(key_pos, position, window)
        scores = masked_scores(q, k, valid, sm_scale=sm_scale, soft_cap=soft_cap)
        return online_softmax_step(carry, scores, valid, v, in_window(v_pos, position, window))

    carry = pipelined_kv_loop(
        pl.cdiv(position + 1, block_len) - first,
        lambda i: row * table_width + (first + i) * pages_per_block, body,
        init_carry(group, head_dim, sink), table_ref=table_ref, kv_head=h, pool=pool, bufs=bufs,
        sems=sems)
    o_ref[...] = finish(carry).astype(o_ref.dtype)


def decode_attention(q, k_pages, v_pages, page_tables, seq_lens, query_start, *, sm_scale: float,
                     pages_per_block: int, interpret: bool, k_scale=None, v_scale=None,
                     kv_scales=None,
                     window: int | None = None, soft_cap: float | None = None,
                     sinks=None) -> jax.Array:
    """Inputs and output as `ragged_paged_attention` (validated there); see the module docstring."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, group, page_size, pages_per_block, table, table_width = pool_layout(
        q, k_pages, v_pages, page_tables, seq_lens, pages_per_block=pages_per_block)
    row, position = token_rows_and_positions(seq_lens, query_start, num_tokens)
    q_spec = pl.BlockSpec((None, None, group, head_dim), lambda t, h, *_: (t, h, 0, 0))
    pool = pool_operands(k_pages, v_pages, k_scale, v_scale, kv_scales)
    quantized, page_major = k_pages.dtype == jnp.int8, v_pages is None
    kernel = functools.partial(_decode_kernel, sm_scale=float(sm_scale),
                               table_width=table_width, num_pool=len(pool),
                               window=window, soft_cap=soft_cap, has_sinks=sinks is not None)
    sink_args, sink_specs = (), []
    if sinks is not None:
        sink_args = (sink_operand(sinks, num_kv_heads, group),)
        sink_specs = [pl.BlockSpec((None, group, LANES), lambda t, h, *_: (h, 0, 0))]
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(num_tokens, num_kv_heads),
            in_specs=[q_spec, *sink_specs] + [pl.BlockSpec(memory_space=pl.ANY)] * len(pool),
            out_specs=q_spec,
            scratch_shapes=kv_scratch(pages_per_block, page_size, head_dim, k_pages.dtype,
                                      quantized=quantized, page_major=page_major),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=attention_cost(
            num_tokens=num_tokens, num_rows=page_tables.shape[0], block_q=1,
            pages_read=pages_read(table_width, page_size, pages_per_block, window),
            page_size=page_size, num_q_heads=num_q_heads, kv_heads_read=num_kv_heads,
            head_dim=head_dim, kv_itemsize=k_pages.dtype.itemsize, q_itemsize=q.dtype.itemsize,
            scale_bytes=scale_bytes_read(page_size, quantized=quantized,
                                         page_major=page_major),
            soft_cap=soft_cap is not None),
        out_shape=jax.ShapeDtypeStruct((num_tokens, num_kv_heads, group, head_dim), q.dtype),
        interpret=resolve_interpret(interpret),
    )(row, position, table, q.reshape(num_tokens, num_kv_heads, group, head_dim), *sink_args,
      *pool)
    return out.reshape(num_tokens, num_q_heads, head_dim)
