"""The adapter of JAX's TPU ragged paged attention (pallas_kernels/tpu/jax_kernel.py) and the
page-major pool it reads (kv_cache.PagedKV): on CPU, with JAX's `ref_ragged_paged_attention` in
the kernel's place (no Pallas interpret mode of jax 0.10.2 runs the kernel itself; it is compiled
for v5e and v6e in tests/test_tpu_compile.py), against the float64 oracle: the layout, the padded
KV heads (3 -> 4), windows, soft caps and the ragged rows of tests/attention_cases.py (JAX's
kernel masks scores by adding, not selecting, so the garbage it may read, slots past a row's
length or before its window, must be finite: the NaN of the cases becomes 7). And the backend's
choice of layout, and the pool's write and copy-on-write in the page-major layouts against the
head-major one."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import TOL, assert_close, mixed_rows, page_major, ragged_case
from jaxserve.backends import get, pool_layout
from jaxserve.model.kv_cache import KVLayout, KVPool, PagedKV, write_kv
from pallas_kernels.reference import ref_ragged_paged_attention_f64
from pallas_kernels.tpu import jax_kernel


@pytest.fixture
def jax_reference(monkeypatch):
    """JAX's kernel replaced by JAX's reference of it (same arguments, block sizes dropped)."""
    rpa = jax_kernel.jax_rpa

    def reference(*args, num_kv_pages_per_block, num_queries_per_block, **kw):
        assert num_kv_pages_per_block >= 1 and num_queries_per_block >= 1
        out = rpa.ref_ragged_paged_attention(*args, **kw)  # the rows' tokens only
        return jnp.pad(out, ((0, args[0].shape[0] - out.shape[0]), (0, 0), (0, 0)))

    monkeypatch.setattr(rpa, "ragged_paged_attention", reference)


@pytest.mark.parametrize("page_size,head_dim,kv_heads,group,dtype,window,soft_cap", [
    (16, 128, 3, 3, jnp.float32, None, None), (8, 128, 1, 8, jnp.bfloat16, 20, 30.0),
    (32, 256, 2, 2, jnp.float32, 50, None)])
def test_adapter_matches_the_f64_oracle(jax_reference, page_size, head_dim, kv_heads, group,
                                        dtype, window, soft_cap):
    case = ragged_case(0, mixed_rows(page_size, long=40), page_size=page_size,
                       num_kv_heads=kv_heads, group=group, head_dim=head_dim, dtype=dtype)
    heads = jax_kernel.padded_kv_heads(kv_heads, dtype)
    assert heads == {3: 4}.get(kv_heads, kv_heads)  # 6 combined heads do not tile; 8 do
    sm_scale = head_dim ** -0.5
    out = jax_kernel.ragged_paged_attention(
        case["q"], page_major(case, heads=heads, nan=7.0), case["page_tables"], case["seq_lens"],
        case["query_start"], num_kv_heads=kv_heads, sm_scale=sm_scale, window=window,
        soft_cap=soft_cap)
    expected = ref_ragged_paged_attention_f64(
        case["q"], case["k_pages"], case["v_pages"], case["page_tables"], case["seq_lens"],
        case["query_start"], sm_scale=sm_scale, window=window, soft_cap=soft_cap)
    n = int(case["query_start"][-1])  # tokens past the rows: padding, unspecified
    assert out.shape == case["q"].shape
    assert_close(out[:n], expected[:n], TOL[dtype])


def test_block_sizes_come_from_the_target_chip():
    """Outside a compile target the lookup answers as for v6e, clamped to the call's sizes."""
    pages, queries = jax_kernel.block_sizes(jnp.bfloat16, jnp.bfloat16, 32, 8, 128, 16, 8, 4)
    assert 1 <= pages <= 4 and 1 <= queries <= 8


def test_the_tpu_backend_chooses_the_layout():
    tpu, interpreted, cpu = get("pallas-tpu"), get("pallas-tpu-interpret"), get("xla")
    layout = lambda b, h, d, dt, g=2, q=jnp.bfloat16: pool_layout(  # noqa: E731
        b, h, d, dt, num_q_heads=h * g, q_dtype=q)
    jax_pool = lambda h, model: KVLayout(h, page_major=True, model_heads=model)  # noqa: E731
    flat = lambda h: KVLayout(h, page_major=True, flat=True)  # noqa: E731  ours
    assert layout(tpu, 3, 128, jnp.bfloat16, 3) == jax_pool(4, 3)
    assert layout(tpu, 1, 256, jnp.float32, 8) == jax_pool(1, 1)
    # head dim 256 with several KV heads in JAX's head block: Mosaic refuses it (Gemma 2)
    assert layout(tpu, 8, 256, jnp.float32) == flat(8)
    assert layout(tpu, 3, 64, jnp.bfloat16) == flat(3)  # JAX's takes no head dim 64
    # JAX's kernel would block 4 of 8 f32 query heads, which Mosaic refuses
    assert layout(tpu, 8, 128, jnp.float32, 1, jnp.float32) == flat(8)
    assert layout(interpreted, 3, 128, jnp.bfloat16) == flat(3)  # JAX's does not interpret
    assert layout(tpu, 8, 128, jnp.int8) == flat(8)  # ours: pages and their scale rows
    assert layout(tpu, 2, 32, jnp.int8) == KVLayout(2)  # head-major, scales [Hkv, N, B]
    assert layout(tpu, 2, 32, jnp.bfloat16) == KVLayout(2)  # 2D = 64 lanes: not whole tiles
    assert layout(cpu, 3, 128, jnp.bfloat16) == KVLayout(3)


