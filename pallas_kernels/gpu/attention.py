"""Ragged paged attention for GPUs in Pallas's Triton backend: `ragged_paged_attention`, one
entry point for decode rows, prefill chunks and their mix, with the signature and semantics of
`pallas_kernels.tpu.ragged_paged_attention` and `pallas_kernels.reference`.

One kernel (`kernel.attention_kernel`) serves every row kind: a row's query tokens are cut into
blocks of block_q tokens (a decode row is one block of one token) and a static grid runs
(query block, KV head, split) programs. The grid's query-block axis has cdiv(T, block_q) + S
entries, an upper bound on the blocks any packing of T tokens into S rows needs; each block's row,
first token, first query position and token count come from cheap jnp ops on query_start and
seq_lens outside the kernel (`block_metadata`), and spare blocks exit at once. Splits divide a
row's pages (flash-decoding, the rule in `block_sizes`); their unnormalised results are merged in
jnp (`merge_splits`), then scattered back to token order. Attention sinks (`sinks` f[Hq]) join
there, as one more split with the sink's logit and no value: the kernel is the same with or
without them.

Garbage never reaches the output: page-table entries past a row's length are replaced by page 0
and clipped into the pool before the kernel (so no load leaves it), masked scores and V rows past
the length are dropped with selects, and tokens past query_start[S] are zeroed. A row with no
visible key gives zeros.

Supported (`check_supported`; other shapes raise ValueError naming attention_backend='xla'):
head dim a power of two >= 16, page size a power of two (Triton's tensors have power-of-two
sides), a float32, bfloat16 or int8 pool, and pool and scale arrays of fewer than 2^31 elements
(Triton's pointer offsets are int32). float32 dots are IEEE f32 (no TF32), bf16 ones multiply in
bf16 and accumulate in float32. q is cast to a float pool's dtype; an int8 pool (with float32
scales per token and KV head, k_scale/v_scale f32[Hkv, N, B]) is read in q's dtype, bfloat16 for
bf16 q and float32 otherwise, and its scales are applied in float32 (`kernel`).

What has run: Pallas interpret mode on a CPU under jax 0.10.2 and 0.11.2 (the tests), and
lowering for CUDA on CPU-only jaxlibs (one Triton call, no host callback, float32 dots without
TF32 in the Triton IR). int8 pools: interpreted and lowered under jax 0.10.2 only so far. Not
yet compiled by Triton nor timed on a GPU: scripts/device_check.py does both on a lent device
(its results and any tuning belong in docs/).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu.block_sizes import GpuBlockSizes, Plan, is_pow2, plan
from pallas_kernels.gpu.kernel import META_FIELDS, attention_kernel
from pallas_kernels.validation import validate_inputs

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)
MAX_POOL_ELEMENTS = 2**31 - 1


def check_supported(*, head_dim: int, page_size: int, dtype=None) -> None:
    """Raise ValueError, naming the XLA fallback, for a model the Triton kernel cannot serve:
    head dim and page size must be powers of two (head dim >= 16), the pool float32, bfloat16 or
    int8 (dtype None: not checked). Cheap; the engine calls it at start-up."""
    problems = []
    if not is_pow2(head_dim) or head_dim < 16:
        problems.append(f"head dim {head_dim} is not a power of two >= 16")
    if not is_pow2(page_size):
        problems.append(f"page size {page_size} is not a power of two")
    if dtype is not None and jnp.dtype(dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
        problems.append(f"KV dtype {jnp.dtype(dtype).name} is not float32, bfloat16 or int8")
    if problems:
        raise ValueError("the GPU Pallas kernel needs Triton-friendly shapes: "
                         + "; ".join(problems) + " (use attention_backend='xla')")


def ragged_paged_attention(
    q: jax.Array,  # f[T, Hq, D], flat query tokens of all rows, then padding
    k_pages: jax.Array,  # f[Hkv, N, B, D] (or i8) head-major, this step's K already written
    v_pages: jax.Array,  # f[Hkv, N, B, D] (or i8) head-major, this step's V already written
    page_tables: jax.Array,  # i32[S, P]
    seq_lens: jax.Array,  # i32[S], KV length of each row after this step; 0 = padding row
    query_start: jax.Array,  # i32[S+1], cumulative; s owns tokens query_start[s]:query_start[s+1]
    *,
    sm_scale: float,
    interpret: bool = False,
    block_sizes: GpuBlockSizes | None = None,
    k_scale: jax.Array | None = None,  # f32[Hkv, N, B] for int8 pages: K means k_pages * k_scale
    v_scale: jax.Array | None = None,  # f32[Hkv, N, B] for int8 pages
    window: int | None = None,  # sliding window: keys at positions > p - window only
    soft_cap: float | None = None,  # scores -> soft_cap * tanh(score / soft_cap)
    sinks: jax.Array | None = None,  # f[Hq]: a logit per query head in the denominator
) -> jax.Array:  # f[T, Hq, D] in q.dtype; tokens >= query_start[S] are zeros
    """Causal paged attention for a ragged batch; see `ref_ragged_paged_attention`. Inputs are
    checked (values too, outside jit); unsupported shapes raise ValueError naming the XLA
    fallback. interpret=True runs the kernel in Pallas's interpreter (any backend, for tests)."""
    validate_inputs(q, k_pages, v_pages, page_tables, seq_lens, query_start, k_scale, v_scale,
                    window=window, soft_cap=soft_cap, sinks=sinks)
    check_supported(head_dim=q.shape[-1], page_size=k_pages.shape[2], dtype=k_pages.dtype)
    # The scale arrays are D times smaller than the pages, but checked all the same.
    largest = max(a.size for a in (k_pages, k_scale) if a is not None)
    if largest > MAX_POOL_ELEMENTS:
        raise ValueError(f"the GPU Pallas kernel addresses the pool with int32 offsets: "
                         f"{largest} elements >= 2^31 (shard the pool over KV heads, or "
                         "use attention_backend='xla')")
    return _attention(q, k_pages, v_pages, page_tables, seq_lens, query_start, k_scale, v_scale,
                      sinks, sm_scale=float(sm_scale), interpret=interpret,
                      block_sizes=block_sizes or GpuBlockSizes(), window=window,
                      soft_cap=None if soft_cap is None else float(soft_cap))


