"""Attention sinks (gpt-oss: a learned logit per query head in the softmax's denominator, with
no value) in every attention backend, against the float64 oracle
(pallas_kernels.reference.ref_ragged_paged_attention_f64 with sinks): the jnp reference, the XLA
path, the C++ CPU kernel (float and int8 pages, one and many splits), and the TPU (head-major and
page-major pools) and GPU Pallas kernels in interpret mode. Rows of every kind, with and without
a sliding window, over shuffled pages with NaN garbage (attention_cases.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import (F64_TOL, TOL, assert_close, call, engine_metadata, mixed_rows,
                             page_major, quantize_case, ragged_case)
from skips import need_backend
from jaxserve import backends
from jaxserve.model.attention import attend
from jaxserve.model.kv_cache import KVCache
from pallas_kernels.reference import ref_ragged_paged_attention, ref_ragged_paged_attention_f64

SCALE = 1 / 8  # head dim 64
WINDOW = 11


def _sinks(num_q_heads: int, seed: int = 3):
    """Logits comparable to the scores (about N(0, 1) here), so each sink takes a visible share."""
    return jnp.asarray(np.random.default_rng(seed).uniform(-1.0, 3.0, num_q_heads), jnp.float32)


def _case(page_size=8, *, group=3, long=60, seed=5):
    case = ragged_case(seed, mixed_rows(page_size, long=long), page_size=page_size,
                       num_kv_heads=2, group=group, head_dim=64)
    case["sinks"] = _sinks(case["q"].shape[1])
    return case


def _oracle(case, *, window=None, soft_cap=None, sinks="case"):
    sinks = case["sinks"] if sinks == "case" else sinks
    return call(ref_ragged_paged_attention_f64, case, sm_scale=SCALE, window=window,
                soft_cap=soft_cap, sinks=sinks)


def _real(case) -> int:
    return int(case["query_start"][-1])  # padding tokens' outputs are discarded


def test_oracle_sinks_take_mass_and_no_value():
    """The oracle's sinks, checked by hand: with every key's value 1 a query's output is the
    keys' share of the mass, 1 / (1 + exp(sink) / sum_j exp(s_j)); and the sinks change it."""
    case = _case()
    ones = dict(case, v_pages=jnp.ones_like(case["v_pages"]))
    out = _oracle(ones)
    q, k = np.asarray(case["q"], np.float64), np.asarray(case["k_pages"], np.float64)
    # Row 0: seq_len B + 1 = 9 with one query at position 8, token 0, KV head of query head 4: 1.
    keys = np.concatenate([k[1, p] for p in np.asarray(case["page_tables"])[0]])[:9]
    mass = np.exp(keys @ q[0, 4] * SCALE).sum()
    sink = float(case["sinks"][4])
    np.testing.assert_allclose(out[0, 4], 1 / (1 + np.exp(sink) / mass), rtol=1e-12)
    assert not np.allclose(_oracle(case)[:_real(case)],
                           _oracle(case, sinks=None)[:_real(case)], atol=1e-2)


@pytest.mark.parametrize("window", [None, WINDOW])
def test_reference_matches_float64(window):
    case = _case()
    out = call(ref_ragged_paged_attention, case_without_sinks(case), sm_scale=SCALE,
               window=window, sinks=case["sinks"])
    assert_close(out[:_real(case)], _oracle(case, window=window)[:_real(case)], F64_TOL)


def case_without_sinks(case):
    return {k: v for k, v in case.items() if k != "sinks"}


@pytest.mark.parametrize("backend", ["xla", "cpu"])
@pytest.mark.parametrize("window", [None, WINDOW])
def test_engine_backends_match_float64(backend, window):
    need_backend(backend)
    case = _case()
    # Page 0 and garbage read as zeros: the XLA path's causal masking of garbage slots is not a
    # select (test_attention_windows.py covers the released pages).
    case.update({name: jnp.nan_to_num(case[name]) for name in ("k_pages", "v_pages")})
    out = attend(backends.get(backend), case["q"], KVCache(k=case["k_pages"], v=case["v_pages"]),
                 engine_metadata(case), SCALE, window=window, sinks=case["sinks"])
    assert_close(out[:_real(case)], _oracle(case, window=window)[:_real(case)], F64_TOL)


