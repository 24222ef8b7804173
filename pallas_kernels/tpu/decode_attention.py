"""Paged decode attention as a TPU-style Pallas kernel: one query token per sequence.

Grid (S, Hkv), both parallel. Program (s, h) holds the G = Hq // Hkv query heads that share KV
head h (grouped-query attention without repeating K/V in memory) and walks sequence s's pages in
blocks of `pages_per_block`, reading page ids from the page table in SMEM (scalar prefetch,
`pltpu.PrefetchScalarGridSpec`) and copying each page's block for head h, the contiguous
k_pages[h, page] of shape [B, D] in the head-major pool f[Hkv, N, B, D] (left in HBM,
`memory_space=ANY`), into VMEM with async copies. Online softmax in float32:
m' = max(m, max_j s_j); l' = exp(m - m') l + sum_j exp(s_j - m'); acc' = exp(m - m') acc + p V.
Only ceil(seq_len / (pages_per_block * B)) blocks are visited; keys at positions >= seq_len are
masked with a select before exp and their V rows zeroed with a select, so garbage or NaN in the
scratch page 0, in unused pages, or in the tail of the last page never reaches the output.
seq_len == 0 rows give zeros.

What has been run: Pallas TPU interpret mode on CPU only (`interpret=pltpu.InterpretParams()`),
jax/jaxlib 0.10.2, and Pallas -> Mosaic lowering for platform "tpu" via jax.export on CPU (no TPU
needed; tested). Nothing here has been compiled by the Mosaic/TPU compiler, run on a TPU or GPU,
or timed on hardware. Known gaps for real hardware: no double buffering (each block's copies are
started and waited before its compute); one DMA per page, each moving a single contiguous B*D
block (e.g. 16 * 128 * 2 B = 4 KiB in bf16), so small pages mean many small copies; the
(pages, B, D) -> (pages*B, D) reshape assumes Mosaic-friendly B (a multiple of 8) and D (a
multiple of 128 is ideal); and m/l are kept as [G, 1] values rather than lane-broadcast
[G, 128]. The kernel is TPU-style; on GPU it only runs in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu.block_sizes import DecodeBlockSizes

_HIGHEST = jax.lax.Precision.HIGHEST
# Finite "minus infinity" for masked scores and the initial running max: keeps exp(m - m')
# free of inf - inf even for rows that see no valid key in a block.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


# ---------------------------------------------------------------------------------------------
# Validation and helpers shared with the prefill kernel.


def resolve_interpret(interpret: bool):
    """True: Pallas TPU interpret mode (any backend); False: compile with Mosaic (TPU only)."""
    return pltpu.InterpretParams() if interpret else False


def is_concrete(*arrays) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def check_pool(q, k_pages, v_pages, page_tables, seq_lens, *, q_rank_name: str) -> None:
    """Static checks common to both kernels (shapes, dtypes, Hq % Hkv)."""
    if q.ndim != 3:
        raise ValueError(f"q must be {q_rank_name}, got shape {q.shape}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype}")
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be f[Hkv, N, B, D] (head-major), got shape "
                         f"{k_pages.shape}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages shapes differ: {k_pages.shape} vs {v_pages.shape}")
    if k_pages.dtype != v_pages.dtype or not jnp.issubdtype(k_pages.dtype, jnp.floating):
        raise ValueError(f"k_pages and v_pages must share one floating dtype, got "
                         f"{k_pages.dtype} and {v_pages.dtype}")
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads, _, _, head_dim_kv = k_pages.shape
    if head_dim != head_dim_kv:
        raise ValueError(f"head dim of q ({head_dim}) != head dim of k/v pages ({head_dim_kv})")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads Hq={num_q_heads} must be a multiple of KV heads "
                         f"Hkv={num_kv_heads}")
    if page_tables.ndim != 2 or page_tables.dtype != jnp.int32:
        raise ValueError(f"page_tables must be i32[S, P], got {page_tables.dtype}"
                         f"{list(page_tables.shape)}")
    if seq_lens.shape != (page_tables.shape[0],) or seq_lens.dtype != jnp.int32:
        raise ValueError(f"seq_lens must be i32[S] with S={page_tables.shape[0]} (rows of "
                         f"page_tables), got {seq_lens.dtype}{list(seq_lens.shape)}")


def check_page_values(page_tables, seq_lens, num_pages: int, page_size: int) -> None:
    """Concrete-value checks: lengths fit the table and used page ids lie in [0, N)."""
    page_tables = np.asarray(page_tables)
    seq_lens = np.asarray(seq_lens)
    capacity = page_tables.shape[1] * page_size
    bad = np.flatnonzero((seq_lens < 0) | (seq_lens > capacity))
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"seq_lens[{s}] = {int(seq_lens[s])} outside [0, P*B = {capacity}]")
    used = np.arange(page_tables.shape[1])[None, :] < -(-seq_lens[:, None] // page_size)
    out_of_range = used & ((page_tables < 0) | (page_tables >= num_pages))
    if out_of_range.any():
        s, j = (int(i) for i in np.argwhere(out_of_range)[0])
        raise ValueError(f"page_tables[{s}, {j}] = {int(page_tables[s, j])} is outside the pool "
                         f"[0, N = {num_pages}) but holds positions below seq_lens[{s}] = "
                         f"{int(seq_lens[s])}")


def prepare_page_tables(page_tables, seq_lens, *, num_pages: int, page_size: int,
                        pages_per_block: int) -> jax.Array:
    """Flattened i32[S * P'] table for SMEM, P' = P rounded up to a multiple of pages_per_block.

    Entries past a sequence's last used page point at the scratch page 0 (they are read as whole
    blocks but masked); used entries are clipped into [0, N) so a copy never leaves the pool.
    """
    num_seqs, pages_per_seq = page_tables.shape
    padded = pl.cdiv(pages_per_seq, pages_per_block) * pages_per_block
    used = jnp.arange(pages_per_seq)[None, :] < pl.cdiv(seq_lens, page_size)[:, None]
    table = jnp.where(used, jnp.clip(page_tables, 0, num_pages - 1), 0)
    table = jnp.pad(table, ((0, 0), (0, padded - pages_per_seq)))
    return table.reshape(num_seqs * padded)


def copy_kv_block(pages_hbm, buf, sem, table_ref, first_entry, kv_head, pages_per_block):
    """Copy the contiguous [B, D] blocks pages_hbm[kv_head, table_ref[first_entry + i]],
    i < pages_per_block, into buf [pages_per_block, B, D]; return them as f32[pages*B, D]."""
    copies = []
    for i in range(pages_per_block):
        page = table_ref[first_entry + i]
        copy = pltpu.make_async_copy(pages_hbm.at[kv_head, page], buf.at[i], sem)
        copy.start()
        copies.append(copy)
    for copy in copies:
        copy.wait()
    num, page_size, head_dim = buf.shape
    return buf[...].reshape(num * page_size, head_dim).astype(jnp.float32)


def online_softmax_step(carry, q, k, v, score_valid, v_valid, sm_scale):
    """One key block. q: f32[R, D]; k, v: f32[L, D]; score_valid: bool[R, L]; v_valid: bool[L, 1]."""
    m_prev, l_prev, acc_prev = carry
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=_HIGHEST,
                                 preferred_element_type=jnp.float32) * sm_scale
    scores = jnp.where(score_valid, scores, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.where(score_valid, jnp.exp(scores - m_new), 0.0)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    v = jnp.where(v_valid, v, 0.0)
    pv = jax.lax.dot_general(p, v, (((1,), (0,)), ((), ())), precision=_HIGHEST,
                             preferred_element_type=jnp.float32)
    return m_new, l_new, alpha * acc_prev + pv


def init_carry(rows: int, head_dim: int):
    return (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, head_dim), jnp.float32))


def finish(carry):
    _, l, acc = carry
    return jnp.where(l > 0, acc / jnp.where(l > 0, l, 1.0), 0.0)


# ---------------------------------------------------------------------------------------------
# Decode.


def validate_decode_inputs(q, k_pages, v_pages, page_tables, seq_lens) -> None:
    """All checks; call outside jit to also check page-table values and lengths."""
    check_pool(q, k_pages, v_pages, page_tables, seq_lens, q_rank_name="f[S, Hq, D]")
    if q.shape[0] != page_tables.shape[0]:
        raise ValueError(f"q has {q.shape[0]} rows but page_tables has S={page_tables.shape[0]}")
    if is_concrete(page_tables, seq_lens):
        check_page_values(page_tables, seq_lens, k_pages.shape[1], k_pages.shape[2])


def _decode_kernel(seq_lens_ref, table_ref,  # scalar prefetch (SMEM): i32[S], i32[S * P']
                   q_ref,  # [G, D] query heads of sequence s that share KV head h
                   k_hbm, v_hbm,  # [Hkv, N, B, D], left in HBM
                   o_ref,  # [G, D]
                   k_buf, v_buf,  # VMEM [pages_per_block, B, D]
                   sems,  # DMA semaphores (2,)
                   *, sm_scale: float, pages_per_block: int, table_width: int):
    s, h = pl.program_id(0), pl.program_id(1)
    seq_len = seq_lens_ref[s]
    page_size = k_buf.shape[1]
    block_len = pages_per_block * page_size
    q = q_ref[...].astype(jnp.float32)

    def body(block, carry):
        first_entry = s * table_width + block * pages_per_block
        k = copy_kv_block(k_hbm, k_buf, sems.at[0], table_ref, first_entry, h, pages_per_block)
        v = copy_kv_block(v_hbm, v_buf, sems.at[1], table_ref, first_entry, h, pages_per_block)
        key_pos = block * block_len + jax.lax.broadcasted_iota(jnp.int32, (1, block_len), 1)
        v_pos = block * block_len + jax.lax.broadcasted_iota(jnp.int32, (block_len, 1), 0)
        score_valid = jnp.broadcast_to(key_pos < seq_len, (q.shape[0], block_len))
        return online_softmax_step(carry, q, k, v, score_valid, v_pos < seq_len, sm_scale)

    carry = jax.lax.fori_loop(0, pl.cdiv(seq_len, block_len), body,
                              init_carry(q.shape[0], q.shape[1]))
    o_ref[...] = finish(carry).astype(o_ref.dtype)


def paged_decode_attention(
    q: jax.Array,  # f[S, Hq, D], the newest token of each sequence
    k_pages: jax.Array,  # f[Hkv, N, B, D], head-major
    v_pages: jax.Array,  # f[Hkv, N, B, D], head-major
    page_tables: jax.Array,  # i32[S, P]
    seq_lens: jax.Array,  # i32[S], KV length including the query token; 0 = padding row
    *,
    sm_scale: float,
    block_sizes: DecodeBlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # f[S, Hq, D] in q.dtype
    """Decode attention over a paged KV pool; see the module docstring.

    The query of row s sits at position seq_lens[s]-1 and attends to KV positions
    0..seq_lens[s]-1; position j of KV head h is k_pages[h, page_tables[s, j // B], j % B].
    Padding rows (seq_lens[s] == 0) give zeros.
    """
    validate_decode_inputs(q, k_pages, v_pages, page_tables, seq_lens)
    block_sizes = block_sizes or DecodeBlockSizes()
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    pages_per_block = min(block_sizes.pages_per_block, page_tables.shape[1])
    table = prepare_page_tables(page_tables, seq_lens, num_pages=num_pages, page_size=page_size,
                                pages_per_block=pages_per_block)
    table_width = table.shape[0] // num_seqs
    q_spec = pl.BlockSpec((None, None, group, head_dim), lambda s, h, *_: (s, h, 0, 0))
    kernel = functools.partial(_decode_kernel, sm_scale=float(sm_scale),
                               pages_per_block=pages_per_block, table_width=table_width)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_seqs, num_kv_heads),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((pages_per_block, page_size, head_dim), k_pages.dtype),
                pltpu.VMEM((pages_per_block, page_size, head_dim), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        out_shape=jax.ShapeDtypeStruct((num_seqs, num_kv_heads, group, head_dim), q.dtype),
        interpret=resolve_interpret(interpret),
    )(seq_lens, table, q.reshape(num_seqs, num_kv_heads, group, head_dim), k_pages, v_pages)
    return out.reshape(num_seqs, num_q_heads, head_dim)
