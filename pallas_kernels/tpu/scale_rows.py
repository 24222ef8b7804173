"""Where an int8 page-major pool keeps its scales: one f32 row per page (kv_cache.PagedKV.scales
f32[N, L]), lane-dense, read by the TPU kernels in place and written whole by the step.

Row p holds, for each KV head h, its B key scales then its B value scales at lanes
h * stride .. h * stride + 2B (`head_stride`: 2B rounded up to a power of two, or to whole
128-lane tiles past 128), so no head's scales straddle a 128-lane tile; L = H * stride rounded
up to whole tiles (`row_lanes`). Why rows of pages: XLA keeps f32[N, L] row-major (its default
TPU layout of the head-major f32[Hkv, N, B] puts N minor, and the kernels' view of it cost a
relayout per layer and step), a step rewrites the rows of the pages it writes with a scatter of
whole rows, which XLA does in place (a scatter of single lanes is counted over the whole array),
and a kernel's DMA moves at least 512 contiguous bytes (128 f32 lanes: `window_lanes`), so a
head's [2B] scales come with their tile's other lanes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

LANES = 128


def head_stride(page_size: int) -> int:
    """Lanes between two heads' scales in a row: 2B up to a power of two dividing 128, or up to
    whole 128-lane tiles."""
    lanes = 2 * page_size
    if lanes > LANES:
        return -(-lanes // LANES) * LANES
    return 1 << (lanes - 1).bit_length()


def row_lanes(num_kv_heads: int, page_size: int) -> int:
    """L: a page's row of scales for num_kv_heads heads, whole 128-lane tiles."""
    return -(-num_kv_heads * head_stride(page_size) // LANES) * LANES


def window_lanes(page_size: int) -> int:
    """Lanes one DMA moves to bring a head's scales: its tile (or tiles)."""
    return max(LANES, head_stride(page_size))


def pack(k_scale: jax.Array, v_scale: jax.Array) -> jax.Array:
    """Head-major scales f32[Hkv, N, B] (K and V) -> the rows f32[N, L]."""
    num_kv_heads, num_pages, page_size = k_scale.shape
    stride = head_stride(page_size)
    per_head = jnp.concatenate([k_scale, v_scale], axis=2)  # [Hkv, N, 2B]
    per_head = jnp.pad(per_head, ((0, 0), (0, 0), (0, stride - 2 * page_size)))
    rows = per_head.transpose(1, 0, 2).reshape(num_pages, num_kv_heads * stride)
    return jnp.pad(rows, ((0, 0), (0, row_lanes(num_kv_heads, page_size) - rows.shape[1])))


def write(rows: jax.Array, page: jax.Array, offset: jax.Array, k_scale: jax.Array,
          v_scale: jax.Array, page_size: int) -> jax.Array:
    """rows f32[N, L] with the scales of T new slots (page, offset i32[T]; k_scale, v_scale
    f32[T, Hkv]) written, by rewriting each written page's whole row: every token's row is its
    page's old row with the lanes of all of this step's tokens on that page (the writer of a
    lane summed over the page's tokens, exactly, on its bits), and tokens of one
    page write identical rows."""
    num_tokens, num_kv_heads = k_scale.shape
    width = rows.shape[1]
    stride = head_stride(page_size)
    lane = np.arange(width)  # static: each lane's head, kind (key or value) and slot
    head, within = lane // stride, lane % stride
    is_value = within >= page_size
    lane_slot = np.where(is_value, within - page_size, within)
    used = (head < num_kv_heads) & (within < 2 * page_size)
    spread = lambda x: jnp.pad(jnp.repeat(x, stride, axis=1),  # noqa: E731 [T, Hkv] -> [T, L]
                               ((0, 0), (0, width - num_kv_heads * stride)))
    values = jnp.where(is_value[None], spread(v_scale), spread(k_scale))  # [T, L]
    mine = used[None] & (lane_slot[None] == offset[:, None])  # [T, L]: lanes token t writes
    same_page = (page[:, None] == page[None, :]).astype(jnp.float32)  # [T, T]
    # Each lane of a page has at most one writer, so summing over the page's tokens picks its
    # value: done on the value's bits in two 16-bit halves (exact in f32; a NaN scale stays in
    # its own lane), with a count of writers beside them.
    bits = jax.lax.bitcast_convert_type(values, jnp.uint32)
    parts = jnp.concatenate([(bits >> 16).astype(jnp.float32),
                             (bits & 0xFFFF).astype(jnp.float32), jnp.ones_like(values)], axis=1)
    summed = jnp.dot(same_page, jnp.where(jnp.tile(mine, (1, 3)), parts, 0.0),
                     precision=jax.lax.Precision.HIGHEST).astype(jnp.uint32)
    hi, lo, writers = (summed[:, i * width:(i + 1) * width] for i in range(3))
    merged = jax.lax.bitcast_convert_type((hi << 16) | lo, jnp.float32)
    new = jnp.where(writers > 0, merged, rows[page])
    # The new rows are made before the scatter starts: fused into it, their read of `rows`
    # would make XLA copy the whole array to write it in place.
    new = jax.lax.optimization_barrier(new)
    return rows.at[page].set(new, mode="promise_in_bounds")
