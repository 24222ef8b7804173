"""The paged KV pool as the model sees it: one KVCache per layer, and the write of a step's keys
and values into their slots.

A pool holds float pages (the serving dtype or bfloat16) or int8 pages with a float32 scale per
token and KV head beside them: each written key (and value) vector maps its absolute maximum to
127, symmetric, so a slot is stored as D int8 values and one scale and every attention backend
dequantizes as it reads (pallas_kernels/reference.py states the semantics).

The pool's layout is the attention backend's choice (its `kv_layout`, a KVLayout), as vLLM's
attention backends name their KV cache shape: head-major KVCache [Hkv, N, B, D] (the CPU and
XLA backends, and the TPU kernels of pallas_kernels/tpu where JAX's does not apply), or
page-major PagedKV [N, B, 2 * Hkv', D] with K and V interleaved on the head axis, so that one
DMA moves a whole page of every head (JAX's TPU ragged paged attention), or the same bytes as
lanes [N, B, 2 * Hkv * D] (our TPU kernels; int8 pages with their scales as rows f32[N, L]).
Above the model's
write and attention nothing sees the layout: caches copy their own pages (`copy_pages`) and
name their head axis (`HEAD_AXIS`, for tensor-parallel sharding)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.kv_groups import groups_of  # noqa: F401 (the pool's slots: a group's layers)
from jaxserve.pytree import pytree_dataclass, static_field
from pallas_kernels.tpu import scale_rows


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

    HEAD_AXIS = 0  # of every array (pages and scales): the axis tensor parallelism shards

    def copy_pages(self, src, dst) -> "KVCache":
        """Page src[i] -> dst[i] in every array (pages, and an int8 pool's scales)."""
        return jax.tree_util.tree_map(
            lambda x: x.at[:, dst].set(x[:, src], mode="promise_in_bounds"), self)


@pytree_dataclass
class PagedKV:
    """One layer's pages, page-major with K and V interleaved on the head axis: kv[page, slot,
    2h] is head h's key, kv[page, slot, 2h + 1] its value; or the same bytes with heads and head
    dim flattened into lanes, [N, B, 2 * Hkv' * D] (KVLayout.flat: XLA keeps a TPU array
    row-major only when its minor dim is whole 128-lane tiles, which D = 64 is not). Heads past
    the model's (padding a kernel asks for, KVLayout.heads) are never written and read by no
    query. Flat int8 pages keep their scales as one lane-dense row per page (`scales`,
    pallas_kernels/tpu/scale_rows.py: XLA keeps it row-major and the step rewrites whole rows
    in place, where the head-major f32[Hkv, N, B] was relaid out every layer and step)."""

    kv: jax.Array  # f[N, B, 2 * Hkv', D] or f[N, B, 2 * Hkv' * D] (per tensor-parallel shard)
    scales: jax.Array | None = None  # f32[N, L] for flat int8 pages (scale_rows.row_lanes)
    num_kv_heads: int = static_field(default=0)  # Hkv <= Hkv': the model's heads (per shard)

    HEAD_AXIS = 2  # of the pages; the scale rows' is their last (their lanes, head by head)

    @property
    def page_size(self) -> int:
        return self.kv.shape[1]

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def copy_pages(self, src, dst) -> "PagedKV":
        return jax.tree_util.tree_map(
            lambda x: x.at[dst].set(x[src], mode="promise_in_bounds"), self)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """A backend's pool layout for one device's KV heads: page_major (PagedKV) or head-major
    (KVCache), and `heads`, the KV heads each device stores (page-major: padded up to what the
    kernel takes, of which the model's `model_heads`; head-major: the model's)."""

    heads: int
    page_major: bool = False
    model_heads: int | None = None  # page-major: the model's heads per device (None: heads)
    flat: bool = False  # page-major: heads and head dim flattened into lanes [N, B, 2 Hkv' D]

    def zeros(self, num_pages: int, page_size: int, head_dim: int, dtype, devices: int = 1):
        """One layer's zeroed cache over `devices` tensor-parallel shards (heads each)."""
        heads = self.heads * devices
        if self.page_major:
            quantized = jnp.dtype(dtype) == jnp.int8
            if quantized and not self.flat:
                raise ValueError("int8 page-major pools are flat [N, B, 2 * Hkv * D]")
            shape = (num_pages, page_size) + ((2 * heads * head_dim,) if self.flat
                                              else (2 * heads, head_dim))
            scales = None
            if quantized:  # scales of one (as head-major pools), each device's in its lanes
                ones = jnp.ones((self.heads, num_pages, page_size), jnp.float32)
                scales = jnp.tile(scale_rows.pack(ones, ones), (1, devices))
            return PagedKV(jnp.zeros(shape, dtype), scales,
                           num_kv_heads=self.model_heads or self.heads)
        shape = (heads, num_pages, page_size, head_dim)
        pages = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
        if jnp.dtype(dtype) != jnp.int8:
            return KVCache(*pages)
        return KVCache(*pages, jnp.ones(shape[:-1], jnp.float32), jnp.ones(shape[:-1], jnp.float32))


@pytree_dataclass
class KVPool:
    """The paged KV cache: one cache per layer in the backend's layout (KVCache or PagedKV), all
    indexed by the same page ids. Separate arrays per layer (not one [L, ...] array) let each
    layer's write and gather touch only its own buffer, and compile faster than slicing one
    stacked pool in the unrolled model."""

    layers: tuple  # L x (KVCache | PagedKV)

    @classmethod
    def zeros(cls, num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
              head_dim: int, dtype, layout: KVLayout | None = None,
              devices: int = 1) -> "KVPool":
        """dtype: the pages' dtype; int8 pages get float32 scales [Hkv, N, B] (ones).
        num_kv_heads: the pool's over all devices; layout: one device's (None: head-major),
        over `devices` tensor-parallel shards."""
        if layout is None or not layout.page_major:
            layout, devices = KVLayout(num_kv_heads), 1
        return cls(tuple(layout.zeros(num_pages, page_size, head_dim, dtype, devices)
                         for _ in range(num_layers)))

    def copy_pages(self, src, dst) -> "KVPool":
        """Copy-on-write: page src[i] -> dst[i] in every layer, whatever its layout."""
        return KVPool(tuple(cache.copy_pages(src, dst) for cache in self.layers))

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


def write_kv(cache, k: jax.Array, v: jax.Array, slot_mapping: jax.Array):
    """Scatter this step's keys/values (f[T, Hkv, D]) into one layer's cache at their slots."""
    b = cache.page_size
    page, offset = slot_mapping // b, slot_mapping % b
    # Slots are in bounds by construction; promising it lets XLA scatter in place.
    mode = "promise_in_bounds"
    if isinstance(cache, PagedKV):  # [T, Hkv, 2, D] -> heads 0..2Hkv of each slot
        t, hkv, d = k.shape
        scales = cache.scales
        if cache.quantized:
            (k, k_scale), (v, v_scale) = quantize_kv(k), quantize_kv(v)
            scales = scale_rows.write(scales, page, offset, k_scale, v_scale, b)
        kv = jnp.stack([k, v], axis=2).reshape(t, 2 * hkv, d)
        if cache.kv.ndim == 3:  # flat: heads and head dim in lanes
            kv = kv.reshape(t, 2 * hkv * d)
        return PagedKV(cache.kv.at[page, offset, :kv.shape[1]].set(
            kv.astype(cache.kv.dtype), mode=mode), scales, num_kv_heads=hkv)
    # Adjacent advanced indices after a slice keep their place: the update is [Hkv, T, D].
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
