"""The TPU (Mosaic) ragged_paged_attention: references against hand values and float64 numpy,
then the entry point and each of its two paths against the float64 oracle and the jnp reference
(Pallas interpret mode on a CPU, compiled where the default backend is a TPU), int8 pages with
per-token scales, extreme logits, validation, jit, and lowering to Mosaic for "tpu" with no host
callback.

Cases and tolerances: tests/attention_cases.py.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import (EXTREME_TOL, F64_TOL, RAGGED_SHAPES, TOL, assert_close, call,
                             dense_f64, extreme_case, make_case, mixed_rows, page_major,
                             quantize_case, ragged_case)
from pallas_kernels.reference import (ref_paged_decode_attention, ref_ragged_paged_attention,
                                      ref_ragged_paged_attention_f64)
from pallas_kernels.tpu import TpuBlockSizes, ragged_paged_attention, validate_inputs
from pallas_kernels.tpu import scale_rows
from pallas_kernels.tpu.attention import uses_decode_path
from pallas_kernels.tpu.decode_attention import decode_attention
from pallas_kernels.tpu.prefill_attention import prefill_attention

interpret = jax.default_backend() != "tpu"


def attend(case, sm_scale, **kw):
    return call(ragged_paged_attention, case, sm_scale=sm_scale, interpret=interpret, **kw)


def decode_path(case, sm_scale, *, pages_per_block=4, interpret=interpret):
    return call(decode_attention, case, sm_scale=sm_scale, pages_per_block=pages_per_block,
                interpret=interpret)


def prefill_path(case, sm_scale, *, block_q=8, pages_per_block=4, interpret=interpret):
    return call(prefill_attention, case, sm_scale=sm_scale, block_q=block_q,
                pages_per_block=pages_per_block, interpret=interpret)


def _decode_args(case):
    return case["q"], case["k_pages"], case["v_pages"], case["page_tables"], case["seq_lens"]


def decode_case(seed, seq_lens, **shape):
    """A pure decode batch: one token per row with seq_len > 0, none for seq_len 0 rows, and as
    many tokens as rows (T == S, so the entry point takes the decode path); a seq_len 0 row in
    the middle shifts the later rows' tokens down (ragged semantics)."""
    rows = [(n, 1 if n else 0) for n in seq_lens]
    case = ragged_case(seed, rows, **shape)
    case["q"] = case["q"][:len(rows)]
    return case


def _check(out, case, scale, dtype=jnp.float32):
    assert out.shape == case["q"].shape and out.dtype == dtype
    assert_close(out, call(ref_ragged_paged_attention, case, sm_scale=scale), TOL[dtype])
    if dtype == jnp.float32:
        assert_close(out, dense_f64(case, scale), F64_TOL)


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
    out = ref_paged_decode_attention(*_decode_args(case), sm_scale=0.3)
    assert_close(out, dense_f64(case, 0.3), F64_TOL)


@pytest.mark.parametrize("group", [1, 3])
def test_reference_prefill_matches_float64(group):
    # Chunked prefill and prefix hits: q_len < seq_len attends to earlier pages; one empty sequence.
    case = make_case(1, seq_lens=[5, 20, 9, 17, 4], q_lens=[5, 3, 0, 17, 1], page_size=8,
                     num_kv_heads=2, group=group, head_dim=16)
    out = call(ref_ragged_paged_attention, case, sm_scale=0.3)
    assert_close(out, dense_f64(case, 0.3), F64_TOL)


@pytest.mark.parametrize("page_size,head_dim,num_kv_heads,group,dtype", RAGGED_SHAPES)
def test_reference_matches_float64_on_mixed_rows(page_size, head_dim, num_kv_heads, group, dtype):
    case = ragged_case(9, mixed_rows(page_size), page_size=page_size, num_kv_heads=num_kv_heads,
                       group=group, head_dim=head_dim)
    scale = 1 / math.sqrt(head_dim)
    assert_close(call(ref_ragged_paged_attention, case, sm_scale=scale), dense_f64(case, scale),
                 F64_TOL)


# ---------------------------------------------------------------------------------------------
# Oracle 2: the entry point and its paths against the float64 oracle and the jnp reference.