def test_a_byte_budget_counts_the_heads_the_pool_stores():
    """3 KV heads padded to 4 for JAX's kernel hold 4/3 of the model's bytes a token, so
    kv_cache_bytes buys pages of the pool's real size; heads fewer than tp repeat."""
    from jaxserve.config import ModelConfig
    from jaxserve.runtime.sharding import pool_bytes_per_token

    cfg = ModelConfig(vocab_size=256, hidden_size=384, intermediate_size=512, num_layers=2,
                      num_heads=3, num_kv_heads=3, head_dim=128)
    model = cfg.kv_bytes_per_token(2)
    per_token = lambda b, tp=1: pool_bytes_per_token(  # noqa: E731
        cfg, get(b), tp, jnp.bfloat16, jnp.bfloat16, 2, 0)
    assert per_token("xla") == per_token("pallas-tpu-interpret") == model
    assert per_token("pallas-tpu") == model * 4 // 3
    two = dataclasses.replace(cfg, num_heads=4, num_kv_heads=2)  # tp 4 repeats each twice
    assert pool_bytes_per_token(two, get("xla"), 4, jnp.bfloat16, jnp.bfloat16, 2, 0) == \
        2 * two.kv_bytes_per_token(2)


@pytest.mark.parametrize("flat", [False, True])
def test_page_major_write_and_copy_match_head_major(flat):
    """The same writes and copy-on-write in both layouts hold the same K and V; padded heads
    stay zero; a tensor-parallel pool holds each shard's padding."""
    rng = np.random.default_rng(0)
    n, b, d, h = 6, 4, 8, 3
    layout = KVLayout(4, page_major=True, model_heads=3, flat=flat)
    head = KVPool.zeros(1, h, n, b, d, jnp.float32)
    paged = KVPool.zeros(1, h, n, b, d, jnp.float32, layout)
    assert paged.layers[0].kv.shape == ((n, b, 8 * d) if flat else (n, b, 8, d))
    assert KVPool.zeros(1, 2 * h, n, b, d, jnp.float32, layout,
                        devices=2).layers[0].kv.shape[2] == (16 * d if flat else 16)
    k, v = (jnp.asarray(rng.standard_normal((5, h, d)), jnp.float32) for _ in range(2))
    slots = jnp.asarray([5, 6, 9, 12, 23], jnp.int32)
    head = KVPool((write_kv(head.layers[0], k, v, slots),))
    paged = KVPool((write_kv(paged.layers[0], k, v, slots),))
    src, dst = jnp.asarray([1, 2]), jnp.asarray([4, 3])
    head, paged = head.copy_pages(src, dst), paged.copy_pages(src, dst)
    assert isinstance(paged.layers[0], PagedKV) and paged.layers[0].num_kv_heads == h
    kv = np.asarray(paged.layers[0].kv).reshape(n, b, 4, 2, d)
    expected = dict(k_pages=head.layers[0].k, v_pages=head.layers[0].v)
    np.testing.assert_array_equal(kv, np.asarray(page_major(expected, heads=4)).reshape(kv.shape))
    assert not kv[:, :, h:].any() and kv[4].any() and kv[3].any()


def test_tensor_parallel_shards_each_layout_on_its_head_axis():
    """pool_specs: head-major arrays (pages and int8 scales) on axis 0, page-major on axis 2,
    where a shard of 2 * Hkv' (or 2 * Hkv' * D lanes) / tp is whole heads, K and V together.
    (test_multi_device's Pallas case, head dim 8, runs the head-major pool under shard_map.)"""
    from jax.sharding import PartitionSpec as P

    from jaxserve.runtime.sharding import pool_specs

    head = KVPool.zeros(1, 4, 3, 2, 8, jnp.int8)
    paged = KVPool.zeros(1, 4, 3, 2, 128, jnp.bfloat16, KVLayout(2, page_major=True, flat=True),
                         devices=2)
    assert jax.tree_util.tree_leaves(pool_specs(head), is_leaf=lambda x: isinstance(x, P)) \
        == [P("tp")] * 4
    assert pool_specs(paged).layers[0].kv == P(None, None, "tp")
    assert paged.layers[0].kv.shape == (3, 2, 2 * 2 * 2 * 128)  # 2 devices x 2 heads x K, V
