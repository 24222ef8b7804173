"""The paged KV pool as the model sees it: one KVCache per layer, and the write of a step's keys
and values into their slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.pytree import pytree_dataclass


@pytree_dataclass
class KVCache:
    """One layer's paged keys and values, head-major so that one head's page is a contiguous
    [B, D] block. Page 0 is scratch: padded slots write there and no valid position reads it."""

    k: jax.Array  # f[Hkv, N, B, D]
    v: jax.Array  # f[Hkv, N, B, D]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]


@pytree_dataclass
class KVPool:
    """The paged KV cache: one KVCache per layer, all indexed by the same page ids. Separate
    arrays per layer (not one [L, ...] array) let each layer's write and gather touch only its
    own buffer, and compile faster than slicing one stacked pool in the unrolled model."""

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
