"""Attention over the paged KV pool as the model calls it: the per-step metadata and the one
dispatch (`attend`) to the backend's attention (jaxserve/backends/).

Dimension letters: T flat tokens this step, S sequences (rows of the page table), Sd decode rows
(the first Sd of S, one token each), P pages per row, N pages in the pool, B page size, L layers,
Hq query heads, Hkv KV heads, G = Hq // Hkv, D head dim.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import jax

from jaxserve.model.kv_cache import KVCache, write_kv
from jaxserve.pytree import pytree_dataclass, static_field


@pytree_dataclass
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
    # between); query_start then counts a row's padding as its own. 1 = packed.
    query_block: int = static_field(default=1)
    # Layer groups (core/kv_groups.py), None for a model of one: each group's page tables
    # and slots (group 0's are also page_tables and slot_mapping); for_group(g) is a layer's.
    group_page_tables: jax.Array | None = None  # i32[G, S, P]
    group_slot_mapping: jax.Array | None = None  # i32[G, T]

    def for_group(self, group):
        """The metadata a layer of `group` attends with (its group's table and slots): plain
        metadata, as every backend takes. group may be traced (scanned layers)."""
        if self.group_page_tables is None:
            return self
        return dataclasses.replace(self, page_tables=self.group_page_tables[group],
                                   slot_mapping=self.group_slot_mapping[group],
                                   group_page_tables=None, group_slot_mapping=None)


class AttentionBackend(Protocol):
    """What the model needs of a backend (jaxserve.backends.Backend is one), passed down as an
    object: the model looks nothing up."""

    attention: Callable  # (q, cache, md, *, sm_scale, window, soft_cap, sinks) -> f[T, Hq, D]
    write_kv: Callable | None  # (cache, k, v, slot_mapping) -> cache; None: kv_cache.write_kv


def write(backend: AttentionBackend, cache: KVCache, k, v, slot_mapping) -> KVCache:
    """This step's keys and values (f[T, Hkv, D]) into one layer's cache at their slots, by the
    backend's own write where it has one."""
    return (backend.write_kv or write_kv)(cache, k, v, slot_mapping)


def attend(backend: AttentionBackend, q, cache: KVCache, md: AttentionMetadata,
           sm_scale: float, *, window: int | None = None, soft_cap: float | None = None,
           sinks=None):
    """q f[T, Hq, D] -> f[T, Hq, D] over one layer's cache; this step's KV must already be
    written to it. window: a query at position p attends keys at positions > p - window only;
    soft_cap: scores (scaled by sm_scale) become soft_cap * tanh(score / soft_cap); sinks
    f[Hq] (gpt-oss's attention sinks): a learned logit per query head added to the softmax's
    denominator, taking probability mass and giving no value. None (statically): none, and the
    backends compute nothing for them."""
    return backend.attention(q, cache, md, sm_scale=sm_scale, window=window, soft_cap=soft_cap,
                             sinks=sinks)
