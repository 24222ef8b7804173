"""Ragged blocked prefill attention as a TPU-style Pallas kernel over a paged KV pool.

The T flat query tokens of S sequences (sequence s owns rows query_start[s]:query_start[s+1])
are cut into blocks of block_q rows. Grid (T / block_q, Hkv), both parallel. Program (i, h)
holds the block_q x G queries that share KV head h (grouped-query attention, K/V never repeated)
and, for each sequence overlapping its rows (range found on the host side of the call and passed
by scalar prefetch), walks that sequence's pages in key blocks of block_kv_pages pages: page ids
come from the page table in SMEM (`pltpu.PrefetchScalarGridSpec`), and each page's block for
head h, the contiguous k_pages[h, page] of shape [B, D] in the head-major pool f[Hkv, N, B, D]
(left in HBM), is copied into VMEM. Online softmax in float32 with running max m and
normaliser l, the accumulator rescaled by exp(m - m'). Causality is by absolute
position: the query of s at position p = seq_lens[s] - q_len + (row - query_start[s]) attends to
keys 0..p, so chunked prefill and prefix-cache hits see earlier pages already in the pool. Key
blocks past the block's last query position are skipped. Scores outside a row's sequence or
causal range are masked with a select before exp, V rows at positions >= seq_lens[s] are zeroed
with a select (garbage/NaN never leaks), and rows with no valid key (padding) give zeros.

What has been run: Pallas TPU interpret mode on CPU only (`interpret=pltpu.InterpretParams()`),
jax/jaxlib 0.10.2, and Pallas -> Mosaic lowering for platform "tpu" via jax.export on CPU (no TPU
needed; tested). Nothing here has been compiled by the Mosaic/TPU compiler, run on a TPU or GPU,
or timed on hardware. Known gaps for real hardware: no double buffering of key blocks; one DMA
per page, each of one contiguous B*D block, so small pages mean many small copies; the in-kernel
reshapes (block_q, G, D) -> (block_q*G, D) and (pages, B, D) -> (pages*B, D) assume
Mosaic-friendly sizes (G*block_q and B multiples of 8, D a multiple of 128 ideally); a query block
spanning several sequences computes every key block of each of them for all its rows (masked),
wasting work on short sequences.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu.block_sizes import PrefillBlockSizes
from pallas_kernels.tpu.decode_attention import (check_page_values, check_pool, copy_kv_block,
                                             finish, init_carry, is_concrete,
                                             online_softmax_step, prepare_page_tables,
                                             resolve_interpret)


def validate_prefill_inputs(q, k_pages, v_pages, page_tables, seq_lens, query_start) -> None:
    """All checks; call outside jit to also check page-table values, lengths and offsets."""
    check_pool(q, k_pages, v_pages, page_tables, seq_lens, q_rank_name="f[T, Hq, D]")
    num_seqs = page_tables.shape[0]
    if query_start.shape != (num_seqs + 1,) or query_start.dtype != jnp.int32:
        raise ValueError(f"query_start must be i32[S+1] with S={num_seqs}, got "
                         f"{query_start.dtype}{list(query_start.shape)}")
    if not is_concrete(page_tables, seq_lens, query_start):
        return
    check_page_values(page_tables, seq_lens, k_pages.shape[1], k_pages.shape[2])
    query_start = np.asarray(query_start)
    seq_lens = np.asarray(seq_lens)
    q_lens = np.diff(query_start)
    if query_start[0] != 0 or (q_lens < 0).any():
        raise ValueError(f"query_start must start at 0 and be non-decreasing, got {query_start}")
    if query_start[-1] > q.shape[0]:
        raise ValueError(f"query_start[S] = {int(query_start[-1])} exceeds the T = {q.shape[0]} "
                         "rows of q")
    short = np.flatnonzero(q_lens > seq_lens)
    if short.size:
        s = int(short[0])
        raise ValueError(f"sequence {s} has {int(q_lens[s])} queries but seq_lens[{s}] = "
                         f"{int(seq_lens[s])}; seq_lens must include this step's queries")


def _prefill_kernel(seq_lens_ref, table_ref, query_start_ref, first_seq_ref, last_seq_ref,
                    # scalar prefetch (SMEM): i32[S], i32[S * P'], i32[S+1], i32[T'/block_q] x2
                    q_ref,  # [block_q, G, D] queries of this row block sharing KV head h
                    k_hbm, v_hbm,  # [Hkv, N, B, D], left in HBM
                    o_ref,  # [block_q, G, D]
                    k_buf, v_buf,  # VMEM [block_kv_pages, B, D]
                    sems,  # DMA semaphores (2,)
                    *, sm_scale: float, block_kv_pages: int, table_width: int):
    qb, h = pl.program_id(0), pl.program_id(1)
    block_q, group, head_dim = q_ref.shape
    rows = block_q * group
    page_size = k_buf.shape[1]
    block_len = block_kv_pages * page_size
    q = q_ref[...].astype(jnp.float32).reshape(rows, head_dim)
    first_row = qb * block_q
    token = first_row + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group)

    def seq_body(s, carry):
        q_lo, q_hi = query_start_ref[s], query_start_ref[s + 1]
        seq_len = seq_lens_ref[s]
        first_pos = seq_len - (q_hi - q_lo)  # position of the sequence's first query
        in_seq = (token >= q_lo) & (token < q_hi)
        position = first_pos + token - q_lo  # [R, 1]
        last_token = jnp.minimum(q_hi, first_row + block_q) - 1
        num_blocks = jnp.maximum(pl.cdiv(first_pos + last_token - q_lo + 1, block_len), 0)

        def kv_body(block, carry):
            first_entry = s * table_width + block * block_kv_pages
            k = copy_kv_block(k_hbm, k_buf, sems.at[0], table_ref, first_entry, h, block_kv_pages)
            v = copy_kv_block(v_hbm, v_buf, sems.at[1], table_ref, first_entry, h, block_kv_pages)
            key_pos = block * block_len + jax.lax.broadcasted_iota(jnp.int32, (1, block_len), 1)
            v_pos = block * block_len + jax.lax.broadcasted_iota(jnp.int32, (block_len, 1), 0)
            score_valid = in_seq & (key_pos <= position)
            return online_softmax_step(carry, q, k, v, score_valid, v_pos < seq_len, sm_scale)

        return jax.lax.fori_loop(0, num_blocks, kv_body, carry)

    carry = jax.lax.fori_loop(first_seq_ref[qb], last_seq_ref[qb] + 1, seq_body,
                              init_carry(rows, head_dim))
    o_ref[...] = finish(carry).reshape(block_q, group, head_dim).astype(o_ref.dtype)


def _sequences_per_block(query_start, num_tokens: int, block_q: int):
    """First and last sequence owning rows of each query block (last < first if none)."""
    num_seqs = query_start.shape[0] - 1
    total = query_start[num_seqs]
    lo = jnp.arange(0, num_tokens, block_q, dtype=jnp.int32)
    hi = jnp.minimum(lo + block_q, total) - 1
    owner = lambda rows: jnp.clip(jnp.searchsorted(query_start, rows, side="right") - 1, 0,
                                  num_seqs - 1).astype(jnp.int32)
    first = owner(lo)
    last = jnp.where(lo < total, owner(hi), first - 1)
    return first, last


def ragged_prefill_attention(
    q: jax.Array,  # f[T, Hq, D], flat query tokens of all sequences, then padding
    k_pages: jax.Array,  # f[Hkv, N, B, D] head-major, this step's K already written
    v_pages: jax.Array,  # f[Hkv, N, B, D] head-major, this step's V already written
    page_tables: jax.Array,  # i32[S, P]
    seq_lens: jax.Array,  # i32[S], total KV length of s including its queries
    query_start: jax.Array,  # i32[S+1], cumulative; s owns rows query_start[s]:query_start[s+1]
    *,
    sm_scale: float,
    block_sizes: PrefillBlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # f[T, Hq, D] in q.dtype; rows >= query_start[S] are zeros
    """Causal ragged attention over a paged KV pool; see the module docstring."""
    validate_prefill_inputs(q, k_pages, v_pages, page_tables, seq_lens, query_start)
    block_sizes = block_sizes or PrefillBlockSizes()
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_seqs = page_tables.shape[0]
    group = num_q_heads // num_kv_heads
    block_q = block_sizes.block_q
    block_kv_pages = min(block_sizes.block_kv_pages, page_tables.shape[1])
    table = prepare_page_tables(page_tables, seq_lens, num_pages=num_pages, page_size=page_size,
                                pages_per_block=block_kv_pages)
    table_width = table.shape[0] // num_seqs
    padded_tokens = pl.cdiv(num_tokens, block_q) * block_q
    q4 = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
    q4 = q4.reshape(padded_tokens, num_kv_heads, group, head_dim)
    first_seq, last_seq = _sequences_per_block(query_start, padded_tokens, block_q)
    q_spec = pl.BlockSpec((block_q, None, group, head_dim), lambda i, h, *_: (i, h, 0, 0))
    kernel = functools.partial(_prefill_kernel, sm_scale=float(sm_scale),
                               block_kv_pages=block_kv_pages, table_width=table_width)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(padded_tokens // block_q, num_kv_heads),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((block_kv_pages, page_size, head_dim), k_pages.dtype),
                pltpu.VMEM((block_kv_pages, page_size, head_dim), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        interpret=resolve_interpret(interpret),
    )(seq_lens, table, query_start, first_seq, last_seq, q4, k_pages, v_pages)
    return out.reshape(padded_tokens, num_q_heads, head_dim)[:num_tokens]