@pytest.mark.parametrize("page_size,head_dim,num_kv_heads,group,dtype", RAGGED_SHAPES)
def test_matches_float64_and_reference_on_mixed_rows(page_size, head_dim, num_kv_heads, group,
                                                     dtype):
    """Decode rows at 1, B-1, B, B+1 and long lengths, whole prompts, chunks after a prefix and
    empty rows, in mixed order, over shuffled pages with NaN in page 0, unused pages and tails."""
    case = ragged_case(10, mixed_rows(page_size, long=5 * page_size + 3), page_size=page_size,
                       num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype)
    assert not uses_decode_path(case["q"].shape[0], case["page_tables"].shape[0])
    scale = 1 / math.sqrt(head_dim)
    out = attend(case, scale, block_sizes=TpuBlockSizes(block_q=16, pages_per_block=2))
    _check(out, case, scale, dtype)
    np.testing.assert_array_equal(np.asarray(out[-3:], np.float32), 0)  # padding tokens


@pytest.mark.parametrize("page_size,head_dim,num_kv_heads,group,dtype",
                         [RAGGED_SHAPES[0], RAGGED_SHAPES[1], RAGGED_SHAPES[5]])
def test_decode_path_is_exact_on_mixed_rows(page_size, head_dim, num_kv_heads, group, dtype):
    """The token-at-a-time kernel is exact for any input, multi-token rows included."""
    case = ragged_case(11, mixed_rows(page_size, long=3 * page_size + 1)[:8], page_size=page_size,
                       num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype)
    scale = 1 / math.sqrt(head_dim)
    _check(decode_path(case, scale, pages_per_block=2), case, scale, dtype)


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("head_dim,num_kv_heads,group,dtype,window,soft_cap", [
    (64, 3, 3, jnp.float32, None, None), (128, 2, 2, jnp.bfloat16, 20, 30.0)])
def test_page_major_pool_equals_head_major(path, head_dim, num_kv_heads, group, dtype, window,
                                           soft_cap):
    """Both paths over the flat page-major pool f[N, B, 2 * Hkv * D] (kv_cache.PagedKV, v_pages
    None: one DMA per page and head moves its K and V lanes) give the head-major pool's outputs
    and match the float64 oracle (NaN garbage in unused slots included)."""
    rows = mixed_rows(16, long=40)
    if path == "decode":  # T == S: one token per row
        rows = [(n, 1 if n else 0) for n, _ in rows]
    case = ragged_case(12, rows, page_size=16, num_kv_heads=num_kv_heads, group=group,
                       head_dim=head_dim, dtype=dtype)
    case["q"] = case["q"][:len(rows)] if path == "decode" else case["q"]
    assert uses_decode_path(*case["q"].shape[:1], len(rows)) == (path == "decode")
    scale, opts = head_dim ** -0.5, dict(window=window, soft_cap=soft_cap)
    out = ragged_paged_attention(case["q"], page_major(case, flat=True), None,
                                 case["page_tables"], case["seq_lens"], case["query_start"],
                                 sm_scale=scale, interpret=interpret, **opts)
    assert_close(out, attend(case, scale, **opts), dict(atol=1e-6, rtol=1e-6))
    n = int(case["query_start"][-1])
    expected = ref_ragged_paged_attention_f64(case["q"], case["k_pages"], case["v_pages"],
                                              case["page_tables"], case["seq_lens"],
                                              case["query_start"], sm_scale=scale, **opts)
    assert_close(out[:n], expected[:n], TOL[dtype])


@pytest.mark.parametrize("pages_per_block", [1, 2, 3, 8])
def test_pure_decode_batch_over_key_block_counts(pages_per_block):
    """T == S takes the decode path. The longest row (69 tokens, 9 pages of 8) spans 9, 5, 3 and
    2 key blocks; the others 1 or 2: the pipeline's prologue, slot swap and tail all run."""
    case = decode_case(12, [9, 1, 69, 7, 8, 17, 33, 0, 0], page_size=8, num_kv_heads=2, group=4,
                       head_dim=64)
    assert uses_decode_path(case["q"].shape[0], case["page_tables"].shape[0])
    sizes = TpuBlockSizes(pages_per_block=pages_per_block)
    out = attend(case, 0.125, block_sizes=sizes)
    _check(out, case, 0.125)
    # Padding rows last: token i is row i, as in the decode reference.
    ref = ref_paged_decode_attention(*_decode_args(case), sm_scale=0.125)
    assert_close(out, ref, TOL[jnp.float32])
    np.testing.assert_array_equal(np.asarray(out[7:]), 0)


