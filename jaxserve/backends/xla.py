"""The plain-XLA backend: attention over the paged pool in jnp, for any device, and the fallback
where no kernel fits. Decode rows attend as rows of one query; prefill tokens in blocks of
QUERY_BLOCK, each block inside one row, so work is rows x own keys (a query never meets another
row's keys); keys and values are gathered a block of pages at a time under an online softmax.

Dimension letters: see jaxserve/model/attention.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.backends import Backend
from jaxserve.model.batch_invariant import per_token_attention
from jaxserve.model.quantize import widen_factors

_MASKED = -1e30  # finite, so fully masked padding rows give finite (discarded) outputs
# The batch builder aligns each prefill chunk to blocks of this many tokens (AttentionMetadata's
# query_block): a block's queries share one row's pages.
QUERY_BLOCK = 16

# Blocking of the jnp attention, tuned with scripts/bench_attention.py (its measurements are in
# docs/performance-history.md): pages gathered per online-softmax step, and rows per chunk.
DECODE_PAGES_PER_BLOCK = 4
DECODE_ROWS_PER_CHUNK = 64
PREFILL_PAGES_PER_BLOCK = 8
PREFILL_ROWS_PER_CHUNK = 16


def _online_update(carry, s, v, valid=None):
    """One online-softmax step over a key block, s f32[Hkv, R, Q, C] and v f32[Hkv, R, C, D]:
    m' = max(m, max_j s_j); l' = exp(m - m') l + sum_j exp(s_j - m'); the value accumulator is
    rescaled by exp(m - m'). Products are written as multiply-and-sum, not einsum: XLA's CPU
    backend lowers them to fused reductions, where the per-row [Q, C] x [C, D] matmuls (Q is a
    few query heads for a decode row) run as many tiny dots."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(-1))
    scale = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    if valid is not None:  # bool[Hkv, R, Q, C]: masked scores weigh 0 even in a masked row
        p = jnp.where(valid, p, 0.0)
    pv = jnp.sum(p[..., None] * v[:, :, None], axis=3)
    return m_new, l * scale + p.sum(-1), acc * scale[..., None] + pv


def _over_page_blocks(page_tables, seq_lens, first_key, pages_per_block: int, page_size: int,
                      stats_shape: tuple, head_dim: int, block_fn, finish, sink=None):
    """Runs block_fn(first_slot, pages i32[R, ppb], carry) -> carry over blocks of page-table
    columns, from the block holding key position first_key (i32: where sliding windows start)
    only as far as the longest row (dynamic trip counts: the table's width costs nothing, and
    each visited page is read once). Returns finish(the normalised accumulator). sink
    f32[stats_shape] (attention sinks): the softmax starts from it, as a key of weight
    exp(sink) and value 0, so it joins the denominator only.

    The finished output is a result of the loop, computed with each block (the last one's
    kept), not after it: XLA's CPU backend fuses what follows the loop into the output
    projection's matrix-vector loop, where indexing the [Hkv, R, Q, D] accumulator as the
    projection's [R, Hq*D] input cost 5x the projection's own work per weight (scalar loads
    and divisions by the head counts for every weight)."""
    width = page_tables.shape[1]
    ppb = min(pages_per_block, width)
    tables = jnp.pad(page_tables, ((0, 0), (0, -width % ppb)))  # page 0, masked by position
    block_slots = ppb * page_size
    num_blocks = (jnp.max(seq_lens) + block_slots - 1) // block_slots

    def body(j, carry):
        pages = jax.lax.dynamic_slice_in_dim(tables, j * ppb, ppb, axis=1)
        m, l, acc = block_fn(j * block_slots, pages, carry[:3])
        return m, l, acc, finish(acc / jnp.maximum(l, 1e-30)[..., None])

    acc = jnp.zeros(stats_shape + (head_dim,), jnp.float32)  # no block visited: outputs 0
    m, l = jnp.full(stats_shape, _MASKED, jnp.float32), jnp.zeros(stats_shape, jnp.float32)
    if sink is not None:
        m, l = sink, jnp.ones(stats_shape, jnp.float32)
    init = (m, l, acc, finish(acc))
    return jax.lax.fori_loop(first_key // block_slots, num_blocks, body, init)[3]


def _gather_block(cache, pages):
    """Keys and values of `pages` (i32[R, ppb]) -> f32[Hkv, R, ppb*B, D] each, dequantized for
    int8 pages. Gathers whole [B, D] page rows of the cache viewed as [Hkv*N, B*D] (a free
    reshape), in the output's order: XLA's CPU gather is paid per index, so whole rows in place
    beat indexing the 4-d cache and transposing (scripts/bench_attention.py)."""
    r, ppb = pages.shape
    hkv, n, b, d = cache.k.shape
    rows = jnp.arange(hkv)[:, None, None] * n + pages[None]  # [Hkv, R, ppb]

    def take(x, scale):
        block = x.reshape(hkv * n, b * d)[rows]  # [Hkv, R, ppb, B*D]
        block = block.reshape(hkv, r, ppb * b, d).astype(jnp.float32)
        if scale is None:
            return block
        return block * scale.reshape(hkv * n, b)[rows].reshape(hkv, r, ppb * b, 1)

    return take(cache.k, cache.k_scale), take(cache.v, cache.v_scale)


def _rows_attention(q, cache, page_tables, seq_lens, q_pos, *,
                    pages_per_block: int, rows_per_chunk: int, sm_scale: float,
                    window: int | None, soft_cap: float | None, sinks=None):
    """Each row's queries attend that row's pages causally. q f[R, Qb, Hq, D]: Qb query tokens
    per row (1 for decode; a block of one prefill chunk otherwise); page_tables i32[R, P];
    seq_lens i32[R] (0: padding row); q_pos i32[R, Qb]. Work is rows x own keys only: a query
    never meets another row's keys. window, soft_cap, sinks: see attention(). Returns
    f[R * Qb, Hq, D].

    Rows go in chunks of rows_per_chunk: XLA materialises each gathered key/value block, and a
    chunk's blocks stay in cache where all rows' blocks at once would round-trip through
    memory."""
    r, qb, hq, d = q.shape
    opts = dict(pages_per_block=pages_per_block, sm_scale=sm_scale, window=window,
                soft_cap=soft_cap, sinks=sinks)
    if r <= rows_per_chunk:
        return _rows_attention_block(q, cache, page_tables, seq_lens, q_pos, **opts)
    c = rows_per_chunk
    n = -(-r // c)
    pad = n * c - r  # padding rows: seq_len 0, so their chunk's page loop runs no blocks
    q, page_tables, seq_lens, q_pos = (jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
                                       for x in (q, page_tables, seq_lens, q_pos))

    def chunk(i, out):
        rows = lambda x: jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=0)  # noqa: E731
        o = _rows_attention_block(rows(q), cache, rows(page_tables), rows(seq_lens),
                                  rows(q_pos), **opts)
        return jax.lax.dynamic_update_slice_in_dim(out, o, i * c * qb, axis=0)

    out = jax.lax.fori_loop(0, n, chunk, jnp.zeros((n * c * qb, hq, d), q.dtype))
    return out[:r * qb]


def _rows_attention_block(q, cache, page_tables, seq_lens, q_pos, *,
                          pages_per_block: int, sm_scale: float, window: int | None,
                          soft_cap: float | None, sinks=None):
    """_rows_attention for one chunk of rows, all at once."""
    r, qb, hq, d = q.shape
    hkv, _, page_size, _ = cache.k.shape
    g = hq // hkv
    qg = q.reshape(r, qb, hkv, g, d).transpose(2, 0, 1, 3, 4).reshape(hkv, r, qb * g, d)
    qg = qg.astype(jnp.float32) * sm_scale
    pos = jnp.repeat(q_pos, g, axis=1)[None, :, :, None]  # [1, R, Qb*G, 1]

    def block(first, pages, carry):
        k, v = _gather_block(cache, pages)  # [Hkv, R, ppb*B, D]
        s = jnp.sum(qg[:, :, :, None, :] * k[:, :, None, :, :], axis=-1)  # [Hkv, R, Q, C]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        key_pos = first + jnp.arange(k.shape[2])[None, None, None, :]
        if window is None:
            return _online_update(carry, jnp.where(key_pos <= pos, s, _MASKED), v)
        # A block may lie wholly before a query's window (a masked row's p would be 1) and
        # hold released pages (the scratch page 0: any values): both are selected away, as
        # are the slots past a row's length.
        valid = (key_pos <= pos) & (key_pos > pos - window)
        key = key_pos[0, :, 0, :]  # [1, C]
        in_row = (key >= lowest[:, None]) & (key < seq_lens[:, None])  # [R, C]
        v = jnp.where(in_row[None, :, :, None], v, 0.0)
        return _online_update(carry, jnp.where(valid, s, _MASKED), v, valid)

    first_key = 0
    if window is not None:  # no query of these rows reads a key before this one
        lowest = q_pos[:, 0] - window + 1  # [R]: the first key of each row's earliest window
        first_key = jnp.maximum(0, jnp.min(jnp.where(seq_lens > 0, lowest, 0)))

    def finish(out):  # [Hkv, R, Qb*G, D] -> [R*Qb, Hq*D], the output projection's rows
        out = out.reshape(hkv, r, qb, g, d).transpose(1, 2, 0, 3, 4)
        return out.reshape(r * qb, hq * d).astype(q.dtype)

    sink = None
    if sinks is not None:  # [Hq] -> the statistics' [Hkv, R, Qb*G] (query head h*G + g)
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(hkv, 1, 1, g),
                                (hkv, r, qb, g)).reshape(hkv, r, qb * g)
    out = _over_page_blocks(page_tables, seq_lens, first_key, pages_per_block, page_size,
                            (hkv, r, qb * g), d, block, finish, sink)
    return out.reshape(r * qb, hq, d)


def attention(q, cache, md, *, sm_scale: float, window: int | None = None,
              soft_cap: float | None = None, sinks=None):
    """Decode rows attend as rows of one query; prefill tokens as blocks of md.query_block
    tokens, each block inside one row (the batch builder aligns every chunk to the block).
    window: keys at positions > position - window only (blocks wholly before every row's window
    are not visited); soft_cap: scores -> soft_cap * tanh(score / soft_cap) before the mask;
    sinks f[Hq]: a logit per query head in the softmax's denominator (None: none)."""
    sd, t = md.num_decode, q.shape[0]
    parts = []
    if sd:
        parts.append(_rows_attention(q[:sd, None], cache, md.page_tables[:sd],
                                     md.seq_lens[:sd], md.positions[:sd, None],
                                     pages_per_block=DECODE_PAGES_PER_BLOCK,
                                     rows_per_chunk=DECODE_ROWS_PER_CHUNK, sm_scale=sm_scale,
                                     window=window, soft_cap=soft_cap, sinks=sinks))
    if t > sd:
        qb, sp = md.query_block, md.page_tables.shape[0] - sd
        first_rows = md.token_row[sd::qb] - sd  # row of each query block; sp for padding
        real = first_rows < sp
        rows = jnp.where(real, first_rows, 0) + sd
        parts.append(_rows_attention(
            q[sd:].reshape(-1, qb, *q.shape[1:]), cache, md.page_tables[rows],
            jnp.where(real, md.seq_lens[rows], 0), md.positions[sd:].reshape(-1, qb),
            pages_per_block=PREFILL_PAGES_PER_BLOCK, rows_per_chunk=PREFILL_ROWS_PER_CHUNK,
            sm_scale=sm_scale, window=window, soft_cap=soft_cap, sinks=sinks))
    return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


def invariant_attention(q, cache, md, *, sm_scale: float, window: int | None = None,
                        soft_cap: float | None = None, sinks=None):
    """attention's batch-invariant form (model/batch_invariant.py): every token, decode or
    prefill, attends as a decode row of its own position, blocks of DECODE_PAGES_PER_BLOCK pages
    from position 0."""
    def row(q1, table, length, pos):
        return _rows_attention_block(q1, cache, table, length, pos,
                                     pages_per_block=DECODE_PAGES_PER_BLOCK, sm_scale=sm_scale,
                                     window=window, soft_cap=soft_cap, sinks=sinks)

    return per_token_attention(row, q, md)


def pack_params(params: dict) -> dict:
    """On CPU, int8 weights with their float16 group scales and offsets widened to float32
    (exactly): XLA's CPU loop fusion ran the decode step's matmuls 10-12% faster reading f32
    factors than converting f16 ones (docs/performance-history.md). Elsewhere unchanged."""
    return widen_factors(params) if jax.default_backend() == "cpu" else params


BACKEND = Backend(name="xla", attention=attention, query_block=QUERY_BLOCK,
                  pack_params=pack_params)
