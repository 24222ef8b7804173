"""Attention over the paged KV pool: per-step metadata, the KV pool pytree, and the one dispatch
that every model layer calls (`attend`). Backends: "xla" (plain jnp, the fast path on CPU) and
"pallas" (pallas_kernels/, compiled on TPU/GPU, interpret mode on CPU).

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


def static_field():
    return dataclasses.field(metadata={"static": True})


@_pytree_dataclass
class KVPool:
    """The paged KV cache: one array for keys and one for values. Page 0 is scratch: padded slots
    write there and no valid position reads it."""

    k: jax.Array  # f[L, N, B, Hkv, D]
    v: jax.Array  # f[L, N, B, Hkv, D]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


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


def write_kv(pool: KVPool, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVPool:
    """Scatter this step's keys/values (f[T, Hkv, D]) into layer `layer` at their slots."""
    b = pool.page_size
    page, offset = slot_mapping // b, slot_mapping % b
    # Slots are in bounds by construction; promising it lets XLA scatter in place instead of
    # rewriting the whole pool through a bounds-checked select.
    mode = "promise_in_bounds"
    return KVPool(k=pool.k.at[layer, page, offset].set(k.astype(pool.k.dtype), mode=mode),
                  v=pool.v.at[layer, page, offset].set(v.astype(pool.v.dtype), mode=mode))


def _xla_decode(q, pool: KVPool, layer, page_tables, seq_lens, sm_scale):
    """q f[Sd, Hq, D]: each row attends its own pages up to seq_lens."""
    sd, hq, d = q.shape
    hkv = pool.k.shape[3]
    k = pool.k[layer, page_tables].reshape(sd, -1, hkv, d)  # [Sd, P*B, Hkv, D]
    v = pool.v[layer, page_tables].reshape(sd, -1, hkv, d)
    qg = q.reshape(sd, hkv, hq // hkv, d).astype(jnp.float32)
    s = jnp.einsum("skgd,sckd->skgc", qg, k.astype(jnp.float32)) * sm_scale
    valid = jnp.arange(k.shape[1])[None, :] < seq_lens[:, None]  # [Sd, C]
    s = jnp.where(valid[:, None, None, :], s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("skgc,sckd->skgd", p, v.astype(jnp.float32))
    return out.reshape(sd, hq, d).astype(q.dtype)


def _xla_prefill(q, pool: KVPool, layer, page_tables, positions, token_row, sm_scale):
    """q f[Tp, Hq, D] from Sp rows (token_row in [0, Sp), Sp for padding): each token attends the
    keys of its own row at positions <= its own (causal; earlier pages included)."""
    tp, hq, d = q.shape
    sp = page_tables.shape[0]
    hkv = pool.k.shape[3]
    k = pool.k[layer, page_tables].reshape(-1, hkv, d)  # [Sp*C, Hkv, D]
    v = pool.v[layer, page_tables].reshape(-1, hkv, d)
    c = k.shape[0] // sp
    qg = q.reshape(tp, hkv, hq // hkv, d).astype(jnp.float32)
    s = jnp.einsum("tkgd,ckd->kgtc", qg, k.astype(jnp.float32)) * sm_scale
    key_row = jnp.arange(sp * c) // c
    key_pos = jnp.arange(sp * c) % c
    valid = (key_row[None, :] == token_row[:, None]) & (key_pos[None, :] <= positions[:, None])
    s = jnp.where(valid[None, None], s, _MASKED)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("kgtc,ckd->tkgd", p, v.astype(jnp.float32))
    return out.reshape(tp, hq, d).astype(q.dtype)


def _xla_attention(q, pool, layer, md: AttentionMetadata, sm_scale):
    sd = md.num_decode
    parts = []
    if sd:
        parts.append(_xla_decode(q[:sd], pool, layer, md.page_tables[:sd], md.seq_lens[:sd],
                                 sm_scale))
    if q.shape[0] > sd:
        parts.append(_xla_prefill(q[sd:], pool, layer, md.page_tables[sd:], md.positions[sd:],
                                  md.token_row[sd:] - sd, sm_scale))
    return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


def _pallas_attention(q, pool, layer, md: AttentionMetadata, sm_scale):
    from pallas_kernels import paged_decode_attention, ragged_prefill_attention

    sd = md.num_decode
    k, v = pool.k[layer], pool.v[layer]
    parts = []
    if sd:
        parts.append(paged_decode_attention(q[:sd], k, v, md.page_tables[:sd], md.seq_lens[:sd],
                                            sm_scale=sm_scale))
    if q.shape[0] > sd:
        query_start = md.query_start[sd:] - sd
        parts.append(ragged_prefill_attention(q[sd:], k, v, md.page_tables[sd:], md.seq_lens[sd:],
                                              query_start, sm_scale=sm_scale))
    return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


BACKENDS = {"xla": _xla_attention, "pallas": _pallas_attention}


def resolve_backend(name: str) -> str:
    """"auto" -> pallas on TPU/GPU, xla on CPU."""
    if name == "auto":
        return "xla" if jax.default_backend() == "cpu" else "pallas"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}")
    return name


def attend(backend: str, q, pool: KVPool, layer, md: AttentionMetadata, sm_scale: float):
    """q f[T, Hq, D] -> f[T, Hq, D]; this step's KV must already be written to the pool."""
    return BACKENDS[backend](q, pool, layer, md, sm_scale)
