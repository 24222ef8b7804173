"""Paged attention kernels: references against hand values and float64 numpy, kernels against
references (Pallas interpret mode on CPU), extreme logits, NaN isolation, validation.

Cases and tolerances: tests/attention_cases.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import (EXTREME_TOL, F64_TOL, RAGGED_SHAPES, TOL, assert_close, call,
                             dense_f64, extreme_case, make_case, mixed_rows, ragged_case)
from pallas_kernels.reference import ref_paged_decode_attention, ref_ragged_paged_attention
from pallas_kernels.tpu import DecodeBlockSizes, PrefillBlockSizes, ragged_paged_attention
from pallas_kernels.tpu.decode_attention import paged_decode_attention, validate_decode_inputs
from pallas_kernels.tpu.prefill_attention import (ragged_prefill_attention,
                                                  validate_prefill_inputs)

interpret = jax.default_backend() != "tpu"


def _decode(case, fn=paged_decode_attention, **kw):
    if fn is paged_decode_attention:
        kw.setdefault("interpret", interpret)
    return fn(case["q"], case["k_pages"], case["v_pages"], case["page_tables"], case["seq_lens"],
              **kw)


def _prefill(case, fn=ragged_prefill_attention, **kw):
    if fn is ragged_prefill_attention:
        kw.setdefault("interpret", interpret)
    return fn(case["q"], case["k_pages"], case["v_pages"], case["page_tables"], case["seq_lens"],
              case["query_start"], **kw)


# ---------------------------------------------------------------------------------------------
# Oracle 1: references against hand-computed values and float64 numpy.


def test_reference_decode_hand_values():
    # One KV head, one query head, D = 2, B = 2. Keys (1,0), (0,1), (2,0); scores with scale 1:
    # 1, 0, 2. Values (1,0), (0,1), (0,0) -> out = (e, 1) / (e + 1 + e^2).
    k = np.full((1, 3, 2, 2), np.nan, np.float32)  # [Hkv, N, B, D]
    v = np.full((1, 3, 2, 2), np.nan, np.float32)
    k[0, 2], v[0, 2] = [[1, 0], [0, 1]], [[1, 0], [0, 1]]  # positions 0, 1 on page 2
    k[0, 1, 0], v[0, 1, 0] = [2, 0], [0, 0]  # position 2 on page 1; slot 1 stays NaN
    q = np.array([[[1, 0]], [[5, 5]], [[0, 0]]], np.float32)
    table = np.array([[2, 1], [2, 0], [0, 0]], np.int32)
    seq_lens = np.array([3, 1, 0], np.int32)
    out = np.asarray(ref_paged_decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                                jnp.asarray(table), jnp.asarray(seq_lens),
                                                sm_scale=1.0))
    z = math.e + 1 + math.e ** 2
    np.testing.assert_allclose(out[0, 0], [math.e / z, 1 / z], rtol=1e-6)
    np.testing.assert_array_equal(out[1, 0], [1, 0])  # a single key: its value exactly
    np.testing.assert_array_equal(out[2, 0], [0, 0])  # padding row


def test_reference_prefill_hand_values():
    # Sequence of 2 tokens, both queries in this step, q = k = (1,0) and (0,1), scale 1.
    # Row 0 sees key 0 only -> v0. Row 1 sees scores (0, 1) -> (v0 + e v1) / (1 + e).
    k = np.full((1, 2, 4, 2), np.nan, np.float32)  # [Hkv, N, B, D]
    v = np.full((1, 2, 4, 2), np.nan, np.float32)
    k[0, 1, :2] = [[1, 0], [0, 1]]
    v[0, 1, :2] = [[3, 0], [0, 3]]
    q = np.array([[[1, 0]], [[0, 1]], [[7, 7]]], np.float32)  # row 2 is padding
    out = np.asarray(ref_ragged_paged_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.array([[1]], jnp.int32),
        jnp.array([2], jnp.int32), jnp.array([0, 2], jnp.int32), sm_scale=1.0))
    np.testing.assert_array_equal(out[0, 0], [3, 0])
    np.testing.assert_allclose(out[1, 0], [3 / (1 + math.e), 3 * math.e / (1 + math.e)], rtol=1e-6)
    np.testing.assert_array_equal(out[2, 0], [0, 0])


@pytest.mark.parametrize("group", [1, 3])
def test_reference_decode_matches_float64(group):
    case = make_case(0, seq_lens=[1, 7, 8, 9, 30, 0], page_size=8, num_kv_heads=2, group=group,
                     head_dim=16)
    out = _decode(case, ref_paged_decode_attention, sm_scale=0.3)
    assert_close(out, dense_f64(case, 0.3), F64_TOL)


@pytest.mark.parametrize("group", [1, 3])
def test_reference_prefill_matches_float64(group):
    # Chunked prefill and prefix hits: q_len < seq_len attends to earlier pages; one empty sequence.
    case = make_case(1, seq_lens=[5, 20, 9, 17, 4], q_lens=[5, 3, 0, 17, 1], page_size=8,
                     num_kv_heads=2, group=group, head_dim=16)
    out = _prefill(case, ref_ragged_paged_attention, sm_scale=0.3)
    assert_close(out, dense_f64(case, 0.3), F64_TOL)


@pytest.mark.parametrize("page_size,head_dim,num_kv_heads,group,dtype", RAGGED_SHAPES)
def test_reference_matches_float64_on_mixed_rows(page_size, head_dim, num_kv_heads, group, dtype):
    case = ragged_case(9, mixed_rows(page_size), page_size=page_size, num_kv_heads=num_kv_heads,
                       group=group, head_dim=head_dim)
    scale = 1 / math.sqrt(head_dim)
    assert_close(call(ref_ragged_paged_attention, case, sm_scale=scale), dense_f64(case, scale),
                 F64_TOL)


# ---------------------------------------------------------------------------------------------
# Oracle 2: kernels (interpret mode) against the references.

# (page_size, head_dim, num_kv_heads, group, block size, dtype): page sizes 8/16/32, head dims
# 64/128, GQA 1/3/8, several block sizes, f32 and bf16, without a full cross product.
DECODE_CASES = [
    (8, 64, 2, 1, 1, jnp.float32),
    (8, 64, 1, 8, 3, jnp.float32),
    (16, 128, 2, 3, 2, jnp.float32),
    (32, 64, 3, 3, 1, jnp.float32),
    (16, 64, 2, 3, 4, jnp.bfloat16),
    (32, 128, 1, 8, 2, jnp.bfloat16),
]


@pytest.mark.parametrize("page_size,head_dim,num_kv_heads,group,pages_per_block,dtype",
                         DECODE_CASES)
def test_decode_kernel_matches_reference(page_size, head_dim, num_kv_heads, group,
                                         pages_per_block, dtype):
    b = page_size
    case = make_case(2, seq_lens=[1, b - 1, b, b + 1, 3 * b + 5, 0], page_size=b,
                     num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    out = _decode(case, sm_scale=scale,
                  block_sizes=DecodeBlockSizes(pages_per_block=pages_per_block))
    assert out.shape == case["q"].shape and out.dtype == dtype
    assert_close(out, _decode(case, ref_paged_decode_attention, sm_scale=scale), TOL[dtype])
    np.testing.assert_array_equal(np.asarray(out[-1], np.float32), 0)  # padding row


PREFILL_CASES = [  # (page_size, head_dim, num_kv_heads, group, block_q, block_kv_pages, dtype)
    (8, 64, 2, 1, 8, 1, jnp.float32),
    (8, 64, 1, 8, 16, 3, jnp.float32),
    (16, 128, 2, 3, 8, 2, jnp.float32),
    (32, 64, 3, 3, 32, 1, jnp.float32),
    (16, 64, 2, 3, 16, 2, jnp.bfloat16),
    (32, 128, 1, 8, 8, 4, jnp.bfloat16),
]


@pytest.mark.parametrize(
    "page_size,head_dim,num_kv_heads,group,block_q,block_kv_pages,dtype", PREFILL_CASES)
def test_prefill_kernel_matches_reference(page_size, head_dim, num_kv_heads, group, block_q,
                                          block_kv_pages, dtype):
    b = page_size
    # Lengths 1, B-1, B, B+1 and a long one; full prompts, a chunk after a prefix, an empty one.
    seq_lens = [1, b - 1, b, b + 1, 3 * b + 5, 2 * b + 3]
    q_lens = [1, b - 1, 3, b + 1, b + 2, 0]
    case = make_case(3, seq_lens=seq_lens, q_lens=q_lens, page_size=b, num_kv_heads=num_kv_heads,
                     group=group, head_dim=head_dim, dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    out = _prefill(case, sm_scale=scale,
                   block_sizes=PrefillBlockSizes(block_q=block_q, block_kv_pages=block_kv_pages))
    assert out.shape == case["q"].shape and out.dtype == dtype
    assert_close(out, _prefill(case, ref_ragged_paged_attention, sm_scale=scale), TOL[dtype])
    np.testing.assert_array_equal(np.asarray(out[-3:], np.float32), 0)  # padding rows


@pytest.mark.parametrize("page_size,head_dim,num_kv_heads,group,dtype", RAGGED_SHAPES)
def test_entry_point_matches_float64_on_mixed_rows(page_size, head_dim, num_kv_heads, group,
                                                   dtype):
    case = ragged_case(9, mixed_rows(page_size, long=70), page_size=page_size,
                       num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    out = call(ragged_paged_attention, case, sm_scale=scale, interpret=interpret)
    assert out.shape == case["q"].shape and out.dtype == dtype
    assert_close(out, call(ref_ragged_paged_attention, case, sm_scale=scale), TOL[dtype])


def test_kernels_match_float64_and_run_under_jit():
    case = make_case(4, seq_lens=[9, 17, 2], q_lens=[9, 4, 1], page_size=8, num_kv_heads=2,
                     group=3, head_dim=64, table_width=5)
    prefill = jax.jit(lambda c: _prefill(c, sm_scale=0.125))
    assert_close(prefill(case), dense_f64(case, 0.125), F64_TOL)
    decode_case = {k: v for k, v in case.items() if k != "query_start"}
    decode_case["q"] = case["q"][:3]
    decode = jax.jit(lambda c: _decode(c, sm_scale=0.125))
    assert_close(decode(decode_case), dense_f64(decode_case, 0.125), F64_TOL)


def test_chunked_prefill_equals_whole_prompt():
    # The same 21-token prompt prefilled at once, and as chunks 13 + 8 (the second chunk reads
    # the first chunk's pages): identical attention rows.
    case = make_case(5, seq_lens=[21], q_lens=[21], page_size=8, num_kv_heads=1, group=3,
                     head_dim=64)
    whole = _prefill(case, sm_scale=0.125, block_sizes=PrefillBlockSizes(block_q=8,
                                                                         block_kv_pages=1))
    chunk = dict(case, q=case["q"][13:21], seq_lens=jnp.array([21], jnp.int32),
                 query_start=jnp.array([0, 8], jnp.int32))
    second = _prefill(chunk, sm_scale=0.125, block_sizes=PrefillBlockSizes(block_q=8,
                                                                           block_kv_pages=1))
    np.testing.assert_allclose(np.asarray(second), np.asarray(whole[13:21]), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_to_mosaic(dtype):
    # Pallas -> Mosaic lowering for platform "tpu" runs without a TPU (jax.export); this catches
    # ops with no Mosaic rule and illegal block shapes. Mosaic compilation itself needs a TPU.
    case = make_case(8, seq_lens=[5, 40], q_lens=[5, 8], page_size=16, num_kv_heads=2, group=4,
                     head_dim=128, dtype=dtype)
    decode_case = dict(case, q=case["q"][:2])
    del decode_case["query_start"]
    for fn, args in [(lambda c: _prefill(c, sm_scale=0.1, interpret=False), case),
                     (lambda c: _decode(c, sm_scale=0.1, interpret=False), decode_case)]:
        exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(args)
        assert "tpu_custom_call" in exported.mlir_module()


# ---------------------------------------------------------------------------------------------
# Extreme logits: scores near +-1e4, where a naive exp overflows float32.


@pytest.mark.parametrize("block_q,block_kv_pages,pages_per_block", [(8, 1, 1), (16, 2, 2)])
def test_extreme_logits_prefill_and_decode(block_q, block_kv_pages, pages_per_block):
    case = extreme_case()
    expected = dense_f64(case, 1.0)
    q, k = np.asarray(case["q"]), np.asarray(case["k_pages"])
    score = q[0, 0] @ k[0, int(case["page_tables"][0, 0]), 0]
    assert 9e3 < abs(score) < 1.1e4
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(np.float32(abs(score))))  # a naive softmax overflows
    out = _prefill(case, sm_scale=1.0, block_sizes=PrefillBlockSizes(block_q=block_q,
                                                                     block_kv_pages=block_kv_pages))
    ref = _prefill(case, ref_ragged_paged_attention, sm_scale=1.0)
    assert_close(out, ref, TOL[jnp.float32])  # every row, the 3 padding rows (zeros) included
    assert_close(out, expected, EXTREME_TOL)
    assert_close(ref, expected, EXTREME_TOL)
    # The dominating key: the row's output is exactly that key's value.
    v = np.asarray(case["v_pages"])[0, int(case["page_tables"][1, 0]), 2]
    np.testing.assert_allclose(np.asarray(out)[16, 0], v, atol=1e-6)
    decode = dict(case, q=case["q"][jnp.array([11, 16])])
    del decode["query_start"]
    out = _decode(decode, sm_scale=1.0,
                  block_sizes=DecodeBlockSizes(pages_per_block=pages_per_block))
    ref = _decode(decode, ref_paged_decode_attention, sm_scale=1.0)
    assert_close(out, ref, TOL[jnp.float32])
    assert_close(out, dense_f64(decode, 1.0), EXTREME_TOL)
    assert_close(ref, dense_f64(decode, 1.0), EXTREME_TOL)
    np.testing.assert_allclose(np.asarray(out)[1, 0], v, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Validation: clear errors for bad shapes, dtypes and (when concrete) page-table values.


def _small():
    return make_case(7, seq_lens=[5, 9], q_lens=[5, 2], page_size=8, num_kv_heads=2, group=2,
                     head_dim=16)


@pytest.mark.parametrize("change,message", [
    (lambda c: c.update(q=c["q"][:, :3]), "multiple of KV heads"),
    (lambda c: c.update(q=c["q"][..., :8]), "head dim"),
    (lambda c: c.update(v_pages=c["v_pages"][:, :3]), "shapes differ"),
    (lambda c: c.update(v_pages=c["v_pages"].astype(jnp.bfloat16)), "one floating dtype"),
    (lambda c: c.update(page_tables=c["page_tables"].astype(jnp.float32)), "page_tables"),
    (lambda c: c.update(seq_lens=c["seq_lens"][:1]), "seq_lens must be i32"),
    (lambda c: c.update(page_tables=c["page_tables"].at[1, 1].set(999)), "outside the pool"),
    (lambda c: c.update(seq_lens=jnp.array([5, 17], jnp.int32)), r"outside \[0, P\*B"),
    (lambda c: c.update(query_start=jnp.array([0, 5], jnp.int32)), "query_start must be i32"),
    (lambda c: c.update(query_start=jnp.array([0, 6, 5], jnp.int32)), "non-decreasing"),
    (lambda c: c.update(query_start=jnp.array([0, 7, 9], jnp.int32)), "seq_lens must include"),
    (lambda c: c.update(query_start=jnp.array([0, 5, 99], jnp.int32)), "exceeds the T"),
])
def test_prefill_validation_errors(change, message):
    case = _small()
    change(case)
    with pytest.raises(ValueError, match=message):
        _prefill(case, validate_prefill_inputs)


def test_decode_validation_errors():
    case = _small()
    del case["query_start"]
    case["q"] = case["q"][:2]
    validate_decode_inputs(**case)  # valid as built
    with pytest.raises(ValueError, match="rows but page_tables"):
        _decode(dict(case, q=case["q"][:1]), sm_scale=1.0)
    with pytest.raises(ValueError, match="outside the pool"):
        _decode(dict(case, page_tables=case["page_tables"].at[0, 0].set(-1)), sm_scale=1.0)
    # Entries past a sequence's length are never read, so they need not be valid page ids.
    validate_decode_inputs(**dict(case, page_tables=case["page_tables"].at[0, 1].set(-1)))


@pytest.mark.parametrize("make", [
    lambda: DecodeBlockSizes(pages_per_block=0),
    lambda: PrefillBlockSizes(block_q=0),
    lambda: PrefillBlockSizes(block_kv_pages=2.0),
    lambda: DecodeBlockSizes(4),  # keyword-only
])
def test_block_sizes_rejected(make):
    with pytest.raises((ValueError, TypeError)):
        make()
