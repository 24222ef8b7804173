"""Ragged blocked attention (the prefill path): query blocks of block_q flat tokens x KV heads.

The T flat query tokens (row s owns tokens query_start[s]:query_start[s+1]) are cut into blocks
of block_q tokens. Grid (T / block_q, Hkv), both parallel. Program (i, h) holds the block_q x G
queries that share KV head h as one [block_q * G, D] matrix (grouped-query attention, K/V never
repeated) and, for each row overlapping its tokens (range found with jnp outside the kernel and
passed by scalar prefetch with the page table), walks that row's pages in key blocks of
pages_per_block pages, double buffered (common.pipelined_kv_loop). Causality is by absolute
position: the query of row s at position p = seq_lens[s] - q_len + (t - query_start[s]) sees keys
0..p, so chunked prefill and prefix-cache hits read earlier pages already in the pool; key blocks
past the block's last query position are not visited. Scores of other rows' tokens are masked,
V rows at positions >= seq_lens[s] are zeroed with a select, and tokens with no valid key
(padding) give zeros.

int8 pages (k_scale/v_scale given) have their scale pages copied alongside and are dequantized
in VMEM after the copy (common.py, "int8 pages").

What has been run: Pallas TPU interpret mode on CPU (`pltpu.InterpretParams()`), jax 0.10.2, and
compiled by XLA and Mosaic for v5e and v6e topologies on a CPU host (libtpu; tests/
test_tpu_compile.py). Nothing here has run on a TPU or been timed. Known gaps for real hardware: one
DMA per page and KV head (K and V each for the head-major pool, together for the page-major
one), so small pages mean many small copies; the pipeline
drains at each row boundary (a row's first key block is not prefetched during the previous row's
last); a query block spanning several rows computes every key block of each of them for all its
tokens (masked), wasting work on short rows; the reshapes (block_q, G, D) -> (block_q*G, D) and
(pages, B, D) -> (pages*B, D) assume Mosaic-friendly sizes (block_q*G and B multiples of 8, D
ideally a multiple of 128).
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


def _prefill_kernel(seq_lens_ref, table_ref, query_start_ref, first_seq_ref, last_seq_ref,
                    # scalar prefetch (SMEM): i32[S], i32[S * P'], i32[S+1], i32[T'/block_q] x2
                    q_ref,  # [block_q, G, D] queries of this token block sharing KV head h
                    *refs,  # sinks f32[block_q * G, 128] (has_sinks only); pool in HBM: K, V
                    # [Hkv, N, B, D] (+ K, V scales f32[Hkv, N, 1, B]);
                    # o_ref [block_q, G, D]; VMEM buffers K, V [2, pages_per_block, B, D] (+
                    # scales f32[2, pages_per_block, 1, B]); DMA semaphores (buffers, 2 slots)
                    sm_scale: float, table_width: int, num_pool: int, window: int | None,
                    soft_cap: float | None, has_sinks: bool):
    sink = refs[0][...] if has_sinks else None
    pool, o_ref, bufs, sems = split_refs(refs[has_sinks:], num_pool=num_pool)
    qb, h = pl.program_id(0), pl.program_id(1)
    block_q, group, head_dim = q_ref.shape
    rows = block_q * group
    pages_per_block, page_size = bufs[0].shape[1:3]
    block_len = pages_per_block * page_size
    q = q_ref[...].astype(jnp.float32).reshape(rows, head_dim)
    first_token = qb * block_q
    token = first_token + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group)

    def seq_body(s, carry):
        q_lo, q_hi = query_start_ref[s], query_start_ref[s + 1]
        seq_len = seq_lens_ref[s]
        first_pos = seq_len - (q_hi - q_lo)  # position of the row's first query
        in_seq = (token >= q_lo) & (token < q_hi)
        position = first_pos + token - q_lo  # [R, 1]
        last_token = jnp.minimum(q_hi, first_token + block_q) - 1
        num_blocks = jnp.maximum(pl.cdiv(first_pos + last_token - q_lo + 1, block_len), 0)
        # The block's earliest query of this row opens the earliest window.
        first = window_start(first_pos + jnp.maximum(first_token - q_lo, 0), window, block_len)
        # Keys some query of the block may read: below seq_len, and inside the widest window.
        lowest = first_pos + jnp.maximum(first_token - q_lo, 0) - (window or 0) + 1

        def body(i, k, v, carry):
            block = first + i
            key_pos = block * block_len + jax.lax.broadcasted_iota(jnp.int32, (1, block_len), 1)
            v_pos = block * block_len + jax.lax.broadcasted_iota(jnp.int32, (block_len, 1), 0)
            valid = in_seq & in_window(key_pos, position, window)
            scores = masked_scores(q, k, valid, sm_scale=sm_scale, soft_cap=soft_cap)
            v_valid = v_pos < seq_len
            if window is not None:  # pages before a window may be released (garbage)
                v_valid &= v_pos >= lowest
            return online_softmax_step(carry, scores, valid, v, v_valid)

        return pipelined_kv_loop(
            jnp.maximum(num_blocks - first, 0),
            lambda i: s * table_width + (first + i) * pages_per_block, body, carry,
            table_ref=table_ref, kv_head=h, pool=pool, bufs=bufs, sems=sems)

    carry = jax.lax.fori_loop(first_seq_ref[qb], last_seq_ref[qb] + 1, seq_body,
                              init_carry(rows, head_dim, sink))
    o_ref[...] = finish(carry).reshape(block_q, group, head_dim).astype(o_ref.dtype)


def _rows_per_block(query_start, num_tokens: int, block_q: int):
    """First and last row owning tokens of each query block (last < first if none)."""
    num_seqs = query_start.shape[0] - 1
    total = query_start[num_seqs]
    lo = jnp.arange(0, num_tokens, block_q, dtype=jnp.int32)
    hi = jnp.minimum(lo + block_q, total) - 1
    owner = lambda tokens: jnp.clip(jnp.searchsorted(query_start, tokens, side="right") - 1, 0,
                                    num_seqs - 1).astype(jnp.int32)
    first = owner(lo)
    last = jnp.where(lo < total, owner(hi), first - 1)
    return first, last


def prefill_attention(q, k_pages, v_pages, page_tables, seq_lens, query_start, *,
                      sm_scale: float, block_q: int, pages_per_block: int, interpret: bool,
                      k_scale=None, v_scale=None, kv_scales=None, window: int | None = None,
                      soft_cap: float | None = None, sinks=None) -> jax.Array:
    """Inputs and output as `ragged_paged_attention` (validated there); see the module docstring."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, group, page_size, pages_per_block, table, table_width = pool_layout(
        q, k_pages, v_pages, page_tables, seq_lens, pages_per_block=pages_per_block)
    padded_tokens = pl.cdiv(num_tokens, block_q) * block_q
    q4 = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
    q4 = q4.reshape(padded_tokens, num_kv_heads, group, head_dim)
    first_seq, last_seq = _rows_per_block(query_start, padded_tokens, block_q)
    q_spec = pl.BlockSpec((block_q, None, group, head_dim), lambda i, h, *_: (i, h, 0, 0))
    pool = pool_operands(k_pages, v_pages, k_scale, v_scale, kv_scales)
    quantized, page_major = k_pages.dtype == jnp.int8, v_pages is None
    kernel = functools.partial(_prefill_kernel, sm_scale=float(sm_scale),
                               table_width=table_width, num_pool=len(pool),
                               window=window, soft_cap=soft_cap, has_sinks=sinks is not None)
    sink_args, sink_specs = (), []
    if sinks is not None:
        sink_args = (sink_operand(sinks, num_kv_heads, block_q * group),)
        sink_specs = [pl.BlockSpec((None, block_q * group, LANES), lambda i, h, *_: (h, 0, 0))]
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(padded_tokens // block_q, num_kv_heads),
            in_specs=[q_spec, *sink_specs] + [pl.BlockSpec(memory_space=pl.ANY)] * len(pool),
            out_specs=q_spec,
            scratch_shapes=kv_scratch(pages_per_block, page_size, head_dim, k_pages.dtype,
                                      quantized=quantized, page_major=page_major),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=attention_cost(
            num_tokens=padded_tokens, num_rows=page_tables.shape[0], block_q=block_q,
            pages_read=pages_read(table_width, page_size, pages_per_block, window),
            page_size=page_size, num_q_heads=num_q_heads, kv_heads_read=num_kv_heads,
            head_dim=head_dim, kv_itemsize=k_pages.dtype.itemsize, q_itemsize=q.dtype.itemsize,
            scale_bytes=scale_bytes_read(page_size, quantized=quantized,
                                         page_major=page_major),
            soft_cap=soft_cap is not None),
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        interpret=resolve_interpret(interpret),
    )(seq_lens, table, query_start, first_seq, last_seq, q4, *sink_args, *pool)
    return out.reshape(padded_tokens, num_q_heads, head_dim)[:num_tokens]
