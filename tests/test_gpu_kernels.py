"""The GPU (Triton) ragged_paged_attention against the float64 oracle and the jnp reference:
interpreted on a CPU, compiled where the default backend is a GPU (scripts/device_check.py runs
this file there), and lowered for CUDA either way. Cases and tolerances: tests/attention_cases.py.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from attention_cases import (EXTREME_TOL, F64_TOL, RAGGED_SHAPES, TOL, assert_close, call,
                             dense_f64, extreme_case, make_case, mixed_rows, quantize_case,
                             ragged_case)
from pallas_kernels.gpu import GpuBlockSizes, check_supported, ragged_paged_attention
from pallas_kernels.gpu.block_sizes import MAX_SPLITS, plan
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


def _plan(num_tokens, num_seqs, num_kv_heads, group, table_width, page_size=16, **sizes):
    return plan(num_tokens=num_tokens, num_seqs=num_seqs, group=group, num_kv_heads=num_kv_heads,
                page_size=page_size, table_width=table_width,
                block_sizes=GpuBlockSizes(**sizes))


@pytest.mark.parametrize("page_size,head_dim,num_kv_heads,group,dtype", [
    (8, 64, 2, 3, jnp.float32),
    (16, 128, 1, 4, jnp.float32),
    (16, 64, 2, 4, jnp.bfloat16),  # bf16 q: int8 read as bf16 (exact), bf16 dots
])
def test_int8_pages_with_scales_match_float64(page_size, head_dim, num_kv_heads, group, dtype):
    """int8 pages with per-token, per-head scales (quantize_case: int8 garbage and NaN scales in
    page 0, unused pages and tails) on mixed rows over several splits, against the float64
    oracle of the dequantized pool."""
    case = quantize_case(ragged_case(17, mixed_rows(page_size, long=120), page_size=page_size,
                                     num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                                     dtype=dtype))
    assert case["k_pages"].dtype == jnp.int8 and np.isnan(np.asarray(case["v_scale"])).any()
    num_seqs, width = case["page_tables"].shape
    assert _plan(case["q"].shape[0], num_seqs, num_kv_heads, group, width,
                 page_size=page_size).splits > 1
    scale = 1 / math.sqrt(head_dim)
    out = attend(case, scale)
    assert out.shape == case["q"].shape and out.dtype == dtype
    assert_close(out, dense_f64(case, scale), TOL[dtype])
    np.testing.assert_array_equal(np.asarray(out[-3:], np.float32), 0)  # padding tokens


def test_split_rule_fills_the_gpu_for_small_batches_only():
    """The examples of block_sizes' docstring."""
    bench = _plan(64, 64, 8, 4, 128)  # 64 decode rows x 2048 context
    assert (bench.block_q, bench.rows, bench.splits, bench.pages_per_split) == (4, 16, 2, 64)
    one_long = _plan(1, 1, 8, 1, 2048)  # one decode row, 32k context
    assert (one_long.splits, one_long.pages_per_split) == (MAX_SPLITS, 64)
    assert _plan(256, 256, 8, 4, 128).splits == 1
    prefill = _plan(2048, 1, 8, 1, 128)
    assert (prefill.block_q, prefill.num_blocks, prefill.splits) == (64, 33, 4)
    assert _plan(4, 4, 1, 1, 2).splits == 1  # never a split without a page block
    tiny_pages = _plan(4, 4, 1, 3, 1, page_size=8)  # Triton's 16: 2 pages x 8, 4 tokens x Gp 4
    assert (tiny_pages.pages_per_block, tiny_pages.block_q, tiny_pages.group_pad) == (2, 4, 4)


