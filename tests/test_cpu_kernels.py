"""The C++ CPU kernels against pure-jnp references: paged attention (decode rows, ragged causal
prefill, GQA groups, padding tokens, odd head dims) and the int8 small-batch matmul."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.quantize import quantize_weight
from pallas_kernels import cpu_kernels, ref_paged_decode_attention, ref_ragged_prefill_attention

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"kernel not built: {cpu_kernels.unavailable_reason()}")


def _pool(rng, hkv, n, b, d):
    return (jnp.asarray(rng.standard_normal((hkv, n, b, d)), jnp.float32),
            jnp.asarray(rng.standard_normal((hkv, n, b, d)), jnp.float32))


def _tables(rng, lens, n, b, width):
    """Distinct random pages (never page 0) for each row, zeros past its length."""
    pages = rng.permutation(np.arange(1, n))
    tables, used = np.zeros((len(lens), width), np.int32), 0
    for s, length in enumerate(lens):
        k = -(-length // b)
        tables[s, :k] = pages[used:used + k]
        used += k
    return jnp.asarray(tables)


@pytest.mark.parametrize("hq,hkv,d,b", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 128, 16),
                                        (6, 2, 40, 4)])
def test_decode_matches_reference(hq, hkv, d, b):
    rng = np.random.default_rng(0)
    lens = [1, 5, b, b + 1, 3 * b + 7, 0, 50]  # 0: a padding row
    n, width = 64, -(-max(lens) // b)
    k, v = _pool(rng, hkv, n, b, d)
    tables = _tables(rng, lens, n, b, width)
    seq_lens = jnp.asarray(lens, jnp.int32)
    q = jnp.asarray(rng.standard_normal((len(lens), hq, d)), jnp.float32)
    rows = jnp.where(seq_lens > 0, jnp.arange(len(lens)), len(lens)).astype(jnp.int32)
    got = cpu_kernels.paged_attention(q, k, v, tables, seq_lens, rows,
                                            jnp.maximum(seq_lens - 1, 0), sm_scale=d ** -0.5)
    want = ref_paged_decode_attention(q, k, v, tables, seq_lens, sm_scale=d ** -0.5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[5].any()  # the padding row is zeros


def test_prefill_matches_reference_with_padding_tokens():
    """Chunks of several rows back to back (one continues a cached prefix), then padding."""
    rng = np.random.default_rng(1)
    hq, hkv, d, b = 9, 3, 64, 16
    kv_lens, q_lens = [40, 17, 70], [40, 9, 30]  # row 1 and 2 have cached keys before the chunk
    k, v = _pool(rng, hkv, 64, b, d)
    tables = _tables(rng, kv_lens, 64, b, 8)
    query_start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(query_start[-1]) + 5
    token_row = np.full(t, len(kv_lens), np.int32)
    positions = np.zeros(t, np.int32)
    for s, (kl, ql) in enumerate(zip(kv_lens, q_lens)):
        token_row[query_start[s]:query_start[s + 1]] = s
        positions[query_start[s]:query_start[s + 1]] = np.arange(kl - ql, kl)
    q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float32)
    seq_lens = jnp.asarray(kv_lens, jnp.int32)
    got = cpu_kernels.paged_attention(q, k, v, tables, seq_lens, token_row, positions,
                                            sm_scale=0.125)
    want = ref_ragged_prefill_attention(q, k, v, tables, seq_lens, jnp.asarray(query_start),
                                        sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[-5:].any()


def test_large_batch_uses_threads_and_matches():
    """Enough units to split over the thread pool; results must not depend on the split."""
    rng = np.random.default_rng(2)
    hq, hkv, d, b = 9, 3, 64, 16
    lens = rng.integers(1, 200, 96).tolist()
    k, v = _pool(rng, hkv, 1400, b, d)
    tables = _tables(rng, lens, 1400, b, 13)
    seq_lens = jnp.asarray(lens, jnp.int32)
    q = jnp.asarray(rng.standard_normal((len(lens), hq, d)), jnp.float32)
    f = jax.jit(lambda q: cpu_kernels.paged_attention(
        q, k, v, tables, seq_lens, jnp.arange(len(lens), dtype=jnp.int32), seq_lens - 1,
        sm_scale=0.125))
    want = ref_paged_decode_attention(q, k, v, tables, seq_lens, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(f(q)), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_extreme_scores_stay_finite():
    """Large logits: the softmax subtracts the row max, so nothing overflows."""
    rng = np.random.default_rng(3)
    k, v = _pool(rng, 1, 8, 4, 16)
    tables = jnp.asarray([[1, 2, 3]], jnp.int32)
    q = jnp.asarray(rng.standard_normal((1, 1, 16)) * 1e3, jnp.float32)
    seq_lens = jnp.asarray([11], jnp.int32)
    got = cpu_kernels.paged_attention(q, k, v, tables, seq_lens, jnp.zeros(1, jnp.int32),
                                            seq_lens - 1, sm_scale=1.0)
    want = ref_paged_decode_attention(q, k, v, tables, seq_lens, sm_scale=1.0)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


def test_backend_resolution():
    from jaxserve.model.attention import resolve_backend

    assert resolve_backend("auto") == "cpu"  # on CPU with a float32 pool
    assert resolve_backend("auto", "bfloat16") == "xla"  # the kernel reads float32 pages only
    with pytest.raises(ValueError, match="float32"):
        resolve_backend("cpu", "bfloat16")


@pytest.mark.parametrize("m", [1, 3, 8, 11, 40])  # row blocks of 8 and their remainders
@pytest.mark.parametrize("k,n", [(576, 960), (40, 7), (1536, 100)])  # K tails, N % 8 tails
def test_int8_small_matmul_matches_dequantized_product(m, k, n):
    rng = np.random.default_rng(m * 1000 + k + n)
    w = quantize_weight(rng.standard_normal((k, n)).astype(np.float32))
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = x @ (w["q_t"].astype(np.float32).T * w["scale"])
    got = cpu_kernels.small_matmul_int8(jnp.asarray(x), jnp.asarray(w["q_t"]),
                                        jnp.asarray(w["scale"]))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("m", [1, 5, 8, 13])
@pytest.mark.parametrize("k,n", [(576, 960), (40, 7)])
def test_f32_small_matmul_matches_numpy(m, k, n):
    rng = np.random.default_rng(m * 100 + k + n)
    w = rng.standard_normal((n, k)).astype(np.float32)  # [out, in]
    x = rng.standard_normal((m, k)).astype(np.float32)
    got = cpu_kernels.small_matmul_f32(jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_allclose(np.asarray(got), x @ w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["f32", "int8"])
def test_model_matmul_uses_the_kernels_below_their_row_limits(kind):
    """llama.matmul routes few-row products to the kernels on the cpu backend only, and both
    routes give the same product."""
    from jaxserve.model import llama

    rng = np.random.default_rng(5)
    if kind == "int8":
        w = {k: jnp.asarray(v) for k, v in quantize_weight(rng.standard_normal((64, 48))).items()}
        limit, target = cpu_kernels.INT8_MATMUL_MAX_ROWS, "jaxserve_small_matmul_int8"
    else:
        w = jnp.asarray(rng.standard_normal((48, 64)), jnp.float32)
        limit, target = cpu_kernels.F32_MATMUL_MAX_ROWS, "jaxserve_small_matmul_f32"
    for rows in (1, limit, limit + 1):
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
        text = jax.jit(lambda x: llama.matmul(x, w, "cpu")).lower(x).as_text()
        assert (target in text) == (rows <= limit)
        assert "jaxserve" not in jax.jit(lambda x: llama.matmul(x, w, "xla")).lower(x).as_text()
        np.testing.assert_allclose(np.asarray(llama.matmul(x, w, "cpu")),
                                   np.asarray(llama.matmul(x, w, "xla")), rtol=1e-4, atol=1e-4)
