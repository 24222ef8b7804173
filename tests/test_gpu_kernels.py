"""The GPU (Triton) ragged_paged_attention against the float64 oracle and the jnp reference:
interpreted on a CPU, compiled where the default backend is a GPU (scripts/device_check.py runs
this file there). Cases and tolerances: tests/attention_cases.py."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import (EXTREME_TOL, F64_TOL, RAGGED_SHAPES, TOL, assert_close, call,
                             dense_f64, extreme_case, make_case, mixed_rows, ragged_case)
from pallas_kernels.gpu import GpuBlockSizes, check_supported, ragged_paged_attention
from pallas_kernels.gpu.ragged_paged_attention import _num_splits
from pallas_kernels.reference import ref_ragged_paged_attention

INTERPRET = jax.default_backend() != "gpu"


def attend(case, sm_scale, **kw):
    return call(ragged_paged_attention, case, sm_scale=sm_scale, interpret=INTERPRET, **kw)


@pytest.fixture(autouse=True)
def _highest_precision():
    # The references' own einsums: IEEE f32 on a GPU too (TF32 otherwise).
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("page_size,head_dim,num_kv_heads,group,dtype", RAGGED_SHAPES)
def test_matches_float64_and_reference_on_mixed_rows(page_size, head_dim, num_kv_heads, group,
                                                     dtype):
    """Decode rows at 1, B-1, B, B+1 and long lengths, whole prompts, chunks after a prefix and
    empty rows, in mixed order, over shuffled pages with NaN in page 0, unused pages and tails."""
    case = ragged_case(10, mixed_rows(page_size, long=120), page_size=page_size,
                       num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    out = attend(case, scale)
    assert out.shape == case["q"].shape and out.dtype == dtype
    assert_close(out, call(ref_ragged_paged_attention, case, sm_scale=scale), TOL[dtype])
    if dtype == jnp.float32:
        assert_close(out, dense_f64(case, scale), F64_TOL)
    np.testing.assert_array_equal(np.asarray(out[-3:], np.float32), 0)  # padding tokens


def test_split_k_changes_nothing():
    """Few rows over long contexts: the automatic rule splits each row's pages; one split and
    several give the same output."""
    case = ragged_case(11, [(300, 1), (0, 0), (97, 1), (260, 5)], page_size=16, num_kv_heads=2,
                       group=4, head_dim=64)
    assert _num_splits(num_blocks=8, num_kv_heads=2, table_width=19, pages_per_block=4) > 1
    assert _num_splits(num_blocks=512, num_kv_heads=8, table_width=19, pages_per_block=4) == 1
    outs = [attend(case, 0.125, block_sizes=GpuBlockSizes(splits=s, pages_per_block=2))
            for s in (1, 3, 10)]
    for out in outs:
        assert_close(out, dense_f64(case, 0.125), F64_TOL)
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("block_q", [1, 2, 8])
def test_query_blocks_and_chunked_prefill(block_q):
    """A 37-token prompt at once, and as chunks 21 + 16 (the second reads the first's pages),
    with several query-block sizes: identical rows."""
    case = make_case(12, seq_lens=[37], q_lens=[37], page_size=8, num_kv_heads=1, group=3,
                     head_dim=64)
    sizes = GpuBlockSizes(block_q=block_q, pages_per_block=2)
    whole = attend(case, 0.125, block_sizes=sizes)
    assert_close(whole, dense_f64(case, 0.125), F64_TOL)
    chunk = dict(case, q=case["q"][21:37], query_start=jnp.array([0, 16], jnp.int32))
    second = attend(chunk, 0.125, block_sizes=sizes)
    np.testing.assert_allclose(np.asarray(second), np.asarray(whole[21:37]), atol=2e-6,
                               rtol=2e-6)


def test_pure_decode_batch_matches_jax_paged_attention():
    """A decode-only batch (T == S) against JAX's own Triton paged_attention (decode only, same
    head-major pool), a peer written independently."""
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    rng = np.random.default_rng(13)
    lens = np.array([64, 17, 128, 1], np.int32)
    case = make_case(13, seq_lens=lens, page_size=16, num_kv_heads=2, group=4, head_dim=64,
                     extra_pages=0, table_width=8)
    case["query_start"] = jnp.arange(5, dtype=jnp.int32)
    case["q"] = jnp.asarray(rng.standard_normal((4, 8, 64)), jnp.float32)
    ours = attend(case, 1.0)
    pool_k = jnp.nan_to_num(case["k_pages"])  # the peer reads whole pages
    pool_v = jnp.nan_to_num(case["v_pages"])
    peer = paged_attention(case["q"], pool_k, pool_v, case["page_tables"], case["seq_lens"],
                           block_h=16, pages_per_compute_block=2, k_splits=2,
                           interpret=INTERPRET)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(peer), atol=2e-5, rtol=2e-5)


def test_extreme_logits():
    """Scores near +-1e4, where a naive exp overflows float32; one key dominates a row."""
    case = extreme_case()
    out = attend(case, 1.0, block_sizes=GpuBlockSizes(splits=2, pages_per_block=2))
    assert_close(out, call(ref_ragged_paged_attention, case, sm_scale=1.0), TOL[jnp.float32])
    assert_close(out, dense_f64(case, 1.0), EXTREME_TOL)
    v = np.asarray(case["v_pages"])[0, int(case["page_tables"][1, 0]), 2]
    np.testing.assert_allclose(np.asarray(out)[16, 0], v, atol=1e-6)


def test_runs_under_jit_as_the_engine_calls_it():
    case = ragged_case(14, mixed_rows(16, long=40), page_size=16, num_kv_heads=2, group=3,
                       head_dim=64)
    step = jax.jit(lambda c: call(ragged_paged_attention, c, sm_scale=0.125,
                                  interpret=INTERPRET))
    assert_close(step(case), dense_f64(case, 0.125), F64_TOL)


@pytest.mark.parametrize("head_dim,page_size", [(80, 16), (64, 12), (8, 16)])
def test_unsupported_shapes_name_the_xla_fallback(head_dim, page_size):
    with pytest.raises(ValueError, match="attention_backend='xla'"):
        check_supported(head_dim=head_dim, page_size=page_size)
    case = make_case(15, seq_lens=[5], q_lens=[5], page_size=page_size, num_kv_heads=1,
                     group=2, head_dim=head_dim)
    with pytest.raises(ValueError, match="attention_backend='xla'"):
        attend(case, 1.0)


@pytest.mark.parametrize("change,message", [
    (lambda c: c.update(page_tables=c["page_tables"].at[1, 1].set(999)), "outside the pool"),
    (lambda c: c.update(query_start=jnp.array([0, 6, 5], jnp.int32)), "non-decreasing"),
    (lambda c: c.update(query_start=jnp.array([0, 7, 9], jnp.int32)), "seq_lens must include"),
    (lambda c: c.update(q=c["q"][:, :3]), "multiple of KV heads"),
    (lambda: GpuBlockSizes(block_q=3), "power of two"),
])
def test_bad_inputs(change, message):
    case = make_case(7, seq_lens=[5, 9], q_lens=[5, 2], page_size=8, num_kv_heads=2, group=2,
                     head_dim=16)
    with pytest.raises(ValueError, match=message):
        if change.__code__.co_argcount == 0:
            change()
        else:
            change(case)
            attend(case, 1.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_cuda_without_host_callbacks(dtype):
    """Lowered for CUDA on this CPU-only jaxlib: one Triton call, no host callback (jax.export
    refuses Triton calls, so this goes through trace/lower). Compiling needs a GPU."""
    case = ragged_case(16, mixed_rows(16, long=64), page_size=16, num_kv_heads=2, group=3,
                       head_dim=128, dtype=dtype)
    text = jax.jit(lambda c: call(ragged_paged_attention, c, sm_scale=0.1)).trace(case).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "callback" not in text
