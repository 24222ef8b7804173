"""Pieces both TPU attention paths share: the page table in SMEM, the double-buffered key-block
loop (with int8 dequantization), the one place scores are masked, and the online softmax with
lane-broadcast statistics.

Double buffering. K and V each get a VMEM buffer [2, pages_per_block, B, D] and a DMA semaphore
per slot. Before the loop the copies of key block 0 start into slot 0; iteration i starts the
copies of block i+1 into slot (i+1) % 2, then waits for block i in slot i % 2 and computes on it,
so the copy of the next block overlaps this block's matmuls. Every page is its own DMA of one
contiguous [B, D] block k_pages[h, page] of the head-major pool (left in HBM); the
pages_per_block copies of one block signal the same semaphore and are waited one by one. A
page-major pool kv[N, B, 2 * Hkv * D] (float pages) has one buffer [2, pages_per_block, B, 2D]
instead: one DMA per page moves head h's lanes [B, 2D] (K then V; 2D whole 128-lane tiles, so
XLA keeps the pool row-major and no call relayouts it, unlike a head-major pool of head dim 64).

Statistics. The running max m and normaliser l are carried as f32[R, 128] (every lane holds the
same value) rather than f32[R, 1], the layout TPU vector registers hold natively; column 0 is
sliced off where a [R, 1] operand is needed.

int8 pages. The scales f32[Hkv, N, B] are viewed as f32[Hkv, N, 1, B] (`pool_operands`), so a
page's scales are one [1, B] block copied exactly like its K/V block (whole tiled dims, only
untiled dims indexed) into VMEM [2, pages_per_block, 1, B], double buffered alongside. After the
wait a block is dequantized in VMEM as the reference does it, k = int8 * scale in float32 (one
rounding), with the scales turned into a column f32[L, 1] that broadcasts along D
(`scale_column`: each page's [1, B] row transposed to [B, 1], the columns stacked along
sublanes; Mosaic has no rule for folding [pages, B] lanes into one column by reshape); scores
and the online softmax are then those of float pages. A NaN scale (garbage slot) only makes its
own K/V row NaN: that key's score is dropped by the select in `masked_scores` and its V row by
the select in `online_softmax_step`. Compiled by Mosaic for v5e and v6e (tests/
test_tpu_compile.py), not run on a TPU: the view may cost a relayout copy of the scale pool per
call on TPU if XLA tiles [.., N, B] and [.., 1, B] differently (storing the scales as
[Hkv, N, 1, B] avoids it); each [1, B] VMEM block is padded to a whole tile.

Attention sinks (`sinks` f[Hq]): each program's softmax starts from its rows' sinks (`init_carry`,
`sink_operand`: one more [R, 128] input block per KV head) instead of an empty state, so the
loop over keys is unchanged and a model without sinks has no such input.

Cost (`attention_cost`, `with_cost`). Every pallas_call here declares a pl.CostEstimate, so XLA's
TPU cost model (`compiled.cost_analysis()`) counts the pages a kernel reads, which it cannot see
inside a custom call: from the static shapes at the bucket's full context (every row P pages),
the pages each (row, query block) pair reads, K and V (and int8 scales), plus q, out and the
table. JAX's ragged paged attention declares none; `with_cost` attaches one to its pallas_call.

Sliding windows and soft-capping (keyword-only arguments of the entry point): both paths start
their key-block loop at the block holding the earliest key any of their queries' windows reaches
(`window_start`) and mask the rest by position with the causal limit (their values too: pages
before a window may be released, i.e. the scratch page 0); `masked_scores`, the one place scores
are formed, soft-caps them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu import scale_rows

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


class PoolLayout(NamedTuple):
    """What both paths read off the pool and page table before their pallas_call."""
    num_kv_heads: int
    group: int  # G = Hq // Hkv query heads per KV head
    page_size: int  # B
    pages_per_block: int  # clamped to the page-table width P
    table: jax.Array  # i32[S * P'] (`prepare_page_tables`)
    table_width: int  # P'


def pool_layout(q, k_pages, v_pages, page_tables, seq_lens, *,
                pages_per_block: int) -> PoolLayout:
    """The layout of a head-major pool K, V [Hkv, N, B, D] or a page-major one
    kv f[N, B, 2 * Hkv * D] (v_pages None) for queries q [T, Hq, D]."""
    num_q_heads, head_dim = q.shape[1:]
    if v_pages is None:
        num_pages, page_size, lanes = k_pages.shape
        num_kv_heads = lanes // (2 * head_dim)
    else:
        num_kv_heads, num_pages, page_size, _ = k_pages.shape
    pages_per_block = min(pages_per_block, page_tables.shape[1])
    table = prepare_page_tables(page_tables, seq_lens, num_pages=num_pages, page_size=page_size,
                                pages_per_block=pages_per_block)
    return PoolLayout(num_kv_heads, num_q_heads // num_kv_heads, page_size, pages_per_block,
                      table, table.shape[0] // page_tables.shape[0])


def pool_operands(k_pages, v_pages, k_scale, v_scale, kv_scales=None) -> tuple:
    """The pool as the kernels take it (all left in HBM): (K, V) pages, then for int8 pages their
    scales viewed as f32[Hkv, N, 1, B], so one page's scales are a whole [1, B] block; or, for a
    page-major pool (v_pages None), (kv f[N, B, 2 * Hkv * D],), int8 with its scale rows
    (kv, kv_scales f32[N, L]: scale_rows.py)."""
    if v_pages is None:
        return (k_pages,) if kv_scales is None else (k_pages, kv_scales)
    if k_scale is None:
        return k_pages, v_pages
    scale_shape = (*k_scale.shape[:2], 1, k_scale.shape[2])
    return k_pages, v_pages, k_scale.reshape(scale_shape), v_scale.reshape(scale_shape)


def split_refs(refs, *, num_pool: int):
    """A kernel's refs after q_ref -> (pool refs in HBM, o_ref, VMEM buffers, DMA semaphores).
    Pool refs and buffers are (K, V), (K, V, K scale, V scale) for int8 pages, or (KV,) for a
    page-major pool (`pool_operands`)."""
    n = num_pool
    return refs[:n], refs[n], refs[n + 1:2 * n + 1], refs[2 * n + 1]


def kv_scratch(pages_per_block: int, page_size: int, head_dim: int, dtype, *,
               quantized: bool, page_major: bool = False) -> list:
    """Scratch for `pipelined_kv_loop`: K and V buffers [2, pages, B, D], for int8 pages K and V
    scale buffers f32[2, pages, 1, B], and DMA semaphores (one row per buffer, one column per
    slot); a page-major pool's one buffer [2, pages, B, 2D] holds a head's K and V lanes, int8
    with a buffer f32[2, pages, 1, W] of the scale rows' tiles holding its scales."""
    if page_major:
        bufs = [pltpu.VMEM((2, pages_per_block, page_size, 2 * head_dim), dtype)]
        if quantized:
            bufs.append(pltpu.VMEM((2, pages_per_block, 1, scale_rows.window_lanes(page_size)),
                                   jnp.float32))
        return bufs + [pltpu.SemaphoreType.DMA((len(bufs), 2))]
    buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), dtype)
    bufs = [buf, buf]
    if quantized:
        bufs += [pltpu.VMEM((2, pages_per_block, 1, page_size), jnp.float32)] * 2
    return bufs + [pltpu.SemaphoreType.DMA((len(bufs), 2))]