def test_split_k_changes_nothing():
    """Few rows over long contexts: the automatic rule splits each row's pages; one split and
    several give the same output."""
    case = ragged_case(11, [(300, 1), (0, 0), (97, 1), (260, 5)], page_size=16, num_kv_heads=2,
                       group=4, head_dim=64)
    auto = _plan(case["q"].shape[0], 4, 2, 4, case["page_tables"].shape[1])
    assert auto.splits > 1
    outs = [attend(case, 0.125, block_sizes=GpuBlockSizes(splits=s, pages_per_block=2))
            for s in (1, 10)] + [attend(case, 0.125)]
    for out in outs:
        assert_close(out, dense_f64(case, 0.125), F64_TOL)
    for out in outs[1:]:
        np.testing.assert_allclose(np.asarray(out), np.asarray(outs[0]), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("block_q", [1, 8])
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


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the peer is deprecated in jax 0.11
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


def test_supported_dtypes_and_pool_size():
    check_supported(head_dim=64, page_size=16, dtype=jnp.bfloat16)
    check_supported(head_dim=128, page_size=8, dtype="float32")
    check_supported(head_dim=128, page_size=16, dtype=jnp.int8)
    with pytest.raises(ValueError, match="float16 is not float32, bfloat16 or int8.*'xla'"):
        check_supported(head_dim=64, page_size=16, dtype=jnp.float16)
    case = make_case(15, seq_lens=[5], q_lens=[5], page_size=16, num_kv_heads=1, group=1,
                     head_dim=16)
    huge = jax.ShapeDtypeStruct((1, 2**23, 16, 16), jnp.bfloat16)  # 2^31 elements, never built
    with pytest.raises(ValueError, match="int32 offsets.*'xla'"):
        ragged_paged_attention(case["q"].astype(jnp.bfloat16), huge, huge, case["page_tables"],
                               case["seq_lens"], case["query_start"], sm_scale=1.0)


@pytest.mark.parametrize("change,message", [
    (lambda c: c.update(page_tables=c["page_tables"].at[1, 1].set(999)), "outside the pool"),
    (lambda c: c.update(query_start=jnp.array([0, 6, 5], jnp.int32)), "non-decreasing"),
    (lambda c: c.update(query_start=jnp.array([0, 7, 9], jnp.int32)), "seq_lens must include"),
    (lambda c: c.update(q=c["q"][:, :3]), "multiple of KV heads"),
    (lambda c: c.update(k_pages=c["k_pages"].astype(jnp.int8),
                        v_pages=c["v_pages"].astype(jnp.int8)), "int8 pages need k_scale"),
    (lambda c: c.update(quantize_case(c), v_scale=None), "go together"),
    (lambda: GpuBlockSizes(block_q=3), "power of two"),
    (lambda: GpuBlockSizes(splits=0), "positive int"),
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


def _cuda_target():
    """Off a GPU, jax >= 0.11 lowers Triton calls only for a named GPU: an abstract H200."""
    if jax.default_backend() == "gpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                         platform="cuda")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


@pytest.mark.parametrize("dtype,quantized", [(jnp.float32, False), (jnp.bfloat16, False),
                                             (jnp.float32, True), (jnp.bfloat16, True)])
def test_lowers_for_cuda_without_host_callbacks_or_tf32(dtype, quantized, monkeypatch, capsys):
    """Lowered for CUDA (on a CPU-only jaxlib too): one Triton call, no host callback (jax.export
    refuses Triton calls, so this goes through trace/lower), and in the Triton IR (printed by
    pallas_call's debug flag) float32 dots are IEEE: Triton marks others `inputPrecision = tf32`.
    An int8 pool (dtype is then q's) is loaded as int8 pages (not dequantized outside the
    kernel) beside its f32 scales, and multiplied in q's dtype. Compiling needs a GPU."""
    case = ragged_case(16, mixed_rows(16, long=64), page_size=16, num_kv_heads=2, group=3,
                       head_dim=128, dtype=dtype)
    case = quantize_case(case) if quantized else case
    monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, debug=True))
    jax.clear_caches()  # the kernel must be traced again, with debug on
    with _cuda_target():
        lowered = jax.jit(lambda c: call(ragged_paged_attention, c, sm_scale=0.1)).trace(
            case).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "callback" not in text
    ir = capsys.readouterr().out.splitlines()
    dots = [line for line in ir if "tt.dot " in line]
    operand = "f32" if dtype == jnp.float32 else "bf16"
    assert len(dots) == 2 and all(f"x{operand}> * tensor<" in d for d in dots), dots
    assert not any("tf32" in d for d in dots), dots
    loads = [line for line in ir if "tt.load " in line]
    # K and V blocks [pages, B, D], and the int8 pool's scales [pages, B]
    assert sum("x16x128x!tt.ptr<i8>>" in line for line in loads) == (2 if quantized else 0)
    assert sum("x16x!tt.ptr<f32>>" in line for line in loads) == (2 if quantized else 0)