@pytest.mark.parametrize("block_q,pages_per_block", [(8, 1), (8, 2), (16, 3), (32, 8)])
def test_prefill_path_over_block_sizes(block_q, pages_per_block):
    """A 45-token prompt, a 20-token chunk after a 30-token prefix, decode rows, in mixed order:
    1, 2 and several key blocks per row, query blocks inside one row and across rows."""
    case = ragged_case(13, [(9, 1), (45, 45), (0, 0), (50, 20), (3, 3), (26, 1)], page_size=8,
                       num_kv_heads=1, group=3, head_dim=64)
    out = attend(case, 0.125, block_sizes=TpuBlockSizes(block_q=block_q,
                                                        pages_per_block=pages_per_block))
    _check(out, case, 0.125)


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_chunked_prefill_equals_whole_prompt(path):
    """The same 21-token prompt at once, and as chunks 13 + 8 (the second reads the first
    chunk's pages): identical rows, on both paths."""
    case = make_case(5, seq_lens=[21], q_lens=[21], page_size=8, num_kv_heads=1, group=3,
                     head_dim=64)
    run = decode_path if path == "decode" else prefill_path
    whole = run(case, 0.125, pages_per_block=1)
    assert_close(whole, dense_f64(case, 0.125), F64_TOL)
    chunk = dict(case, q=case["q"][13:21], query_start=jnp.array([0, 8], jnp.int32))
    second = run(chunk, 0.125, pages_per_block=1)
    np.testing.assert_allclose(np.asarray(second), np.asarray(whole[13:21]), atol=2e-6, rtol=2e-6)


def test_runs_under_jit():
    case = make_case(4, seq_lens=[9, 17, 2], q_lens=[9, 4, 1], page_size=8, num_kv_heads=2,
                     group=3, head_dim=64, table_width=5)
    fn = jax.jit(lambda c: attend(c, 0.125))
    assert_close(fn(case), dense_f64(case, 0.125), F64_TOL)
    decode = dict(case, q=case["q"][:3], query_start=jnp.arange(4, dtype=jnp.int32))
    assert_close(fn(decode), dense_f64(decode, 0.125), F64_TOL)


