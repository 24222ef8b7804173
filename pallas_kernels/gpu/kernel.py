"""The Pallas-Triton kernel body: one program = (query block b, KV head h, split k).

It holds the block's tokens times the padded head group of h as one query matrix f[M, D]
(M = block_q * Gp rows, token-major: row r is token r // Gp, head r % Gp), so every K/V page it
loads serves all G query heads. It walks split k's pages of its row up to the block's causal
limit, `pages_per_block` pages per step, each page a contiguous [B, D] block of the head-major
pool gathered through the page table, and keeps an online softmax in float32:

  m' = max(m, max_j s_j);  l' = exp(m - m') l + sum_j p_j;  acc' = exp(m - m') acc + p V,
  p_j = exp(s_j - m') for unmasked keys and 0 for masked ones.

Masked scores take a finite MASK_VALUE (no inf - inf), and it writes the unnormalised (acc, m, l)
of its split for `attention.merge_splits`. Scores are formed, soft-capped and masked only in
`_scores`. With a sliding window a program starts at the key block of its block's earliest window
(whole blocks of its split before it are skipped), masks keys by position and zeroes the V rows
before the widest window (pages there may be released: the scratch page 0).

int8 pages (`quantized`) come with float32 scales per token, loaded beside the K/V block. The
int8 block is cast to the compute dtype of q (exact: |x| <= 127 fits bf16's 8-bit significand)
and the scales are applied to the [M, L] side, never to the [L, D] block: K's per key column of
the scores, V's folded into p before the PV dot (p_j v_scale_j v_j). Garbage slots hold finite
int8 but may hold NaN scales: the scores' select drops K's, and V's are selected to 0 before the
fold (p_j = 0 there, but 0 * NaN is NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(MASK_VALUE - m) is 0 or 1
META_FIELDS = 4  # per query block: first query position, tokens, KV length of its row, unused


def _dot(a, b, *, trans_b: bool = False):
    """a @ b (a @ b.T with trans_b) accumulated in float32. Precision HIGHEST lowers float32
    operands to Triton's IEEE f32 dot (its default would be TF32: 10-bit mantissas) and leaves
    bf16 operands as they are."""
    out = plgpu.dot(a, b, trans_b=trans_b, precision=jax.lax.Precision.HIGHEST)
    return out.astype(jnp.float32)


def _scores(q, k, key_pos, query_pos, kv_len, *, sm_scale: float, k_scale=None,
            window: int | None = None, soft_cap: float | None = None):
    """The one place scores are formed and masked. q f[M, D], k f[L, D], key_pos i32[L],
    query_pos i32[M], k_scale f32[L] or None -> (f32[M, L] scores with masked entries at
    MASK_VALUE, bool[M, L] valid): a key counts if it is below the row's KV length, not after
    the query's position and, with a window, after position - window. Scores are soft-capped
    (soft_cap * tanh(s / soft_cap)) where soft_cap is given. Masking is a select, so NaN scales
    of masked keys are dropped."""
    s = _dot(q, k, trans_b=True)
    s = s * sm_scale if k_scale is None else s * (k_scale * sm_scale)[None, :]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    valid = (key_pos[None, :] < kv_len) & (key_pos[None, :] <= query_pos[:, None])
    if window is not None:
        valid &= key_pos[None, :] > query_pos[:, None] - window
    return jnp.where(valid, s, MASK_VALUE), valid


def attention_kernel(
    meta_ref,  # i32[META_FIELDS] of this query block
    table_ref,  # i32[splits * pages_per_split]: this block's row of the page table, padded
    q_ref,  # f[M, D]: the block's tokens x padded head group of this KV head
    k_ref,  # f[N, B, D] (i8 if quantized): this KV head's pages
    v_ref,  # f[N, B, D] (i8 if quantized)
    *refs,  # if quantized: ks_ref, vs_ref f32[N, B], their scales; then the outputs:
    #   acc_ref f32[M, D]: unnormalised sum of p V over this split's keys
    #   m_ref f32[M]: running max of the scores (MASK_VALUE if no key was seen)
    #   l_ref f32[M]: sum of p
    sm_scale: float,
    group_pad: int,
    pages_per_block: int,
    pages_per_split: int,
    quantized: bool,
    window: int | None = None,
    soft_cap: float | None = None,
):
    ks_ref, vs_ref = refs[:2] if quantized else (None, None)
    acc_ref, m_ref, l_ref = refs[-3:]
    q_pos0, count, kv_len = meta_ref[0], meta_ref[1], meta_ref[2]
    split = pl.program_id(2)
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    block_k = pages_per_block * page_size
    q = q_ref[...]
    query_pos = q_pos0 + jnp.arange(rows, dtype=jnp.int32) // group_pad
    # Keys this block may see: below the row's length and up to its last query's position.
    limit = jnp.minimum(kv_len, q_pos0 + count)
    first_page = split * pages_per_split
    last_page = jnp.minimum(first_page + pages_per_split, pl.cdiv(limit, page_size))
    lowest = 0  # the first key any query of the block reads
    if window is not None:  # start at the earliest window's block (whole blocks of the split)
        lowest = jnp.maximum(q_pos0 - window + 1, 0)
        skip = jnp.maximum(lowest // page_size - first_page, 0) // pages_per_block
        first_page = first_page + skip * pages_per_block
    steps = jnp.where(count > 0,
                      pl.cdiv(jnp.maximum(last_page - first_page, 0), pages_per_block), 0)

    def body(i, carry):
        acc, m, l = carry
        page0 = first_page + i * pages_per_block
        pages = table_ref[pl.ds(page0, pages_per_block)]
        k = k_ref[pages].reshape(block_k, head_dim).astype(q.dtype)  # i8 -> q's dtype: exact
        v = v_ref[pages].reshape(block_k, head_dim).astype(q.dtype)
        key_pos = page0 * page_size + jnp.arange(block_k, dtype=jnp.int32)
        # bool[L]: slots past the length, or before every window, hold garbage
        in_row = (key_pos < kv_len) & (key_pos >= lowest)
        k_scale = ks_ref[pages].reshape(block_k) if quantized else None  # f32[L]
        s, valid = _scores(q, k, key_pos, query_pos, kv_len, sm_scale=sm_scale, k_scale=k_scale,
                           window=window, soft_cap=soft_cap)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
        l_new = alpha * l + jnp.sum(p, axis=1)
        if quantized:  # int8 is finite; its scale may be NaN (0 * NaN is NaN)
            p = p * jnp.where(in_row, vs_ref[pages].reshape(block_k), 0.0)[None, :]
        else:  # float garbage may be NaN (0 * NaN is NaN)
            v = jnp.where(in_row[:, None], v, jnp.zeros_like(v))
        pv = _dot(p.astype(v.dtype), v)
        return alpha[:, None] * acc + pv, m_new, l_new

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, steps, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l
