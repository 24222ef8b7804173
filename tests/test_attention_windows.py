"""Sliding windows and soft-capped scores in every attention backend, against the float64 oracle
(pallas_kernels.reference): the jnp reference, the XLA path, the C++ CPU kernel, and the TPU and
GPU Pallas kernels in interpret mode. Rows of every kind (decode rows at page boundaries, whole
prompts, chunks after a prefix, padding rows) over shuffled pages whose page-table entries
wholly before a row's windows are the scratch page 0, as the KV manager leaves them after
releasing those pages; page 0 holds NaN, so a backend that read a released page unmasked, or
let a masked NaN value in, fails."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import (F64_TOL, TOL, assert_close, call, engine_metadata, mixed_rows,
                             quantize_case, ragged_case)
from skips import need_backend
from jaxserve import backends
from jaxserve.model.attention import attend
from jaxserve.model.kv_cache import KVCache
from pallas_kernels.reference import ref_ragged_paged_attention, ref_ragged_paged_attention_f64

WINDOW = 11  # not a multiple of the page size: windows start inside pages
SOFT_CAP = 1.5


def _released_case(page_size, rows, *, group=2, head_dim=64, seed=5):
    """A ragged case whose table entries before each row's earliest window are page 0."""
    case = ragged_case(seed, rows, page_size=page_size, num_kv_heads=2, group=group,
                       head_dim=head_dim)
    table = np.array(case["page_tables"])
    for s, (seq_len, q_len) in enumerate(rows):
        first_query = seq_len - q_len
        table[s, :max(0, first_query - WINDOW + 1) // page_size] = 0
    assert (table == 0).sum() > len(rows), "no page was released: the case tests nothing"
    case["page_tables"] = jnp.asarray(table)
    return case


def _oracle(case, sm_scale, window, soft_cap):
    return call(ref_ragged_paged_attention_f64, case, sm_scale=sm_scale, window=window,
                soft_cap=soft_cap)


FEATURES = [(WINDOW, None), (None, SOFT_CAP), (WINDOW, SOFT_CAP)]


@pytest.mark.parametrize("window,soft_cap", FEATURES)
def test_reference_matches_float64(window, soft_cap):
    case = _released_case(8, mixed_rows(8, long=60)) if window else \
        ragged_case(5, mixed_rows(8, long=60), page_size=8, num_kv_heads=2, group=2, head_dim=64)
    scale = 1 / 8
    out = call(ref_ragged_paged_attention, case, sm_scale=scale, window=window, soft_cap=soft_cap)
    real = int(case["query_start"][-1])  # padding tokens' outputs are discarded
    assert_close(out[:real], _oracle(case, scale, window, soft_cap)[:real], F64_TOL)
    if window:  # and the window changes the result: keys before it matter without one
        plain = _oracle(case, scale, None, soft_cap)
        assert np.isnan(plain).any() or not np.allclose(plain, out, atol=1e-3)


@pytest.mark.parametrize("backend", ["xla", "cpu"])
@pytest.mark.parametrize("window,soft_cap", FEATURES)
def test_engine_backends_match_float64(backend, window, soft_cap):
    need_backend(backend)
    case = _released_case(8, mixed_rows(8, long=60), group=3)
    if window is None:  # every key is read: no garbage (the XLA path's causal masking of
        # garbage slots is not a select), page 0 read as zeros
        case.update({name: jnp.nan_to_num(case[name]) for name in ("k_pages", "v_pages")})
    scale = 1 / 8
    out = attend(backends.get(backend), case["q"],
                 KVCache(k=case["k_pages"], v=case["v_pages"]), engine_metadata(case), scale,
                 window=window, soft_cap=soft_cap)
    real = int(case["query_start"][-1])  # padding tokens' outputs are discarded
    assert_close(out[:real], _oracle(case, scale, window, soft_cap)[:real], F64_TOL)


@pytest.mark.parametrize("backend", ["xla", "cpu"])
def test_engine_backends_read_int8_pages_in_windows(backend):
    """int8 pages with per-token scales: the window's first run of keys may start inside a page
    (its scales offset alike); page 0 and garbage slots hold int8 garbage and NaN scales."""
    need_backend(backend)
    case = quantize_case(_released_case(8, mixed_rows(8, long=60), group=3))
    cache = KVCache(k=case["k_pages"], v=case["v_pages"], k_scale=case["k_scale"],
                    v_scale=case["v_scale"])
    out = attend(backends.get(backend), case["q"], cache, engine_metadata(case), 1 / 8,
                 window=WINDOW, soft_cap=SOFT_CAP)
    real = int(case["query_start"][-1])
    assert_close(out[:real], _oracle(case, 1 / 8, WINDOW, SOFT_CAP)[:real], F64_TOL)


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_tpu_kernel_matches_float64(path):
    from pallas_kernels.tpu import TpuBlockSizes, ragged_paged_attention

    rows = [(9, 1), (40, 1), (0, 0), (33, 1)] if path == "decode" else mixed_rows(8, long=45)
    case = _released_case(8, rows)
    scale = 1 / 8
    out = call(ragged_paged_attention, case, sm_scale=scale, interpret=True, window=WINDOW,
               soft_cap=SOFT_CAP, block_sizes=TpuBlockSizes(block_q=16, pages_per_block=2))
    assert_close(out, _oracle(case, scale, WINDOW, SOFT_CAP), TOL[jnp.float32])


@pytest.mark.parametrize("pool", ["float32", "int8"])
def test_gpu_kernel_matches_float64(pool):
    from pallas_kernels.gpu import ragged_paged_attention

    case = _released_case(16, mixed_rows(16, long=70), head_dim=64)
    if pool == "int8":
        case = quantize_case(case)
    scale = 1 / math.sqrt(64)
    out = call(ragged_paged_attention, case, sm_scale=scale, interpret=True, window=WINDOW,
               soft_cap=SOFT_CAP)
    assert_close(out, _oracle(case, scale, WINDOW, SOFT_CAP), TOL[jnp.float32])


@pytest.mark.parametrize("kwargs,message", [({"window": 0}, "window"),
                                            ({"soft_cap": -1.0}, "soft_cap")])
def test_bad_window_or_soft_cap_is_refused(kwargs, message):
    from pallas_kernels.tpu import ragged_paged_attention

    case = _released_case(8, [(40, 1), (30, 2)])
    with pytest.raises(ValueError, match=message):
        call(ragged_paged_attention, case, sm_scale=0.1, interpret=True, **kwargs)
