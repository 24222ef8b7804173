"""Attention over the paged KV pool: per-step metadata, the KV pool pytree, and the one dispatch
that every model layer calls (`attend`). Backends: "cpu" (a C++ custom call that reads pages in
place, pallas_kernels/cpu_kernels.py: the fast path on CPU), "xla" (plain jnp, any device),
and "pallas" (pallas_kernels/, compiled on TPU/GPU, interpret mode on CPU).

Dimension letters: T flat tokens this step, S sequences (rows of the page table), Sd decode rows
(the first Sd of S, one token each), P pages per row, N pages in the pool, B page size, L layers,
Hq query heads, Hkv KV heads, G = Hq // Hkv, D head dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so fully masked padding rows give finite (discarded) outputs


def _pytree_dataclass(cls):
    """Frozen dataclass registered as a pytree; fields with metadata static=True are treated as
    compile-time constants (part of the jit cache key)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    return jax.tree_util.register_dataclass(
        cls,
        data_fields=[f.name for f in fields if not f.metadata.get("static")],
        meta_fields=[f.name for f in fields if f.metadata.get("static")],
    )


def static_field(**kwargs):
    return dataclasses.field(metadata={"static": True}, **kwargs)


@_pytree_dataclass
class KVCache:
    """One layer's paged keys and values, head-major so that one head's page is a contiguous
    [B, D] block. Page 0 is scratch: padded slots write there and no valid position reads it."""

    k: jax.Array  # f[Hkv, N, B, D]
    v: jax.Array  # f[Hkv, N, B, D]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


@_pytree_dataclass
class KVPool:
    """The paged KV cache: one KVCache per layer, all indexed by the same page ids. Separate
    arrays per layer (not one [L, ...] array) let each layer's write and gather touch only its
    own buffer, and compile about 25% faster than slicing one stacked pool in the unrolled
    model."""

    layers: tuple  # L x KVCache

    @classmethod
    def zeros(cls, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
              head_dim: int, dtype) -> "KVPool":
        shape = (num_kv_heads, num_pages, page_size, head_dim)
        return cls(tuple(KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                         for _ in range(num_layers)))

    @property
    def nbytes(self) -> int:
        return sum(c.k.nbytes + c.v.nbytes for c in self.layers)


@_pytree_dataclass
class AttentionMetadata:
    """Where this step's tokens live and what they attend to. Decode rows (one token each) come
    first, then prefill rows whose tokens are contiguous from token index Sd on."""

    positions: jax.Array  # i32[T] position of each token in its sequence
    slot_mapping: jax.Array  # i32[T] page * B + offset to write each token's KV; padding -> page 0
    page_tables: jax.Array  # i32[S, P] page ids per row; unused entries 0
    seq_lens: jax.Array  # i32[S] KV length of each row after this step (0 for padding rows)
    query_start: jax.Array  # i32[S + 1] row s owns tokens query_start[s]:query_start[s + 1]
    token_row: jax.Array  # i32[T] row of each token; padding tokens -> S (matches no row)
    num_decode: int = static_field()  # Sd
    # Prefill chunks start at multiples of this many tokens after the decode rows (padding in
    # between); query_start then counts a row's padding as its own. 1 = packed (Pallas path).
    query_block: int = static_field(default=1)


def write_kv(cache: KVCache, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVCache:
    """Scatter this step's keys/values (f[T, Hkv, D]) into one layer's cache at their slots."""
    b = cache.page_size
    page, offset = slot_mapping // b, slot_mapping % b
    # Adjacent advanced indices after a slice keep their place: the update is [Hkv, T, D].
    # Slots are in bounds by construction; promising it lets XLA scatter in place.
    mode = "promise_in_bounds"
    return KVCache(
        k=cache.k.at[:, page, offset].set(k.swapaxes(0, 1).astype(cache.k.dtype), mode=mode),
        v=cache.v.at[:, page, offset].set(v.swapaxes(0, 1).astype(cache.v.dtype), mode=mode))


# Measured on a 2-core AVX-512 CPU, SmolLM2 shapes, the engine's 512-page tables
# (scripts/bench_attention.py).
DECODE_PAGES_PER_BLOCK = 4
DECODE_ROWS_PER_CHUNK = 64
PREFILL_PAGES_PER_BLOCK = 8
PREFILL_ROWS_PER_CHUNK = 16


def _online_update(carry, s, v):
    """One online-softmax step over a key block, s f32[Hkv, R, Q, C] and v f32[Hkv, R, C, D]:
    m' = max(m, max_j s_j); l' = exp(m - m') l + sum_j exp(s_j - m'); the value accumulator is
    rescaled by exp(m - m'). Products are written as multiply-and-sum, not einsum: XLA's CPU
    backend lowers them to fused reductions, where the per-row [Q, C] x [C, D] matmuls (Q = 3
    for a decode row of SmolLM2) ran as many tiny dots (decode 256 rows x 100 keys over 30
    layers: 360 -> 220 ms; prefill unchanged)."""
    m, l, acc = carry
    m_new = jnp.maximum(m, s.max(-1))
    scale = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[..., None])
    pv = jnp.sum(p[..., None] * v[:, :, None], axis=3)
    return m_new, l * scale + p.sum(-1), acc * scale[..., None] + pv