def compute_dtype(q_dtype, pool_dtype):
    """The dtype of the kernel's dots: a float pool's own; for an int8 pool q's (bf16 or, for
    any other q, float32), into which int8 converts exactly."""
    if jnp.dtype(pool_dtype) != jnp.int8:
        return jnp.dtype(pool_dtype)
    return jnp.dtype(jnp.bfloat16 if jnp.dtype(q_dtype) == jnp.bfloat16 else jnp.float32)


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret", "block_sizes", "window",
                                             "soft_cap"))
def _attention(q, k_pages, v_pages, page_tables, seq_lens, query_start, k_scale, v_scale, sinks,
               *,
               sm_scale: float, interpret: bool, block_sizes: GpuBlockSizes,
               window: int | None, soft_cap: float | None):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_seqs, table_width = page_tables.shape
    p = plan(num_tokens=num_tokens, num_seqs=num_seqs, group=num_q_heads // num_kv_heads,
             num_kv_heads=num_kv_heads, page_size=page_size, table_width=table_width,
             block_sizes=block_sizes)
    row, first_token, count, meta, block_start = block_metadata(query_start, seq_lens,
                                                                num_tokens, p)
    # Entries past a row's length point at page 0 (read, then masked); used ones are clipped
    # into the pool so that no load leaves it. One padded table row per query block.
    used = jnp.arange(table_width)[None, :] < pl.cdiv(seq_lens, page_size)[:, None]
    table = jnp.where(used, jnp.clip(page_tables, 0, num_pages - 1), 0)
    table = jnp.pad(table, ((0, 0), (0, p.table_width - table_width)))[row]
    qb = query_blocks(q, first_token, count, num_kv_heads, p)
    qb = qb.astype(compute_dtype(q.dtype, k_pages.dtype))

    quantized = k_scale is not None
    kernel = functools.partial(attention_kernel, sm_scale=sm_scale, group_pad=p.group_pad,
                               pages_per_block=p.pages_per_block,
                               pages_per_split=p.pages_per_split, quantized=quantized,
                               window=window, soft_cap=soft_cap)
    part = (p.splits, p.num_blocks, num_kv_heads, p.rows)
    # Each program sees its KV head's whole pool (pages, and scales if int8) and gathers pages.
    pool_block = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, h, k: (h, 0, 0, 0))
    scale_block = pl.BlockSpec((None, num_pages, page_size), lambda b, h, k: (h, 0, 0))
    scale_specs, scale_args = ([scale_block] * 2, (k_scale, v_scale)) if quantized else ([], ())
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(p.num_blocks, num_kv_heads, p.splits),
        in_specs=[
            pl.BlockSpec((None, META_FIELDS), lambda b, h, k: (b, 0)),
            pl.BlockSpec((None, p.table_width), lambda b, h, k: (b, 0)),
            pl.BlockSpec((None, None, p.rows, head_dim), lambda b, h, k: (b, h, 0, 0)),
            pool_block,
            pool_block,
            *scale_specs,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, p.rows, head_dim), lambda b, h, k: (k, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, p.rows), lambda b, h, k: (k, b, h, 0)),
            pl.BlockSpec((None, None, None, p.rows), lambda b, h, k: (k, b, h, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32),
                   jax.ShapeDtypeStruct(part, jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                                             num_stages=block_sizes.num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(meta, table, qb, k_pages, v_pages, *scale_args)
    sink = None
    if sinks is not None:  # [Hq] -> [Hkv, rows] (row r: query head h * G + r % Gp)
        sink = sinks.astype(jnp.float32).reshape(num_kv_heads, 1, -1)
        sink = jnp.pad(sink, ((0, 0), (0, 0), (0, p.group_pad - sink.shape[2])))
        sink = jnp.broadcast_to(sink, (num_kv_heads, p.block_q, p.group_pad))
        sink = sink.reshape(num_kv_heads, p.rows)
    out = merge_splits(acc, m, l, sink)  # f32[blocks, Hkv, rows, D]
    return to_tokens(out, query_start, block_start, num_tokens, num_q_heads, p).astype(q.dtype)


def _segment_of(starts, x):
    """i32[S+1] cumulative starts, i32[X] -> i32[X]: the last s with starts[s] <= x (skipping
    empty segments), clipped into [0, S). A broadcast compare, so no loop on the device (the
    default binary search is a while loop: several tiny kernels per call on a GPU)."""
    s = jnp.searchsorted(starts, x, side="right", method="compare_all") - 1
    return jnp.clip(s, 0, starts.shape[0] - 2).astype(jnp.int32)


def block_metadata(query_start, seq_lens, num_tokens: int, p: Plan):
    """Per query block b (i32[blocks] each): its row, first token and token count (0 for a spare
    block), the kernel's i32[blocks, META_FIELDS] (first query position, tokens, KV length of the
    row, 0), and i32[S+1] block_start (row s owns blocks block_start[s]:block_start[s+1])."""
    num_seqs = seq_lens.shape[0]
    q_lens = query_start[1:] - query_start[:-1]
    block_start = jnp.concatenate([jnp.zeros(1, jnp.int32),
                                   jnp.cumsum(pl.cdiv(q_lens, p.block_q), dtype=jnp.int32)])
    b = jnp.arange(p.num_blocks, dtype=jnp.int32)
    row = _segment_of(block_start, b)
    index = b - block_start[row]
    count = jnp.where(b < block_start[num_seqs],
                      jnp.clip(q_lens[row] - index * p.block_q, 0, p.block_q), 0)
    first_token = jnp.minimum(query_start[row] + index * p.block_q, num_tokens - 1)
    q_pos0 = seq_lens[row] - q_lens[row] + index * p.block_q
    meta = jnp.stack([q_pos0, count, seq_lens[row], jnp.zeros_like(count)], axis=1)
    return row, first_token, count, meta.astype(jnp.int32), block_start


def query_blocks(q, first_token, count, num_kv_heads: int, p: Plan):
    """q f[T, Hq, D] -> f[blocks, Hkv, rows, D]: each block's tokens, each with the padded head
    group of each KV head (token-major rows; padding tokens and heads are zeros)."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, p.group_pad - group), (0, 0)))
    token = jnp.minimum(first_token[:, None] + jnp.arange(p.block_q), num_tokens - 1)
    real = jnp.arange(p.block_q)[None, :] < count[:, None]
    qb = jnp.where(real[:, :, None, None, None], qg[token], 0)  # [blocks, block_q, Hkv, Gp, D]
    return qb.transpose(0, 2, 1, 3, 4).reshape(p.num_blocks, num_kv_heads, p.rows, head_dim)


def merge_splits(acc, m, l, sink=None):
    """The splits' unnormalised (acc f32[K, ..., D], m, l f32[K, ...]) -> normalised f32[..., D]
    (flash-decoding's last step); rows that saw no key give zeros. sink (attention sinks,
    broadcast against m[0]): one more split that saw a key of that logit and value 0, so it
    joins the denominator only (the kernel itself knows nothing of sinks)."""
    m_all = jnp.max(m, axis=0)
    if sink is not None:
        m_all = jnp.maximum(m_all, sink)
    w = jnp.exp(m - m_all[None])
    l_all = jnp.sum(w * l, axis=0)
    if sink is not None:
        l_all = l_all + jnp.exp(sink - m_all)
    out = jnp.sum(w[..., None] * acc, axis=0)
    return jnp.where(l_all[..., None] > 0, out / jnp.where(l_all > 0, l_all, 1.0)[..., None], 0.0)


def to_tokens(out, query_start, block_start, num_tokens: int, num_q_heads: int, p: Plan):
    """f32[blocks, Hkv, rows, D] -> f32[T, Hq, D]: token t is entry (t - its row's start) of its
    row's blocks; tokens past query_start[S] are zeros."""
    num_blocks, num_kv_heads, _, head_dim = out.shape
    num_seqs = query_start.shape[0] - 1
    out = out.reshape(num_blocks, num_kv_heads, p.block_q, p.group_pad, head_dim)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    owner = _segment_of(query_start, t)
    offset = t - query_start[owner]
    tb = jnp.minimum(block_start[owner] + offset // p.block_q, num_blocks - 1)
    group = num_q_heads // num_kv_heads
    per_token = out[tb, :, offset % p.block_q, :group]  # [T, Hkv, G, D]
    per_token = jnp.where((t < query_start[num_seqs])[:, None, None, None], per_token, 0.0)
    return per_token.reshape(num_tokens, num_q_heads, head_dim)