def scale_column(buf, slot) -> jax.Array:
    """f32[L, 1] scales of the block in `slot` of buf f32[2, pages, 1, B]: each page's [1, B]
    row transposed to a [B, 1] column, the pages' columns stacked along sublanes. Exact (data
    movement only)."""
    pages_per_block = buf.shape[1]
    return jnp.concatenate([buf[slot, i].T for i in range(pages_per_block)], axis=0)


def row_scale_columns(buf, slot, first_lane, page_size: int) -> tuple:
    """(K, V) f32[L, 1] scales of the block in `slot` of buf f32[2, pages, 1, W] (scale-row
    tiles, scale_rows.py): page i's key scales at lanes first_lane .. + B of its [1, W] tile,
    its value scales next, each made a column by a select and a lane sum (exact: one lane
    kept; a NaN in another lane is not summed)."""
    pages_per_block, width = buf.shape[1], buf.shape[3]
    lane = jax.lax.broadcasted_iota(jnp.int32, (page_size, width), 1)
    slot_of_row = jax.lax.broadcasted_iota(jnp.int32, (page_size, width), 0)
    columns = []
    for start in (first_lane, first_lane + page_size):
        pick = lane == start + slot_of_row
        columns.append(jnp.concatenate([
            jnp.sum(jnp.where(pick, buf[slot, i], 0.0), axis=1, keepdims=True)
            for i in range(pages_per_block)], axis=0))
    return tuple(columns)


