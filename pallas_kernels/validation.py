"""Input checks for every platform's `ragged_paged_attention` (one contract, one set of errors):
static shapes and dtypes always; page-table values, lengths and query offsets when concrete
(called outside jit)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(*arrays) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def check_scales(k_pages, v_pages, k_scale, v_scale) -> None:
    """int8 pages come with float32 scales [Hkv, N, B] for both K and V; float pages with none."""
    quantized = k_pages.dtype == jnp.int8
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale go together")
    if quantized != (k_scale is not None):
        raise ValueError(f"int8 pages need k_scale and v_scale, and only int8 pages take them "
                         f"(pages {k_pages.dtype}, scales "
                         f"{'given' if k_scale is not None else 'absent'})")
    if quantized:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale.shape != k_pages.shape[:3] or scale.dtype != jnp.float32:
                raise ValueError(f"{name} must be f32[Hkv, N, B] = f32{list(k_pages.shape[:3])}, "
                                 f"got {scale.dtype}{list(scale.shape)}")


def check_pool(q, k_pages, v_pages, page_tables, seq_lens, k_scale=None, v_scale=None) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be f[T, Hq, D], got shape {q.shape}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype}")
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be f[Hkv, N, B, D] (head-major), got shape "
                         f"{k_pages.shape}")
    if k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages shapes differ: {k_pages.shape} vs {v_pages.shape}")
    pool_dtype_ok = jnp.issubdtype(k_pages.dtype, jnp.floating) or k_pages.dtype == jnp.int8
    if k_pages.dtype != v_pages.dtype or not pool_dtype_ok:
        raise ValueError(f"k_pages and v_pages must share one floating or int8 dtype, got "
                         f"{k_pages.dtype} and {v_pages.dtype}")
    check_scales(k_pages, v_pages, k_scale, v_scale)
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads, _, _, head_dim_kv = k_pages.shape
    if head_dim != head_dim_kv:
        raise ValueError(f"head dim of q ({head_dim}) != head dim of k/v pages ({head_dim_kv})")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads Hq={num_q_heads} must be a multiple of KV heads "
                         f"Hkv={num_kv_heads}")
    if page_tables.ndim != 2 or page_tables.dtype != jnp.int32:
        raise ValueError(f"page_tables must be i32[S, P], got {page_tables.dtype}"
                         f"{list(page_tables.shape)}")
    if seq_lens.shape != (page_tables.shape[0],) or seq_lens.dtype != jnp.int32:
        raise ValueError(f"seq_lens must be i32[S] with S={page_tables.shape[0]} (rows of "
                         f"page_tables), got {seq_lens.dtype}{list(seq_lens.shape)}")


def check_page_values(page_tables, seq_lens, num_pages: int, page_size: int) -> None:
    """Lengths fit the table, and the page ids that hold positions below a length are in [0, N)."""
    page_tables, seq_lens = np.asarray(page_tables), np.asarray(seq_lens)
    capacity = page_tables.shape[1] * page_size
    bad = np.flatnonzero((seq_lens < 0) | (seq_lens > capacity))
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"seq_lens[{s}] = {int(seq_lens[s])} outside [0, P*B = {capacity}]")
    used = np.arange(page_tables.shape[1])[None, :] < -(-seq_lens[:, None] // page_size)
    out_of_range = used & ((page_tables < 0) | (page_tables >= num_pages))
    if out_of_range.any():
        s, j = (int(i) for i in np.argwhere(out_of_range)[0])
        raise ValueError(f"page_tables[{s}, {j}] = {int(page_tables[s, j])} is outside the pool "
                         f"[0, N = {num_pages}) but holds positions below seq_lens[{s}] = "
                         f"{int(seq_lens[s])}")


def validate_inputs(q, k_pages, v_pages, page_tables, seq_lens, query_start, k_scale=None,
                    v_scale=None, *, window=None, soft_cap=None, sinks=None) -> None:
    """Every check of the ragged contract; call outside jit to check values too."""
    check_pool(q, k_pages, v_pages, page_tables, seq_lens, k_scale, v_scale)
    if sinks is not None and (sinks.shape != (q.shape[1],)
                              or not jnp.issubdtype(sinks.dtype, jnp.floating)):
        raise ValueError(f"sinks must be f[Hq] with Hq = {q.shape[1]} (one logit per query "
                         f"head), got {sinks.dtype}{list(sinks.shape)}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if soft_cap is not None and not (isinstance(soft_cap, (int, float)) and soft_cap > 0):
        raise ValueError(f"soft_cap must be a positive number or None, got {soft_cap!r}")
    num_seqs = page_tables.shape[0]
    if query_start.shape != (num_seqs + 1,) or query_start.dtype != jnp.int32:
        raise ValueError(f"query_start must be i32[S+1] with S={num_seqs}, got "
                         f"{query_start.dtype}{list(query_start.shape)}")
    if not is_concrete(page_tables, seq_lens, query_start):
        return
    check_page_values(page_tables, seq_lens, k_pages.shape[1], k_pages.shape[2])
    query_start, seq_lens = np.asarray(query_start), np.asarray(seq_lens)
    q_lens = np.diff(query_start)
    if query_start[0] != 0 or (q_lens < 0).any():
        raise ValueError(f"query_start must start at 0 and be non-decreasing, got {query_start}")
    if query_start[-1] > q.shape[0]:
        raise ValueError(f"query_start[S] = {int(query_start[-1])} exceeds the T = {q.shape[0]} "
                         "rows of q")
    short = np.flatnonzero(q_lens > seq_lens)
    if short.size:
        s = int(short[0])
        raise ValueError(f"row {s} has {int(q_lens[s])} queries but seq_lens[{s}] = "
                         f"{int(seq_lens[s])}; seq_lens must include this step's queries")
