"""Every TPU attention kernel declares its cost (pl.CostEstimate), so XLA's TPU cost model
(`compiled.cost_analysis()`, compiled for v6e on this CPU host: tests/tpu_topology.py) counts
the pages it reads: an op of unknown cost would make `optimal_seconds` negative (-1 s each) and
leave its bytes out. Kernels compiled alone here; the engine's step in test_tpu_roofline.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.tpu import jax_kernel, ragged_paged_attention, scale_rows
from pallas_kernels.tpu.common import attention_cost, row_reads
from tpu_topology import abstract, tpu_device

T, S, P, B, N = 8, 8, 32, 16, 256  # a decode step: 8 rows of 32 pages, a 256-page pool


def _compile(layout, head_dim, kv_heads, dtype, device, *, tokens=T, window=None):
    q_heads = 2 * kv_heads
    q = abstract((tokens, q_heads, head_dim), jnp.bfloat16, device)
    meta = (abstract((S, P), jnp.int32, device), abstract((S,), jnp.int32, device),
            abstract((S + 1,), jnp.int32, device))
    if layout == "jax":
        kv = abstract((N, B, 2 * kv_heads, head_dim), dtype, device)
        fn = lambda q, kv, *m: jax_kernel.ragged_paged_attention(  # noqa: E731
            q, kv, *m, num_kv_heads=kv_heads, sm_scale=0.1, window=window)
        args = (q, kv, *meta)
    elif layout == "flat":
        kv = abstract((N, B, 2 * kv_heads * head_dim), dtype, device)
        scales = None if dtype != jnp.int8 else abstract(
            (N, scale_rows.row_lanes(kv_heads, B)), jnp.float32, device)
        fn = lambda q, kv, s, *m: ragged_paged_attention(  # noqa: E731
            q, kv, None, *m, sm_scale=0.1, window=window, kv_scales=s)
        args = (q, kv, scales, *meta)
    else:
        k = abstract((kv_heads, N, B, head_dim), dtype, device)
        scale = abstract((kv_heads, N, B), jnp.float32, device)
        fn = lambda q, k, v, ks, vs, *m: ragged_paged_attention(  # noqa: E731
            q, k, v, *m, sm_scale=0.1, k_scale=ks, v_scale=vs, window=window)
        args = (q, k, k, scale, scale, *meta)
    with jax_kernel.compile_target(device):
        return jax.jit(fn).lower(*args).compile().cost_analysis()


@pytest.mark.parametrize("layout,head_dim,kv_heads,dtype,tokens,window", [
    ("jax", 128, 2, jnp.bfloat16, T, None),  # JAX's kernel: a cost attached by with_cost
    ("flat", 64, 3, jnp.bfloat16, T, None),  # ours, decode path
    ("flat", 64, 3, jnp.bfloat16, 64, None),  # ours, prefill path (T > S)
    ("head", 128, 2, jnp.int8, T, 128),  # ours, int8 pages with scales, a window
    ("flat", 64, 3, jnp.int8, 64, None),  # ours, int8 pages with their scale rows, prefill
])
def test_each_kernel_declares_the_pages_it_reads(layout, head_dim, kv_heads, dtype, tokens,
                                                 window):
    cost = _compile(layout, head_dim, kv_heads, dtype, tpu_device("v6e"), tokens=tokens,
                    window=window)
    assert cost["optimal_seconds"] > 0  # no op of unknown cost
    pages = P if window is None or layout == "jax" else min(P, (-(-window // 64) + 1) * 4)
    slot_bytes = 2 * kv_heads * (head_dim * jnp.dtype(dtype).itemsize
                                 + (4 if dtype == jnp.int8 else 0))
    reads = row_reads(tokens, S, 1 if tokens <= S else 32) * pages * B * slot_bytes
    assert cost["bytes accessed"] >= reads > 0
    assert cost["flops"] >= 4 * tokens * 2 * kv_heads * pages * B * head_dim


def test_row_reads_count_each_row_once_per_query_block():
    assert row_reads(8, 8, 1) == 8  # decode: a token per row
    assert row_reads(512, 1, 32) == 16  # one long chunk: every block reads the row
    assert row_reads(96, 64, 32) == 66  # 64 rows over 3 blocks: two rows may straddle
    c = attention_cost(num_tokens=1, num_rows=1, block_q=1, pages_read=2, page_size=16,
                       num_q_heads=4, kv_heads_read=2, head_dim=128, kv_itemsize=2,
                       q_itemsize=2)
    assert c.bytes_accessed == 32 * 2 * 2 * 128 * 2 + 2 * 4 * 128 * 2 + 4 * 2
    assert c.flops == 4 * 32 * 4 * 128 and c.transcendentals == 32 * 4