def pipelined_kv_loop(num_blocks, first_entry, body, carry, *, table_ref, kv_head, pool, bufs,
                      sems):
    """carry = body(block, k f32[L, D], v f32[L, D], carry) for block < num_blocks, double buffered.

    first_entry(block): index in table_ref of the block's first page; L = pages_per_block * B.
    pool, bufs: (K, V) or, for int8 pages, (K, V, K scale, V scale) refs in HBM and VMEM
    (`split_refs`); int8 blocks reach body dequantized. A page-major pool (KV,) f[N, B, 2HD]
    gives each page's lanes of kv_head, [B, 2D] (K then V), in one DMA: 2D is a multiple of 128,
    so the slice is whole lane tiles; int8, (KV, scale rows f32[N, L]) with a second DMA per page
    moving the [1, W] tile of its row that holds kv_head's scales.
    """
    pages_per_block, page_size, width = bufs[0].shape[1:]
    page_major = len(pool[0].shape) == 3
    head_dim = width // 2 if page_major else width
    if page_major and len(pool) == 2:  # where kv_head's scales sit in the scale rows
        stride, window = scale_rows.head_stride(page_size), bufs[1].shape[3]
        tile_start = pl.multiple_of(jax.lax.div(kv_head * stride, window) * window, window)
        first_lane = kv_head * stride - tile_start

    def copies(block, slot):
        entry = first_entry(block)
        out = []
        for i in range(pages_per_block):
            page = table_ref[entry + i]
            if page_major:
                lanes = pl.ds(pl.multiple_of(kv_head * width, width), width)
                out.append(pltpu.make_async_copy(pool[0].at[page, :, lanes], bufs[0].at[slot, i],
                                                 sems.at[0, slot]))
                if len(pool) == 2:
                    out.append(pltpu.make_async_copy(
                        pool[1].at[pl.ds(page, 1), pl.ds(tile_start, window)],
                        bufs[1].at[slot, i], sems.at[1, slot]))
                continue
            for kind, (hbm, buf) in enumerate(zip(pool, bufs)):
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
        # Convert first, then fold pages into sublanes: a float32 fold is layout-free for B a
        # multiple of 8, an int8 (32-row tiles) or bf16 (16-row tiles) one need not be.
        if page_major:
            kv = bufs[0][slot].astype(jnp.float32).reshape(pages_per_block * page_size, width)
            k, v = kv[:, :head_dim], kv[:, head_dim:]
            if len(pool) == 2:  # int8 * scale in float32, as `dequantize_pages` rounds it
                k_col, v_col = row_scale_columns(bufs[1], slot, first_lane, page_size)
                k, v = k * k_col, v * v_col
            return body(block, k, v, carry)
        k, v = (buf[slot].astype(jnp.float32).reshape(pages_per_block * page_size, head_dim)
                for buf in bufs[:2])
        if len(bufs) == 4:  # int8 * scale in float32, as `dequantize_pages` rounds it
            k, v = k * scale_column(bufs[2], slot), v * scale_column(bufs[3], slot)
        return body(block, k, v, carry)

    return jax.lax.fori_loop(0, num_blocks, step, carry)


def masked_scores(q, k, valid, *, sm_scale: float, soft_cap: float | None = None):
    """The one place scores are formed and masked. q f32[R, D], k f32[L, D], valid bool[R, L]
    (key inside the row's causal range and window) -> f32[R, L], soft-capped
    (soft_cap * tanh(s / soft_cap)) where soft_cap is given, masked entries MASK_VALUE."""
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                                 preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    return jnp.where(valid, scores, MASK_VALUE)


def window_start(first_position, window: int | None, block_len: int):
    """The first key block any query from `first_position` on reads: 0 without a window."""
    if window is None:
        return 0
    return jax.lax.div(jnp.maximum(first_position - window + 1, 0), block_len)


def in_window(key_pos, position, window: int | None):
    """bool: key_pos <= position and, with a window, key_pos > position - window."""
    valid = key_pos <= position
    return valid if window is None else valid & (key_pos > position - window)


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


def init_carry(rows: int, head_dim: int, sink=None):
    """The softmax's starting state; sink f32[R, 128] (attention sinks, lane-broadcast): a key
    of logit sink and value 0 already seen, so it joins the denominator only."""
    if sink is not None:
        return sink, jnp.ones((rows, LANES), jnp.float32), jnp.zeros((rows, head_dim), jnp.float32)
    return (jnp.full((rows, LANES), MASK_VALUE, jnp.float32),
            jnp.zeros((rows, LANES), jnp.float32), jnp.zeros((rows, head_dim), jnp.float32))


