"""Pure-jnp references for the paged attention kernels: same signatures, obviously correct.

Each reference gathers every page of every sequence (memory O(S * P * B)), masks, and takes a
float32 softmax. They are oracles for the kernels and a readable statement of the semantics, not a
fast path. Dimension letters:

  T flat query tokens (padded)      S sequences (padded)       P pages per sequence (table width)
  N pages in the pool               B page size (slots/page)   Hq query heads, Hkv KV heads, D head dim
  G = Hq // Hkv query heads per KV head (grouped-query attention)

The pool is head-major, k_pages/v_pages f[Hkv, N, B, D]: key position j of sequence s for KV
head h is k_pages[h, page_tables[s, j // B], j % B], so one head's page is a contiguous [B, D]
block. Entries past a sequence's length, and the scratch page 0, may hold garbage or NaN: scores
are masked with a select (not an add) and V rows outside the valid length are zeroed with a
select, so nothing from them reaches the output (0 * NaN would be NaN).

Sliding windows and soft-capping (keyword-only, None: off): with `window` W the query at position
p attends only keys at positions > p - W (the pages before may be anything, e.g. the scratch page
0 once the KV manager released them); with `soft_cap` C each scaled score s becomes
C * tanh(s / C) before masking and the softmax (Gemma 2).

Quantized pools: int8 pages i8[Hkv, N, B, D] come with a scale per token and KV head,
k_scale/v_scale f32[Hkv, N, B], and mean k_pages * k_scale[..., None] (`dequantize_pages`);
float pages have no scales. Scales of unused slots may be garbage or NaN too.

Attention sinks (`sinks` f[Hq], keyword-only, None: off; gpt-oss): a learned logit per query
head that joins each query's softmax denominator and carries no value, so the weights over the
keys sum to 1 / (1 + exp(sink - logsumexp(scores))) instead of 1; a query that sees no key
gives zeros either way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_HIGHEST = jax.lax.Precision.HIGHEST


def dequantize_pages(pages: jax.Array, scale: jax.Array | None) -> jax.Array:
    """Pages as float32: int8 pages i8[Hkv, N, B, D] times their scales f32[Hkv, N, B]; float
    pages (scale None) converted."""
    if scale is None:
        return pages.astype(jnp.float32)
    return pages.astype(jnp.float32) * scale[..., None].astype(jnp.float32)


def _gather_kv(pages: jax.Array, page_tables: jax.Array, scale=None) -> jax.Array:
    """pages: f[Hkv, N, B, D] (or i8 with scale f32[Hkv, N, B]); page_tables: i32[S, P]
    -> f32[S, Hkv, P*B, D]."""
    num_seqs, pages_per_seq = page_tables.shape
    num_kv_heads, _, page_size, head_dim = pages.shape
    gathered = dequantize_pages(pages, scale)[:, page_tables]  # [Hkv, S, P, B, D]
    gathered = gathered.reshape(num_kv_heads, num_seqs, pages_per_seq * page_size, head_dim)
    return jnp.swapaxes(gathered, 0, 1).astype(jnp.float32)


def _masked_attention(q, k, v, valid, sm_scale, soft_cap=None, sinks=None):
    """Grouped softmax attention with a boolean mask.

    q: f32[R, Hkv, G, D]; k, v: f32[R, Hkv, L, D]; valid: bool[R, L]; sinks f[Hkv * G] or
    None -> f32[R, Hkv, G, D]. A row with no valid key gives zeros.
    """
    scores = jnp.einsum("rhgd,rhld->rhgl", q, k, precision=_HIGHEST) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = valid[:, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:  # the sink joins the max and the denominator, not the values
        sink = sinks.astype(jnp.float32).reshape(1, *q.shape[1:3], 1)
        row_max = jnp.maximum(row_max, sink)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - row_max)
    v = jnp.where(valid[:, None, :, None], v, 0.0)
    out = jnp.einsum("rhgl,rhld->rhgd", weights, v, precision=_HIGHEST)
    return jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)


def ref_paged_decode_attention(
    q: jax.Array,  # f[S, Hq, D], one query token per sequence
    k_pages: jax.Array,  # f[Hkv, N, B, D], head-major
    v_pages: jax.Array,  # f[Hkv, N, B, D], head-major
    page_tables: jax.Array,  # i32[S, P]
    seq_lens: jax.Array,  # i32[S], KV length including the query token; 0 = padding row
    *,
    sm_scale: float,
    k_scale: jax.Array | None = None,  # f32[Hkv, N, B] for int8 pages
    v_scale: jax.Array | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f[Hq]: a logit per query head in the denominator
) -> jax.Array:  # f[S, Hq, D] in q.dtype
    """Query of row s (position seq_lens[s]-1) attends to KV positions 0..seq_lens[s]-1 (the
    last `window` of them)."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    group = num_q_heads // num_kv_heads
    k = _gather_kv(k_pages, page_tables, k_scale)
    v = _gather_kv(v_pages, page_tables, v_scale)
    positions = jnp.arange(k.shape[2], dtype=jnp.int32)
    valid = positions[None, :] < seq_lens[:, None]  # [S, P*B]
    if window is not None:
        valid &= positions[None, :] >= seq_lens[:, None] - window
    qg = q.astype(jnp.float32).reshape(num_seqs, num_kv_heads, group, head_dim)
    out = _masked_attention(qg, k, v, valid, sm_scale, soft_cap, sinks)
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)