@pytest.mark.parametrize("pool", ["float", "int8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_paths_lower_to_mosaic(path, dtype, pool):
    """Pallas -> Mosaic lowering for platform "tpu" runs without a TPU (jax.export): it catches
    ops with no Mosaic rule and illegal block shapes, and shows no host callback is left. Mosaic
    compilation (layouts, shape casts, VMEM limits): tests/test_tpu_compile.py (libtpu)."""
    case = ragged_case(8, [(5, 5), (40, 8), (0, 0), (17, 1)], page_size=16, num_kv_heads=2,
                       group=4, head_dim=128, dtype=dtype)
    if pool == "int8":
        case = quantize_case(case)
    run = decode_path if path == "decode" else prefill_path
    fn = jax.jit(lambda c: run(c, 0.1, pages_per_block=2, interpret=False))
    text = jax.export.export(fn, platforms=["tpu"])(case).mlir_module()
    assert "tpu_custom_call" in text
    assert "callback" not in text


# ---------------------------------------------------------------------------------------------
# int8 pages with per-token, per-head float32 scales (NaN scales and int8 garbage in unused slots).


@pytest.mark.parametrize("path,page_size,group,dtype", [
    ("decode", 16, 4, jnp.float32),
    ("prefill", 8, 3, jnp.float32),
    ("prefill", 16, 2, jnp.bfloat16),
])
def test_int8_pages_match_float64(path, page_size, group, dtype):
    """Through the entry point: a pure decode batch (T == S) or mixed rows (the ragged path),
    against the float64 oracle on the same int8 pages and scales."""
    if path == "decode":
        case = decode_case(14, [9, 1, 2 * page_size + 3, 0, page_size, 40], page_size=page_size,
                           num_kv_heads=2, group=group, head_dim=64, dtype=dtype)
    else:
        case = ragged_case(15, mixed_rows(page_size, long=3 * page_size + 1), page_size=page_size,
                           num_kv_heads=2, group=group, head_dim=64, dtype=dtype)
    case = quantize_case(case)
    assert case["k_pages"].dtype == jnp.int8 and np.isnan(np.asarray(case["k_scale"])).any()
    assert uses_decode_path(case["q"].shape[0], case["page_tables"].shape[0]) == (path == "decode")
    sizes = TpuBlockSizes(block_q=16, pages_per_block=2)
    out = attend(case, 0.125, block_sizes=sizes)
    assert out.shape == case["q"].shape and out.dtype == dtype
    assert_close(out, dense_f64(case, 0.125), TOL[dtype])
    if path == "prefill":
        np.testing.assert_array_equal(np.asarray(out[-3:], np.float32), 0)  # padding tokens


@pytest.mark.parametrize("path,page_size,head_dim,num_kv_heads", [
    ("decode", 16, 64, 3), ("prefill", 8, 128, 2), ("prefill", 16, 64, 1)])
def test_int8_page_major_pool_equals_head_major(path, page_size, head_dim, num_kv_heads):
    """int8 pages in the flat page-major pool with their scales as lane-dense rows per page
    (kv_scales f32[N, L], scale_rows.pack; NaN scales in garbage slots) give exactly the
    head-major pool's outputs, and the float64 oracle's."""
    rows = mixed_rows(page_size, long=3 * page_size + 1)
    if path == "decode":
        rows = [(n, 1 if n else 0) for n, _ in rows]
    case = quantize_case(ragged_case(17, rows, page_size=page_size, num_kv_heads=num_kv_heads,
                                     group=2, head_dim=head_dim))
    case["q"] = case["q"][:len(rows)] if path == "decode" else case["q"]
    assert uses_decode_path(case["q"].shape[0], len(rows)) == (path == "decode")
    sizes = TpuBlockSizes(block_q=16, pages_per_block=2)
    out = ragged_paged_attention(
        case["q"], page_major(case, flat=True), None, case["page_tables"], case["seq_lens"],
        case["query_start"], sm_scale=0.125, interpret=interpret, block_sizes=sizes,
        kv_scales=scale_rows.pack(case["k_scale"], case["v_scale"]))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(attend(case, 0.125,
                                                                     block_sizes=sizes)))
    assert_close(out, dense_f64(case, 0.125), TOL[jnp.float32])


def test_scale_rows_write_matches_pack():
    """scale_rows.write (the step's write: whole rows, tokens of one page merged) gives what
    packing head-major scales written slot by slot gives, NaN scales and page sizes whose 2B is
    not a power of two included."""
    rng = np.random.default_rng(3)
    for page_size, heads in ((16, 3), (12, 2), (128, 1)):
        n = 6
        k, v = (rng.standard_normal((heads, n, page_size)).astype(np.float32) for _ in "kv")
        slots = rng.choice(n * page_size, 11, replace=False)
        nk, nv = (rng.standard_normal((11, heads)).astype(np.float32) for _ in "kv")
        nk[3, 0] = np.nan
        rows = scale_rows.write(scale_rows.pack(jnp.asarray(k), jnp.asarray(v)),
                                jnp.asarray(slots // page_size), jnp.asarray(slots % page_size),
                                jnp.asarray(nk), jnp.asarray(nv), page_size)
        k[:, slots // page_size, slots % page_size] = nk.T
        v[:, slots // page_size, slots % page_size] = nv.T
        np.testing.assert_array_equal(np.asarray(rows),
                                      np.asarray(scale_rows.pack(jnp.asarray(k), jnp.asarray(v))))


def test_int8_flat_pool_holds_what_the_head_major_pool_holds():
    """The engine's write (kv_cache.write_kv) into the TPU backend's int8 pool (flat pages and
    scale rows) stores the head-major pool's pages and scales, over two steps with several
    tokens on one page."""
    from jaxserve import backends
    from jaxserve.model.kv_cache import KVLayout, write_kv

    heads, head_dim, pages, page_size = 3, 64, 6, 16
    layout = backends.pool_layout(backends.get("pallas-tpu-interpret"), heads, head_dim,
                                  jnp.int8, num_q_heads=6, q_dtype=jnp.float32)
    assert layout.page_major and layout.flat
    flat = layout.zeros(pages, page_size, head_dim, jnp.int8)
    head = KVLayout(heads).zeros(pages, page_size, head_dim, jnp.int8)
    rng = np.random.default_rng(5)
    for slots in ([16, 17, 18, 40, 33], [19, 41, 80]):
        k, v = (jnp.asarray(rng.standard_normal((len(slots), heads, head_dim)), jnp.float32)
                for _ in "kv")
        slots = jnp.asarray(slots, jnp.int32)
        flat, head = write_kv(flat, k, v, slots), write_kv(head, k, v, slots)
    expected = page_major(dict(k_pages=head.k, v_pages=head.v), flat=True)
    np.testing.assert_array_equal(np.asarray(flat.kv), np.asarray(expected))
    np.testing.assert_array_equal(np.asarray(flat.scales),
                                  np.asarray(scale_rows.pack(head.k_scale, head.v_scale)))


def test_int8_decode_path_on_multi_token_rows():
    """The token-at-a-time kernel reads int8 pages for prefill chunks too."""
    case = quantize_case(ragged_case(16, [(20, 20), (0, 0), (13, 4), (9, 1)], page_size=8,
                                     num_kv_heads=1, group=2, head_dim=64))
    assert_close(decode_path(case, 0.125, pages_per_block=2), dense_f64(case, 0.125),
                 TOL[jnp.float32])


# ---------------------------------------------------------------------------------------------
# Extreme logits: scores near +-1e4, where a naive exp overflows float32.


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_extreme_logits(path):
    case = extreme_case()
    expected = dense_f64(case, 1.0)
    q, k = np.asarray(case["q"]), np.asarray(case["k_pages"])
    score = q[0, 0] @ k[0, int(case["page_tables"][0, 0]), 0]
    assert 9e3 < abs(score) < 1.1e4
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(np.float32(abs(score))))  # a naive softmax overflows
    run = decode_path if path == "decode" else prefill_path
    out = run(case, 1.0, pages_per_block=1)
    ref = call(ref_ragged_paged_attention, case, sm_scale=1.0)
    assert_close(out, ref, TOL[jnp.float32])  # every row, the 3 padding rows (zeros) included
    assert_close(out, expected, EXTREME_TOL)
    assert_close(ref, expected, EXTREME_TOL)
    # The dominating key: the row's output is exactly that key's value.
    v = np.asarray(case["v_pages"])[0, int(case["page_tables"][1, 0]), 2]
    np.testing.assert_allclose(np.asarray(out)[16, 0], v, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Validation: clear errors for bad shapes, dtypes and (when concrete) page-table values.


def _small():
    return make_case(7, seq_lens=[5, 9], q_lens=[5, 2], page_size=8, num_kv_heads=2, group=2,
                     head_dim=16)


@pytest.mark.parametrize("change,message", [
    (lambda c: c.update(q=c["q"][:, :3]), "multiple of KV heads"),
    (lambda c: c.update(q=c["q"][..., :8]), "head dim"),
    (lambda c: c.update(v_pages=c["v_pages"][:, :3]), "shapes differ"),
    (lambda c: c.update(v_pages=c["v_pages"].astype(jnp.bfloat16)), "one floating or int8"),
    (lambda c: c.update(page_tables=c["page_tables"].astype(jnp.float32)), "page_tables"),
    (lambda c: c.update(seq_lens=c["seq_lens"][:1]), "seq_lens must be i32"),
    (lambda c: c.update(page_tables=c["page_tables"].at[1, 1].set(999)), "outside the pool"),
    (lambda c: c.update(page_tables=c["page_tables"].at[0, 0].set(-1)), "outside the pool"),
    (lambda c: c.update(seq_lens=jnp.array([5, 17], jnp.int32)), r"outside \[0, P\*B"),
    (lambda c: c.update(query_start=jnp.array([0, 5], jnp.int32)), "query_start must be i32"),
    (lambda c: c.update(query_start=jnp.array([0, 6, 5], jnp.int32)), "non-decreasing"),
    (lambda c: c.update(query_start=jnp.array([0, 7, 9], jnp.int32)), "seq_lens must include"),
    (lambda c: c.update(query_start=jnp.array([0, 5, 99], jnp.int32)), "exceeds the T"),
])
def test_validation_errors(change, message):
    case = _small()
    validate_inputs(**case)  # valid as built
    change(case)
    with pytest.raises(ValueError, match=message):
        validate_inputs(**case)
    with pytest.raises(ValueError, match=message):
        attend(case, 1.0)


@pytest.mark.parametrize("change,message", [
    (lambda c: [c.pop("k_scale"), c.pop("v_scale")], "int8 pages need k_scale and v_scale"),
    (lambda c: c.pop("v_scale"), "go together"),
    (lambda c: c.update(k_scale=c["k_scale"][:, :, :4]), "k_scale must be f32"),
    (lambda c: c.update(k_pages=c["k_pages"].astype(jnp.float32),
                        v_pages=c["v_pages"].astype(jnp.float32)), "only int8 pages take them"),
])
def test_int8_validation_errors(change, message):
    case = quantize_case(_small())
    validate_inputs(**case)  # valid as built
    change(case)
    with pytest.raises(ValueError, match=message):
        attend(case, 1.0)


def test_unused_table_entries_need_not_be_page_ids():
    case = _small()  # row 0 holds 5 tokens in one page: entry 1 is never read
    validate_inputs(**dict(case, page_tables=case["page_tables"].at[0, 1].set(-1)))


@pytest.mark.parametrize("make", [
    lambda: TpuBlockSizes(pages_per_block=0),
    lambda: TpuBlockSizes(block_q=0),
    lambda: TpuBlockSizes(pages_per_block=2.0),
    lambda: TpuBlockSizes(block_q=True),
    lambda: TpuBlockSizes(4),  # keyword-only
])
def test_block_sizes_rejected(make):
    with pytest.raises((ValueError, TypeError)):
        make()