def sink_operand(sinks, num_kv_heads: int, rows_per_group: int):
    """sinks f[Hq] -> f32[Hkv, R, 128]: the rows of KV head h's query matrix (token-major:
    row r is query head h * G + r % G) with their sink broadcast over the lanes, one block per
    KV head (the block's [R, 128] are whole dims, as Mosaic tiles them)."""
    group = sinks.shape[0] // num_kv_heads
    sink = sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group, 1)
    sink = jnp.broadcast_to(sink, (num_kv_heads, rows_per_group // group, group, LANES))
    return sink.reshape(num_kv_heads, rows_per_group, LANES)


def row_reads(num_tokens: int, num_rows: int, block_q: int) -> int:
    """The most (row, query block) pairs T tokens in S rows make with blocks of block_q tokens:
    each such pair reads the row's pages once. A row spans several blocks only by having
    tokens in each, so at most min(T, min(S, T) + blocks - 1); decode (block_q 1) gives T."""
    rows = min(num_rows, num_tokens)
    return min(num_tokens, rows + pl.cdiv(num_tokens, block_q) - 1)


def pages_read(table_width: int, page_size: int, pages_per_block: int,
               window: int | None) -> int:
    """Pages a row at the full context of its padded table (P' pages) has read: whole key blocks,
    from the block holding its window's first key (`window_start`) on."""
    if window is None:
        return table_width
    block_len = pages_per_block * page_size
    return min(table_width, (pl.cdiv(window, block_len) + 1) * pages_per_block)


def attention_cost(*, num_tokens: int, num_rows: int, block_q: int, pages_read: int,
                   page_size: int, num_q_heads: int, kv_heads_read: int, head_dim: int,
                   kv_itemsize: int, q_itemsize: int, scale_bytes: int = 0,
                   soft_cap: bool = False) -> pl.CostEstimate:
    """What a paged attention kernel reads and computes at the bucket's full context:
    row_reads pairs each read pages_read pages of kv_heads_read heads (K and V, and for int8
    pages scale_bytes per page and head: the DMAs' bytes, not the scales alone) and score block_q
    query tokens of every query head against them (QK and PV: 4 flops a query head, key and
    lane; an exp, and a tanh with soft_cap, per score)."""
    pairs = row_reads(num_tokens, num_rows, block_q)
    keys = pairs * pages_read * page_size
    scores = keys * min(block_q, num_tokens) * num_q_heads
    kv = keys * kv_heads_read * 2 * head_dim * kv_itemsize + (
        pairs * pages_read * kv_heads_read * scale_bytes)
    io = 2 * num_tokens * num_q_heads * head_dim * q_itemsize + 4 * num_rows * pages_read
    return pl.CostEstimate(flops=int(4 * scores * head_dim),
                           transcendentals=int(scores * (2 if soft_cap else 1)),
                           bytes_accessed=int(kv + io))


def scale_bytes_read(page_size: int, *, quantized: bool, page_major: bool) -> int:
    """Bytes of scales one page and KV head's DMAs move: none for float pages, [1, B] f32 blocks
    of K and V head-major (in tiles of a 128-lane row: a DMA moves 512 contiguous bytes at
    least), a [1, W] tile of the page's scale row page-major."""
    if not quantized:
        return 0
    if page_major:
        return 4 * scale_rows.window_lanes(page_size)
    return 2 * 4 * max(page_size, LANES)


def with_cost(fn, cost: pl.CostEstimate):
    """fn, whose one pallas_call declares no cost, with `cost` declared on it: fn is traced to a
    jaxpr and its pallas_call equation (inside nested jits) given the cost_estimate param that
    pallas_call's own keyword sets, then evaluated. For a kernel we call but do not own."""
    from jax.extend import core as jex_core

    def rewrite(jaxpr):
        eqns = []
        for eqn in jaxpr.eqns:
            params = dict(eqn.params)
            if eqn.primitive.name == "pallas_call":
                params["cost_estimate"] = cost
            for k, v in params.items():
                if isinstance(v, jex_core.ClosedJaxpr):
                    params[k] = jex_core.ClosedJaxpr(rewrite(v.jaxpr), v.consts)
            eqns.append(eqn.replace(params=params))
        return jaxpr.replace(eqns=eqns)

    def wrapped(*args):
        if not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(args)):
            return fn(*args)  # run eagerly: no compiled program's cost to inform
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(rewrite(closed.jaxpr), closed.consts))(
            *jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), out)

    return wrapped


def finish(carry):
    """acc / l, zeros for rows that saw no valid key."""
    _, l, acc = carry
    l = l[:, :1]
    return jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)
