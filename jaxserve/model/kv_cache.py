"""The paged KV pool as the model sees it: one KVCache per layer, and the write of a step's keys
and values into their slots.

A pool holds float pages (the serving dtype or bfloat16) or int8 pages with a float32 scale per
token and KV head beside them: each written key (and value) vector maps its absolute maximum to
127, symmetric, so a slot is stored as D int8 values and one scale and every attention backend
dequantizes as it reads (pallas_kernels/reference.py states the semantics)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.pytree import pytree_dataclass


@pytree_dataclass
class KVCache:
    """One layer's paged keys and values, head-major so that one head's page is a contiguous
    [B, D] block. Page 0 is scratch: padded slots write there and no valid position reads it."""

    k: jax.Array  # f[Hkv, N, B, D], or i8 with scales
    v: jax.Array  # f[Hkv, N, B, D], or i8 with scales
    k_scale: jax.Array | None = None  # f32[Hkv, N, B] for int8 pages, else None
    v_scale: jax.Array | None = None

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


@pytree_dataclass
class KVPool:
    """The paged KV cache: one KVCache per layer, all indexed by the same page ids. Separate
    arrays per layer (not one [L, ...] array) let each layer's write and gather touch only its
    own buffer, and compile faster than slicing one stacked pool in the unrolled model."""

    layers: tuple  # L x KVCache

    @classmethod
    def zeros(cls, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
              head_dim: int, dtype) -> "KVPool":
        """dtype: the pages' dtype; int8 pages get float32 scales [Hkv, N, B] (ones)."""
        shape = (num_kv_heads, num_pages, page_size, head_dim)

        def layer():
            pages = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
            if jnp.dtype(dtype) != jnp.int8:
                return KVCache(*pages)
            return KVCache(*pages, jnp.ones(shape[:-1], jnp.float32),
                           jnp.ones(shape[:-1], jnp.float32))

        return cls(tuple(layer() for _ in range(num_layers)))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in jax.tree_util.tree_leaves(self.layers))


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x f[..., D] -> (i8[..., D], f32[...]): each vector's absolute maximum maps to 127 (a zero
    vector gets scale 0 and zeros), so every element is within half a step (scale / 2). The
    scale is max * float32(1 / 127), the product XLA folds a division by 127 into (the CPU
    backend's write_kv.cc computes the same)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) * np.float32(1 / 127)
    q = jnp.round(x / jnp.where(scale > 0, scale, 1.0)[..., None])
    return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def write_kv(cache: KVCache, k: jax.Array, v: jax.Array, slot_mapping: jax.Array) -> KVCache:
    """Scatter this step's keys/values (f[T, Hkv, D]) into one layer's cache at their slots."""
    b = cache.page_size
    page, offset = slot_mapping // b, slot_mapping % b
    # Adjacent advanced indices after a slice keep their place: the update is [Hkv, T, D].
    # Slots are in bounds by construction; promising it lets XLA scatter in place.
    mode = "promise_in_bounds"
    if not cache.quantized:
        k, v = k.swapaxes(0, 1), v.swapaxes(0, 1)  # [Hkv, T, D]
        return KVCache(k=cache.k.at[:, page, offset].set(k.astype(cache.k.dtype), mode=mode),
                       v=cache.v.at[:, page, offset].set(v.astype(cache.v.dtype), mode=mode))
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)  # quantized [T, Hkv, D], then swapped
    kq, vq, ks, vs = kq.swapaxes(0, 1), vq.swapaxes(0, 1), ks.swapaxes(0, 1), vs.swapaxes(0, 1)
    return KVCache(k=cache.k.at[:, page, offset].set(kq, mode=mode),
                   v=cache.v.at[:, page, offset].set(vq, mode=mode),
                   k_scale=cache.k_scale.at[:, page, offset].set(ks, mode=mode),
                   v_scale=cache.v_scale.at[:, page, offset].set(vs, mode=mode))
