"""Pieces both TPU attention paths share: the page table in SMEM, the double-buffered key-block
loop, the one place scores are masked, and the online softmax with lane-broadcast statistics.

Double buffering. K and V each get a VMEM buffer [2, pages_per_block, B, D] and a DMA semaphore
per slot. Before the loop the copies of key block 0 start into slot 0; iteration i starts the
copies of block i+1 into slot (i+1) % 2, then waits for block i in slot i % 2 and computes on it,
so the copy of the next block overlaps this block's matmuls. Every page is its own DMA of one
contiguous [B, D] block k_pages[h, page] of the head-major pool (left in HBM); the
pages_per_block copies of one block signal the same semaphore and are waited one by one.

Statistics. The running max m and normaliser l are carried as f32[R, 128] (every lane holds the
same value) rather than f32[R, 1], the layout TPU vector registers hold natively; column 0 is
sliced off where a [R, 1] operand is needed.

Room for later features: sliding windows and logit soft-capping belong in `masked_scores` (the one
place scores are formed and masked), int8 KV scales where `pipelined_kv_loop` converts a block to
float32; each would arrive as a keyword-only argument of the entry point.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_HIGHEST = jax.lax.Precision.HIGHEST
LANES = 128
# Finite "minus infinity" for masked scores and the initial running max: keeps exp(m - m')
# free of inf - inf even for rows that see no valid key in a block.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def resolve_interpret(interpret: bool):
    """True: Pallas TPU interpret mode (any backend); False: compile with Mosaic (TPU only)."""
    return pltpu.InterpretParams() if interpret else False


def prepare_page_tables(page_tables, seq_lens, *, num_pages: int, page_size: int,
                        pages_per_block: int) -> jax.Array:
    """Flattened i32[S * P'] table for SMEM, P' = P rounded up to a multiple of pages_per_block.

    Entries past a row's last used page point at the scratch page 0 (they are read as whole
    blocks but masked); used entries are clipped into [0, N) so a copy never leaves the pool.
    """
    num_seqs, pages_per_seq = page_tables.shape
    padded = pl.cdiv(pages_per_seq, pages_per_block) * pages_per_block
    used = jnp.arange(pages_per_seq)[None, :] < pl.cdiv(seq_lens, page_size)[:, None]
    table = jnp.where(used, jnp.clip(page_tables, 0, num_pages - 1), 0)
    table = jnp.pad(table, ((0, 0), (0, padded - pages_per_seq)))
    return table.reshape(num_seqs * padded)


def kv_scratch(pages_per_block: int, page_size: int, head_dim: int, dtype) -> list:
    """Scratch for `pipelined_kv_loop`: K and V buffers [2, pages, B, D], DMA semaphores (2, 2)."""
    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), dtype)
    return [buf, buf, pltpu.SemaphoreType.DMA((2, 2))]


def pipelined_kv_loop(num_blocks, first_entry, body, carry, *, table_ref, kv_head, k_hbm, v_hbm,
                      k_buf, v_buf, sems):
    """carry = body(block, k f32[L, D], v f32[L, D], carry) for block < num_blocks, double buffered.

    first_entry(block): index in table_ref of the block's first page; L = pages_per_block * B.
    """
    pages_per_block, page_size, head_dim = k_buf.shape[1:]

    def copies(block, slot):
        entry = first_entry(block)
        out = []
        for i in range(pages_per_block):
            page = table_ref[entry + i]
            for kind, (hbm, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
                out.append(pltpu.make_async_copy(hbm.at[kv_head, page], buf.at[slot, i],
                                                 sems.at[kind, slot]))
        return out

    @pl.when(num_blocks > 0)
    def _():
        for copy in copies(0, 0):
            copy.start()

    def step(block, carry):
        slot = jax.lax.rem(block, 2)

        @pl.when(block + 1 < num_blocks)
        def _():
            for copy in copies(block + 1, 1 - slot):
                copy.start()

        for copy in copies(block, slot):
            copy.wait()
        k = k_buf[slot].reshape(pages_per_block * page_size, head_dim).astype(jnp.float32)
        v = v_buf[slot].reshape(pages_per_block * page_size, head_dim).astype(jnp.float32)
        return body(block, k, v, carry)

    return jax.lax.fori_loop(0, num_blocks, step, carry)


def masked_scores(q, k, valid, *, sm_scale: float):
    """The one place scores are formed and masked. q f32[R, D], k f32[L, D], valid bool[R, L]
    (key inside the row's causal range) -> f32[R, L], masked entries MASK_VALUE. Sliding windows
    and logit soft-capping belong here."""
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                                 preferred_element_type=jnp.float32) * sm_scale
    return jnp.where(valid, scores, MASK_VALUE)


def online_softmax_step(carry, scores, valid, v, v_valid):
    """One key block: scores f32[R, L] (masked), valid bool[R, L], v f32[L, D], v_valid bool[L, 1].
    carry = (m f32[R, 128], l f32[R, 128], acc f32[R, D])."""
    m_prev, l_prev, acc_prev = carry
    m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))  # [R, 128]
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.where(valid, jnp.exp(scores - m_new[:, :1]), 0.0)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    v = jnp.where(v_valid, v, 0.0)  # NaN in unused slots never meets a zero weight
    pv = jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())), precision=_HIGHEST,
                             preferred_element_type=jnp.float32)
    return m_new, l_new, alpha[:, :1] * acc_prev + pv


def init_carry(rows: int, head_dim: int):
    return (jnp.full((rows, LANES), MASK_VALUE, jnp.float32),
            jnp.zeros((rows, LANES), jnp.float32), jnp.zeros((rows, head_dim), jnp.float32))


def finish(carry):
    """acc / l, zeros for rows that saw no valid key."""
    _, l, acc = carry
    l = l[:, :1]
    return jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