def test_cpu_kernel_int8_pages_and_split_decode():
    """int8 pages with per-token scales; and one long decode row, whose keys the kernel splits
    over its threads: only the first split may count the sink (merged once)."""
    need_backend("cpu")
    case = quantize_case(_case())
    cache = KVCache(k=case["k_pages"], v=case["v_pages"], k_scale=case["k_scale"],
                    v_scale=case["v_scale"])
    out = attend(backends.get("cpu"), case["q"], cache, engine_metadata(case), SCALE,
                 window=WINDOW, sinks=case["sinks"])
    assert_close(out[:_real(case)], _oracle(case, window=WINDOW)[:_real(case)], F64_TOL)
    long = ragged_case(7, [(3000, 1)], page_size=16, num_kv_heads=1, group=4, head_dim=64)
    long["sinks"] = _sinks(4)
    long.update({name: jnp.nan_to_num(long[name]) for name in ("k_pages", "v_pages")})
    out = attend(backends.get("cpu"), long["q"], KVCache(k=long["k_pages"], v=long["v_pages"]),
                 engine_metadata(long), SCALE, sinks=long["sinks"])
    assert_close(out[:1], _oracle(long)[:1], F64_TOL)


@pytest.mark.parametrize("path", ["decode", "prefill"])
@pytest.mark.parametrize("layout", ["head_major", "page_major"])
def test_tpu_kernels_match_float64(path, layout):
    from pallas_kernels.tpu import TpuBlockSizes, ragged_paged_attention

    rows = [(9, 1), (40, 1), (0, 0), (33, 1)] if path == "decode" else mixed_rows(8, long=45)
    case = ragged_case(5, rows, page_size=8, num_kv_heads=2, group=2, head_dim=64)
    case["sinks"] = _sinks(4)
    k, v = case["k_pages"], case["v_pages"]
    if layout == "page_major":
        k, v = page_major(case, flat=True), None
    out = ragged_paged_attention(case["q"], k, v, case["page_tables"], case["seq_lens"],
                                 case["query_start"], sm_scale=SCALE, interpret=True,
                                 window=WINDOW, sinks=case["sinks"],
                                 block_sizes=TpuBlockSizes(block_q=16, pages_per_block=2))
    assert_close(out[:_real(case)], _oracle(case, window=WINDOW)[:_real(case)], TOL[jnp.float32])


@pytest.mark.parametrize("pool", ["float32", "int8"])
def test_gpu_kernel_matches_float64(pool):
    from pallas_kernels.gpu import GpuBlockSizes, ragged_paged_attention

    case = _case(16, long=70)
    if pool == "int8":
        case = quantize_case(case)
    out = call(ragged_paged_attention, case_without_sinks(case), sm_scale=SCALE, interpret=True,
               window=WINDOW, sinks=case["sinks"])
    assert_close(out, _oracle(case, window=WINDOW), TOL[jnp.float32])
    # Decode rows split over their pages (flash-decoding): the sink joins the merge once.
    decode = ragged_case(8, [(200, 1), (77, 1)], page_size=16, num_kv_heads=1, group=4,
                         head_dim=64)
    decode["sinks"] = _sinks(4)
    out = call(ragged_paged_attention, case_without_sinks(decode), sm_scale=SCALE,
               interpret=True, sinks=decode["sinks"], block_sizes=GpuBlockSizes(splits=4))
    assert_close(out, _oracle(decode), TOL[jnp.float32])


def test_pallas_backend_passes_sinks():
    """The Pallas backend's attention (interpreted TPU kernels, the head-major pool the engine
    gives them) with sinks."""
    case = _case()
    case.update({name: jnp.nan_to_num(case[name]) for name in ("k_pages", "v_pages")})
    out = attend(backends.get("pallas-tpu-interpret"), case["q"],
                 KVCache(k=case["k_pages"], v=case["v_pages"]), engine_metadata(case), SCALE,
                 sinks=case["sinks"])
    assert_close(out[:_real(case)], _oracle(case)[:_real(case)], TOL[jnp.float32])
    with pytest.raises(ValueError, match="sinks"):
        attend(backends.get("pallas-tpu-interpret"), case["q"],
               KVCache(k=case["k_pages"], v=case["v_pages"]), engine_metadata(case), SCALE,
               sinks=case["sinks"][:3])


def test_tpu_layout_keeps_models_with_sinks_off_jax_kernel():
    """Compiled for a TPU, a head dim of 128 in bf16 takes JAX's kernel (its page-major pool of
    interleaved heads), which has no sinks: a model with sinks gets this package's flat pool."""
    tpu = backends.get("pallas-tpu")
    shape = dict(num_q_heads=8, q_dtype=jnp.bfloat16)
    plain = backends.pool_layout(tpu, 2, 128, jnp.bfloat16, **shape)
    with_sinks = backends.pool_layout(tpu, 2, 128, jnp.bfloat16, sinks=True, **shape)
    assert plain.page_major and not plain.flat  # JAX's kernel's layout
    assert with_sinks.page_major and with_sinks.flat