def _over_page_blocks(page_tables, seq_lens, pages_per_block: int, page_size: int,
                      stats_shape: tuple, head_dim: int, block_fn):
    """Runs block_fn(first_slot, pages i32[R, ppb], carry) -> carry over blocks of page-table
    columns, only as far as the longest row (a dynamic trip count: the table's width costs
    nothing, and each visited page is read once). Returns the normalised accumulator."""
    width = page_tables.shape[1]
    ppb = min(pages_per_block, width)
    tables = jnp.pad(page_tables, ((0, 0), (0, -width % ppb)))  # page 0, masked by position
    block_slots = ppb * page_size
    num_blocks = (jnp.max(seq_lens) + block_slots - 1) // block_slots

    def body(j, carry):
        pages = jax.lax.dynamic_slice_in_dim(tables, j * ppb, ppb, axis=1)
        return block_fn(j * block_slots, pages, carry)

    init = (jnp.full(stats_shape, _MASKED, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(stats_shape + (head_dim,), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    return acc / jnp.maximum(l, 1e-30)[..., None]


def _gather_block(cache: KVCache, pages):
    """Keys and values of `pages` (i32[R, ppb]) -> f32[Hkv, R, ppb*B, D] each. Gathers whole
    [B, D] page rows of the cache viewed as [Hkv*N, B*D] (a free reshape), in the output's
    order: XLA's CPU gather is paid per index, and indexing the 4-d cache then transposing
    measured 1.3-1.4x slower at 64-256 decode rows (scripts/bench_attention.py)."""
    r, ppb = pages.shape
    hkv, n, b, d = cache.k.shape
    rows = jnp.arange(hkv)[:, None, None] * n + pages[None]  # [Hkv, R, ppb]

    def take(x):
        block = x.reshape(hkv * n, b * d)[rows]  # [Hkv, R, ppb, B*D]
        return block.reshape(hkv, r, ppb * b, d).astype(jnp.float32)

    return take(cache.k), take(cache.v)


def _rows_attention(q, cache: KVCache, page_tables, seq_lens, q_pos, *,
                    pages_per_block: int, rows_per_chunk: int, sm_scale: float):
    """Each row's queries attend that row's pages causally. q f[R, Qb, Hq, D]: Qb query tokens
    per row (1 for decode; a block of one prefill chunk otherwise); page_tables i32[R, P];
    seq_lens i32[R] (0: padding row); q_pos i32[R, Qb]. Work is rows x own keys only: a query
    never meets another row's keys. Returns f[R * Qb, Hq, D].

    Rows go in chunks of rows_per_chunk: XLA materialises each gathered key/value block, and a
    chunk's blocks stay in cache where all rows' blocks at once would round-trip through memory
    (measured 2.3x faster at 256 decode rows x 192 keys)."""
    r, qb, hq, d = q.shape
    if r <= rows_per_chunk:
        return _rows_attention_block(q, cache, page_tables, seq_lens, q_pos,
                                     pages_per_block=pages_per_block, sm_scale=sm_scale)
    c = rows_per_chunk
    n = -(-r // c)
    pad = n * c - r  # padding rows: seq_len 0, so their chunk's page loop runs no blocks
    q, page_tables, seq_lens, q_pos = (jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
                                       for x in (q, page_tables, seq_lens, q_pos))

    def chunk(i, out):
        rows = lambda x: jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=0)  # noqa: E731
        o = _rows_attention_block(rows(q), cache, rows(page_tables), rows(seq_lens),
                                  rows(q_pos), pages_per_block=pages_per_block, sm_scale=sm_scale)
        return jax.lax.dynamic_update_slice_in_dim(out, o, i * c * qb, axis=0)

    out = jax.lax.fori_loop(0, n, chunk, jnp.zeros((n * c * qb, hq, d), q.dtype))
    return out[:r * qb]


def _rows_attention_block(q, cache: KVCache, page_tables, seq_lens, q_pos, *,
                          pages_per_block: int, sm_scale: float):
    """_rows_attention for one chunk of rows, all at once."""
    r, qb, hq, d = q.shape
    hkv = cache.k.shape[0]
    g = hq // hkv
    qg = q.reshape(r, qb, hkv, g, d).transpose(2, 0, 1, 3, 4).reshape(hkv, r, qb * g, d)
    qg = qg.astype(jnp.float32) * sm_scale
    pos = jnp.repeat(q_pos, g, axis=1)[None, :, :, None]  # [1, R, Qb*G, 1]

    def block(first, pages, carry):
        k, v = _gather_block(cache, pages)  # [Hkv, R, ppb*B, D]
        s = jnp.sum(qg[:, :, :, None, :] * k[:, :, None, :, :], axis=-1)  # [Hkv, R, Q, C]
        key_pos = first + jnp.arange(k.shape[2])
        s = jnp.where(key_pos[None, None, None, :] <= pos, s, _MASKED)
        return _online_update(carry, s, v)

    out = _over_page_blocks(page_tables, seq_lens, pages_per_block, cache.page_size,
                            (hkv, r, qb * g), d, block)  # [Hkv, R, Qb*G, D]
    out = out.reshape(hkv, r, qb, g, d).transpose(1, 2, 0, 3, 4)
    return out.reshape(r * qb, hq, d).astype(q.dtype)


def _xla_attention(q, cache: KVCache, md: AttentionMetadata, sm_scale):
    """Decode rows attend as rows of one query; prefill tokens as blocks of md.query_block
    tokens, each block inside one row (the batch builder aligns every chunk to the block)."""
    sd, t = md.num_decode, q.shape[0]
    parts = []
    if sd:
        parts.append(_rows_attention(q[:sd, None], cache, md.page_tables[:sd],
                                     md.seq_lens[:sd], md.positions[:sd, None],
                                     pages_per_block=DECODE_PAGES_PER_BLOCK,
                                     rows_per_chunk=DECODE_ROWS_PER_CHUNK, sm_scale=sm_scale))
    if t > sd:
        qb, sp = md.query_block, md.page_tables.shape[0] - sd
        first_rows = md.token_row[sd::qb] - sd  # row of each query block; sp for padding
        real = first_rows < sp
        rows = jnp.where(real, first_rows, 0) + sd
        parts.append(_rows_attention(
            q[sd:].reshape(-1, qb, *q.shape[1:]), cache, md.page_tables[rows],
            jnp.where(real, md.seq_lens[rows], 0), md.positions[sd:].reshape(-1, qb),
            pages_per_block=PREFILL_PAGES_PER_BLOCK, rows_per_chunk=PREFILL_ROWS_PER_CHUNK,
            sm_scale=sm_scale))
    return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


def _pallas_attention(q, cache: KVCache, md: AttentionMetadata, sm_scale):
    from pallas_kernels import paged_decode_attention, ragged_prefill_attention

    sd = md.num_decode
    k, v = cache.k, cache.v
    parts = []
    if sd:
        parts.append(paged_decode_attention(q[:sd], k, v, md.page_tables[:sd], md.seq_lens[:sd],
                                            sm_scale=sm_scale))
    if q.shape[0] > sd:
        query_start = md.query_start[sd:] - sd
        parts.append(ragged_prefill_attention(q[sd:], k, v, md.page_tables[sd:], md.seq_lens[sd:],
                                              query_start, sm_scale=sm_scale))
    return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


def _cpu_attention(q, cache: KVCache, md: AttentionMetadata, sm_scale):
    """Decode and prefill tokens alike in one custom call: each token attends its row's pages
    causally, read in place (no gathered copy). Any layout works (a padding token's row is S);
    the engine packs chunks (Buckets.packed) so that no slot is alignment padding."""
    from pallas_kernels import cpu_kernels

    out = cpu_kernels.paged_attention(q, cache.k, cache.v, md.page_tables, md.seq_lens,
                                      md.token_row, md.positions, sm_scale=sm_scale)
    return out.astype(q.dtype)


BACKENDS = {"cpu": _cpu_attention, "xla": _xla_attention, "pallas": _pallas_attention}


def resolve_backend(name: str, dtype: str = "float32") -> str:
    """"auto" -> pallas on TPU/GPU; on CPU, the C++ kernel for a float32 pool when it builds
    (pallas_kernels/cpu_kernels.py), else xla."""
    from pallas_kernels import cpu_kernels

    on_cpu = jax.default_backend() == "cpu"
    if name == "auto":
        if not on_cpu:
            return "pallas"
        return "cpu" if dtype == "float32" and cpu_kernels.available() else "xla"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    if name == "cpu":
        if not on_cpu or dtype != "float32":
            raise ValueError("attention_backend='cpu' runs on the CPU with a float32 KV pool "
                             f"(this is {jax.default_backend()}, {dtype})")
        if not cpu_kernels.available():
            raise ValueError(f"the CPU attention kernel is unavailable: "
                             f"{cpu_kernels.unavailable_reason()}")
    return name


def attend(backend: str, q, cache: KVCache, md: AttentionMetadata, sm_scale: float):
    """q f[T, Hq, D] -> f[T, Hq, D] over one layer's cache; this step's KV must already be
    written to it."""
    return BACKENDS[backend](q, cache, md, sm_scale)
