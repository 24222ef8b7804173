"""Ragged paged attention for GPUs, in Pallas's Triton backend: one kernel for decode rows,
prefill chunks and their mix, with split-K over pages (flash-decoding) for few rows and long
contexts.

Work is cut into query blocks: each row's query tokens in blocks of `block_q` tokens (a decode row
is one block of one token). A program (query block b, KV head h, split k) holds the block's
tokens times the G query heads of KV head h as one [M = block_q * Gp, D] matrix (GQA without
repeating K/V: every loaded page serves all G heads; G is padded to a power of two, Gp), walks the
pages of split k of its row up to the block's causal limit, `pages_per_block` pages per step,
gathered through the page table from the head-major pool f[Hkv, N, B, D], and keeps an online
softmax in float32. Splits write unnormalised partial results (acc, m, l) that a small jnp step
merges. The grid is static: ceil(T / block_q) + S query blocks (an upper bound; unused blocks exit
at once) x Hkv x splits, the split count chosen from the static shapes so that small batches still
fill the GPU (`_num_splits`). Block metadata (row, first query position, token count) is computed
with cheap jnp ops outside the kernel.

Scores are masked in one place (`_scores`): key position < the row's length and <= the query's
position. Masked keys are dropped with selects, and V rows past the length are zeroed with a
select, so garbage or NaN in page 0, in unused pages or in a last page's tail never reaches the
output. Sliding windows, soft-capping and KV scales belong in `_scores` and the loads.

Shape constraints (Triton's tensors have power-of-two sides): head dim and page size powers of
two, head dim >= 16, page size * pages_per_block >= 16; `check_supported` refuses other shapes
and names attention_backend='xla' as the fallback. f32 dots run at IEEE f32 (no TF32), so f32
results match the references; bf16 pools multiply in bf16 and accumulate in f32.

What has run: Pallas interpret mode on CPU (the tests), and lowering for CUDA on a CPU-only
jaxlib (a Triton call, no host callback). Compiled and timed on a GPU: only through
scripts/device_check.py on a lent device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.validation import validate_inputs

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: no inf - inf in exp(m - m')
TARGET_PROGRAMS = 1024  # enough programs to fill a large GPU (an H200 has 132 SMs)
MAX_SPLITS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuBlockSizes:
    """block_q: query tokens per program (None: 16 // Gp for decode-only shapes, T <= S, else
    64 // Gp, at least 1); pages_per_block: pages per inner step; splits: KV splits per query
    block (None: chosen from the shapes); num_warps / num_stages: Triton's."""

    block_q: int | None = None
    pages_per_block: int = 4
    splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "pages_per_block", "splits", "num_warps", "num_stages"):
            value = getattr(self, name)
            if value is None and name in ("block_q", "splits"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GpuBlockSizes.{name} must be a positive int, got {value!r}")
        if self.block_q is not None and not _pow2(self.block_q):
            raise ValueError(f"GpuBlockSizes.block_q must be a power of two, got {self.block_q}")
        if not _pow2(self.pages_per_block):
            raise ValueError("GpuBlockSizes.pages_per_block must be a power of two, got "
                             f"{self.pages_per_block}")


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_supported(*, head_dim: int, page_size: int, pages_per_block: int = 4) -> None:
    """Raise ValueError (naming the XLA fallback) for shapes the Triton kernel cannot take."""
    problems = []
    if not _pow2(head_dim) or head_dim < 16:
        problems.append(f"head dim {head_dim} is not a power of two >= 16")
    if not _pow2(page_size):
        problems.append(f"page size {page_size} is not a power of two")
    elif page_size * pages_per_block < 16:
        problems.append(f"page size {page_size} x pages_per_block {pages_per_block} < 16 keys")
    if problems:
        raise ValueError("the GPU Pallas kernel needs Triton-friendly shapes: "
                         + "; ".join(problems) + " (use attention_backend='xla')")


def _num_splits(num_blocks: int, num_kv_heads: int, table_width: int, pages_per_block: int):
    """Split each query block's pages so the grid has about TARGET_PROGRAMS programs, never
    below one page block per split."""
    wanted = -(-TARGET_PROGRAMS // (num_blocks * num_kv_heads))
    return max(1, min(wanted, MAX_SPLITS, -(-table_width // pages_per_block)))


def _scores(q, k, key_pos, query_pos, kv_len, sm_scale, allow_tf32):
    """The one place scores are formed and masked: q f[M, D] . k f[L, D] -> f32[M, L], keys at
    positions >= kv_len or after the query's position dropped."""
    s = plgpu.dot(q, k, trans_b=True, allow_tf32=allow_tf32).astype(jnp.float32) * sm_scale
    valid = (key_pos[None, :] < kv_len) & (key_pos[None, :] <= query_pos[:, None])
    return jnp.where(valid, s, MASK_VALUE), valid


def _kernel(meta_ref, table_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, sm_scale: float,
            group_pad: int, pages_per_block: int, pages_per_split: int, allow_tf32: bool):
    # meta: (first query position, tokens in this block, KV length of the row, unused)
    q_pos0, count, kv_len = meta_ref[0], meta_ref[1], meta_ref[2]
    split = pl.program_id(2)
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    block_k = pages_per_block * page_size
    q = q_ref[...]
    query_pos = q_pos0 + jnp.arange(rows, dtype=jnp.int32) // group_pad
    # Keys this block may see: below the length and up to its last query's position.
    limit = jnp.minimum(kv_len, q_pos0 + count)
    first_page = split * pages_per_split
    last_page = jnp.minimum(first_page + pages_per_split, pl.cdiv(limit, page_size))
    steps = jnp.where(count > 0, pl.cdiv(jnp.maximum(last_page - first_page, 0),
                                         pages_per_block), 0)

    def body(i, carry):
        acc, m, l = carry
        page0 = first_page + i * pages_per_block
        pages = table_ref[pl.ds(page0, pages_per_block)]
        k = k_ref[pages].reshape(block_k, head_dim)
        v = v_ref[pages].reshape(block_k, head_dim)
        key_pos = page0 * page_size + jnp.arange(block_k, dtype=jnp.int32)
        s, valid = _scores(q, k, key_pos, query_pos, kv_len, sm_scale, allow_tf32)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
        v = jnp.where((key_pos < kv_len)[:, None], v, jnp.zeros_like(v))
        pv = plgpu.dot(p.astype(v.dtype), v, allow_tf32=allow_tf32).astype(jnp.float32)
        return alpha[:, None] * acc + pv, m_new, alpha * l + jnp.sum(p, axis=1)

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(0, steps, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _block_metadata(query_start, seq_lens, num_tokens: int, block_q: int, num_blocks: int):
    """Per query block: its row, first token, and (first query position, tokens, KV length)."""
    num_seqs = seq_lens.shape[0]
    q_lens = query_start[1:] - query_start[:-1]
    blocks = pl.cdiv(q_lens, block_q)
    block_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(blocks, dtype=jnp.int32)])
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(block_start, b, side="right") - 1, 0, num_seqs - 1)
    index = b - block_start[row]
    count = jnp.where(b < block_start[num_seqs],
                      jnp.clip(q_lens[row] - index * block_q, 0, block_q), 0)
    first_token = jnp.minimum(query_start[row] + index * block_q, num_tokens - 1)
    q_pos0 = seq_lens[row] - q_lens[row] + index * block_q
    meta = jnp.stack([q_pos0, count, seq_lens[row], jnp.zeros_like(count)], axis=1)
    return row, first_token, count, meta.astype(jnp.int32), block_start


def ragged_paged_attention(q, k_pages, v_pages, page_tables, seq_lens, query_start, *,
                           sm_scale: float, interpret: bool = False,
                           block_sizes: GpuBlockSizes | None = None):
    """f[T, Hq, D] attention of each row's queries over its pages; the semantics of
    `pallas_kernels.reference.ref_ragged_paged_attention` (rows in any order, decode rows,
    prefill chunks and padding rows; this step's KV already in the pool). Inputs are checked
    (values too, outside jit); unsupported shapes raise ValueError naming the XLA fallback."""
    validate_inputs(q, k_pages, v_pages, page_tables, seq_lens, query_start)
    return _attention(q, k_pages, v_pages, page_tables, seq_lens, query_start,
                      sm_scale=float(sm_scale), interpret=interpret,
                      block_sizes=block_sizes or GpuBlockSizes())


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "block_sizes"))
def _attention(q, k_pages, v_pages, page_tables, seq_lens, query_start, *, sm_scale: float,
               interpret: bool, block_sizes: GpuBlockSizes):
    bs = block_sizes
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_seqs, table_width = page_tables.shape
    check_supported(head_dim=head_dim, page_size=page_size, pages_per_block=bs.pages_per_block)
    group = num_q_heads // num_kv_heads
    group_pad = 1 << (group - 1).bit_length()
    block_q = bs.block_q or max(1, (16 if num_tokens <= num_seqs else 64) // group_pad)
    rows = block_q * group_pad
    if rows < 16:  # Triton dots need 16 rows: more tokens per block
        block_q *= -(-16 // rows)
        rows = block_q * group_pad
    num_blocks = -(-num_tokens // block_q) + num_seqs
    ppb = min(bs.pages_per_block, 1 << (table_width - 1).bit_length())
    if ppb * page_size < 16:
        ppb = -(-16 // page_size)
    splits = bs.splits or _num_splits(num_blocks, num_kv_heads, table_width, ppb)
    pages_per_split = -(-table_width // (splits * ppb)) * ppb
    row, first_token, count, meta, block_start = _block_metadata(
        query_start, seq_lens, num_tokens, block_q, num_blocks)

    # Page ids past a row's length point at page 0 (read, then masked); used ids are clipped
    # into the pool so no load leaves it.
    used = jnp.arange(table_width)[None, :] < pl.cdiv(seq_lens, page_size)[:, None]
    table = jnp.where(used, jnp.clip(page_tables, 0, num_pages - 1), 0)
    table = jnp.pad(table, ((0, 0), (0, splits * pages_per_split - table_width)))[row]

    # q -> [blocks, Hkv, block_q * Gp, D]: a block's tokens, each with its padded head group.
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    token = jnp.minimum(first_token[:, None] + jnp.arange(block_q), num_tokens - 1)
    qb = jnp.where((jnp.arange(block_q) < count[:, None])[:, :, None, None, None], qg[token], 0)
    qb = qb.transpose(0, 2, 1, 3, 4).reshape(num_blocks, num_kv_heads, rows, head_dim)
    qb = qb.astype(k_pages.dtype)

    kernel = functools.partial(
        _kernel, sm_scale=float(sm_scale), group_pad=group_pad, pages_per_block=ppb,
        pages_per_split=pages_per_split, allow_tf32=False)
    part = (splits, num_blocks, num_kv_heads, rows)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(num_blocks, num_kv_heads, splits),
        in_specs=[
            pl.BlockSpec((None, 4), lambda b, h, k: (b, 0)),
            pl.BlockSpec((None, table.shape[1]), lambda b, h, k: (b, 0)),
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, k: (b, h, 0, 0)),
            pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, h, k: (h, 0, 0, 0)),
            pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, h, k: (h, 0, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, k: (k, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, k: (k, b, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda b, h, k: (k, b, h, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(meta, table, qb, k_pages, v_pages)

    # Merge the splits (flash-decoding's last step); rows that saw no key give zeros.
    m_all = jnp.max(m, axis=0)
    w = jnp.exp(m - m_all[None])
    l_all = jnp.sum(w * l, axis=0)
    out = jnp.sum(w[..., None] * acc, axis=0)
    out = jnp.where(l_all[..., None] > 0, out / jnp.where(l_all > 0, l_all, 1.0)[..., None], 0.0)

    # Back to tokens: token t is position (t - its row's start) of its row's blocks.
    out = out.reshape(num_blocks, num_kv_heads, block_q, group_pad, head_dim)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    owner = jnp.clip(jnp.searchsorted(query_start, t, side="right") - 1, 0, num_seqs - 1)
    offset = t - query_start[owner]
    tb = jnp.minimum(block_start[owner] + offset // block_q, num_blocks - 1)
    per_token = out[tb, :, offset % block_q, :group]  # [T, Hkv, G, D]
    per_token = jnp.where((t < query_start[num_seqs])[:, None, None, None], per_token, 0.0)
    return per_token.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