def ref_ragged_paged_attention(
    q: jax.Array,  # f[T, Hq, D], flat query tokens of all sequences, then padding
    k_pages: jax.Array,  # f[Hkv, N, B, D], head-major
    v_pages: jax.Array,  # f[Hkv, N, B, D], head-major
    page_tables: jax.Array,  # i32[S, P]
    seq_lens: jax.Array,  # i32[S], total KV length of s including its queries
    query_start: jax.Array,  # i32[S+1], cumulative; s owns rows query_start[s]:query_start[s+1]
    *,
    sm_scale: float,
    k_scale: jax.Array | None = None,  # f32[Hkv, N, B] for int8 pages
    v_scale: jax.Array | None = None,
    window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f[Hq]: a logit per query head in the denominator
) -> jax.Array:  # f[T, Hq, D] in q.dtype; padding rows are zeros
    """The semantics of every platform's `ragged_paged_attention`: rows in any order, each a
    decode row (one query token), a prefill chunk (many) or padding (none); row s's queries are
    its last query_start[s+1] - query_start[s] positions, and the one at position p attends to KV
    positions 0..p (earlier pages included; with a window only p - window + 1..p), scores
    soft-capped by soft_cap. Tokens past query_start[S] give zeros."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = page_tables.shape[0]
    num_kv_heads = k_pages.shape[0]
    group = num_q_heads // num_kv_heads
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    # Owner of each row: the last s with query_start[s] <= row (skips empty sequences).
    owner = jnp.clip(jnp.searchsorted(query_start, rows, side="right") - 1, 0, num_seqs - 1)
    is_query = rows < query_start[num_seqs]
    q_lens = query_start[1:] - query_start[:-1]
    position = seq_lens[owner] - q_lens[owner] + (rows - query_start[owner])  # [T]
    k = _gather_kv(k_pages, page_tables, k_scale)[owner]  # [T, Hkv, P*B, D]
    v = _gather_kv(v_pages, page_tables, v_scale)[owner]
    key_pos = jnp.arange(k.shape[2], dtype=jnp.int32)
    valid = is_query[:, None] & (key_pos[None, :] <= position[:, None])  # [T, P*B]
    if window is not None:
        valid &= key_pos[None, :] > position[:, None] - window
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    out = _masked_attention(qg, k, v, valid, sm_scale, soft_cap, sinks)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def ref_ragged_paged_attention_f64(q, k_pages, v_pages, page_tables, seq_lens, query_start, *,
                                   sm_scale: float, k_scale=None, v_scale=None,
                                   window: int | None = None, soft_cap: float | None = None,
                                   sinks=None) -> np.ndarray:
    """The same semantics in float64 numpy, written independently (each row's pages concatenated
    into a contiguous KV, a plain causal softmax per query head): the oracle the kernels and the
    jnp reference are both measured against. Returns f64[T, Hq, D]."""

    def f64(pages, scale):
        pages = np.asarray(jnp.asarray(pages, jnp.float32), np.float64)
        return pages if scale is None else pages * np.asarray(scale, np.float64)[..., None]

    q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    k_pages, v_pages = f64(k_pages, k_scale), f64(v_pages, v_scale)
    table, seq_lens = np.asarray(page_tables), np.asarray(seq_lens)
    query_start = np.asarray(query_start)
    group = q.shape[1] // k_pages.shape[0]
    out = np.zeros_like(q)
    for s, seq_len in enumerate(seq_lens):
        q_lo, q_hi = int(query_start[s]), int(query_start[s + 1])
        if q_hi == q_lo or seq_len == 0:  # no queries, or no keys: zeros
            continue
        k = np.concatenate([k_pages[:, p] for p in table[s]], axis=1)[:, :seq_len]  # [Hkv, L, D]
        v = np.concatenate([v_pages[:, p] for p in table[s]], axis=1)[:, :seq_len]
        positions = seq_len - (q_hi - q_lo) + np.arange(q_hi - q_lo)
        for hq in range(q.shape[1]):
            scores = q[q_lo:q_hi, hq] @ k[hq // group].T * sm_scale  # [q_len, L]
            if soft_cap is not None:
                scores = soft_cap * np.tanh(scores / soft_cap)
            keys = np.arange(seq_len)[None]
            seen = keys <= positions[:, None]
            if window is not None:
                seen &= keys > positions[:, None] - window
            scores = np.where(seen, scores, -np.inf)
            top = scores.max(axis=1, keepdims=True)
            if sinks is not None:  # one more logit in the denominator, with no value
                sink = float(np.asarray(jnp.asarray(sinks, jnp.float32))[hq])
                top = np.maximum(top, sink)
            w = np.exp(scores - top)
            denom = w.sum(axis=1, keepdims=True)
            if sinks is not None:
                denom = denom + np.exp(sink - top)
            w = w / denom
            # Keys before a window may be garbage (released pages): only weighted ones count.
            out[q_lo:q_hi, hq] = np.where(seen[..., None], w[..., None] * v[hq // group][None],
                                          0).sum(axis=1)
    return out
