"""Shared attention test cases: a head-major paged pool f[Hkv, N, B, D] with shuffled page ids,
NaN in page 0, in every unused page and in the tail of each last page; rows in any order (decode
rows, prefill chunks after a prefix, whole prompts, empty padding rows); the float64 oracle; the
shape matrix every platform's `ragged_paged_attention` is tested on; and the engine's metadata for
a case (`engine_metadata`).

Tolerances (kernel vs reference, both accumulate in float32 at HIGHEST precision):
  float32 inputs:  atol = rtol = 2e-5   (observed ~1e-6: evaluation order only)
  bfloat16 inputs: atol = rtol = 1.6e-2 (outputs rounded to bf16: one ulp is 2^-8 relative)
Reference (float32) vs the float64 oracle: atol = rtol = 1e-5.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.kv_cache import quantize_kv
from pallas_kernels.reference import ref_ragged_paged_attention_f64

TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
F64_TOL = dict(atol=1e-5, rtol=1e-5)


def make_case(seed, *, seq_lens, q_lens=None, page_size, num_kv_heads, group, head_dim,
              extra_pages=3, dtype=jnp.float32, table_width=None):
    """Random head-major pool f[Hkv, N, B, D] and page tables. q is [S, Hq, D] (decode) or
    [T, Hq, D] (prefill, q_lens)."""
    rng = np.random.default_rng(seed)
    seq_lens = np.asarray(seq_lens, np.int32)
    num_seqs = len(seq_lens)
    pages_needed = -(-seq_lens // page_size)
    width = table_width or max(1, int(pages_needed.max()))
    num_pages = 1 + int(pages_needed.sum()) + extra_pages
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    ids = rng.permutation(np.arange(1, num_pages))  # non-contiguous, shuffled page ids
    table = np.zeros((num_seqs, width), np.int32)
    used = np.zeros(num_pages, bool)
    cursor = 0
    for s, n in enumerate(pages_needed):
        table[s, :n] = ids[cursor:cursor + n]
        cursor += n
        used[table[s, :n]] = True
        # Slots past the length in the last page hold garbage too.
        if seq_lens[s] % page_size:
            k[:, table[s, n - 1], seq_lens[s] % page_size:] = np.nan
            v[:, table[s, n - 1], seq_lens[s] % page_size:] = np.nan
        # Unused table entries point at scratch page 0 or at an unused (NaN) page.
        spare = ids[len(ids) - 1] if extra_pages else 0
        table[s, n:] = np.where(np.arange(n, width) % 2, spare, 0)
    k[:, ~used] = np.nan
    v[:, ~used] = np.nan
    num_q_heads = num_kv_heads * group
    rows = num_seqs if q_lens is None else int(np.sum(q_lens)) + 3  # 3 padding rows
    q = rng.standard_normal((rows, num_q_heads, head_dim)).astype(np.float32)
    case = dict(q=jnp.asarray(q, dtype), k_pages=jnp.asarray(k, dtype),
                v_pages=jnp.asarray(v, dtype), page_tables=jnp.asarray(table),
                seq_lens=jnp.asarray(seq_lens))
    if q_lens is not None:
        case["query_start"] = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return case


def page_major(case, *, heads: int | None = None, flat: bool = False, nan: float | None = None):
    """The case's head-major K and V as one page-major pool (kv_cache.PagedKV): f[N, B, 2H, D]
    with head h's K at 2h and V at 2h + 1 (H = heads >= the case's; the extra heads zeros), or
    flat, f[N, B, 2H * D] (the same bytes); nan: a finite value for the NaN garbage."""
    k, v = (np.asarray(jnp.asarray(case[n], jnp.float32)) for n in ("k_pages", "v_pages"))
    if nan is not None:
        k, v = np.nan_to_num(k, nan=nan), np.nan_to_num(v, nan=nan)
    h, n, b, d = k.shape
    kv = np.zeros((n, b, heads or h, 2, d), np.float32)
    kv[:, :, :h, 0], kv[:, :, :h, 1] = k.transpose(1, 2, 0, 3), v.transpose(1, 2, 0, 3)
    shape = (n, b, -1) if flat else (n, b, -1, d)
    return jnp.asarray(kv.reshape(shape), case["k_pages"].dtype)


def quantize_case(case):
    """The case with int8 pages and their scales f32[Hkv, N, B] (kv_cache.quantize_kv): the
    garbage slots (NaN in the float case) hold int8 garbage and NaN scales."""
    out = dict(case)
    for name in ("k", "v"):
        pages = np.asarray(jnp.asarray(case[f"{name}_pages"], jnp.float32))
        garbage = np.isnan(pages).any(-1)
        q, scale = quantize_kv(jnp.asarray(np.nan_to_num(pages)))
        q, scale = np.array(q), np.array(scale)
        q[garbage] = np.random.default_rng(0).integers(-127, 128, (int(garbage.sum()), q.shape[-1]))
        scale[garbage] = np.nan
        out[f"{name}_pages"], out[f"{name}_scale"] = jnp.asarray(q), jnp.asarray(scale)
    return out


def scales(case) -> dict:
    """The case's k_scale/v_scale keyword arguments ({} for float pages)."""
    return {k: case[k] for k in ("k_scale", "v_scale") if k in case}


def dense_f64(case, sm_scale):
    """The float64 oracle on a case; a decode case (no query_start) has one query per row with
    seq_len > 0 and zeros for padding rows."""
    if "query_start" in case:
        return ref_ragged_paged_attention_f64(
            case["q"], case["k_pages"], case["v_pages"], case["page_tables"], case["seq_lens"],
            case["query_start"], sm_scale=sm_scale, **scales(case))
    seq_lens = np.asarray(case["seq_lens"])
    query_start = np.arange(len(seq_lens) + 1, dtype=np.int32)
    out = ref_ragged_paged_attention_f64(
        case["q"], case["k_pages"], case["v_pages"], case["page_tables"], case["seq_lens"],
        query_start, sm_scale=sm_scale, **scales(case))
    out[seq_lens == 0] = 0
    return out


def assert_close(out, expected, tol):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, np.asarray(jnp.asarray(expected, jnp.float32)), **tol)


def extreme_case():
    """Scores +-1e4 (plus O(1) noise); in sequence 1, one key dominates its last row by ~1e4."""
    case = make_case(6, seq_lens=[12, 5], q_lens=[12, 5], page_size=8, num_kv_heads=1, group=2,
                     head_dim=64)
    rng = np.random.default_rng(6)
    u = np.sign(rng.standard_normal(64)).astype(np.float32)  # |q . k| = 12.5^2 * 64 = 1e4
    q, k = np.array(case["q"]), np.array(case["k_pages"])
    q = 12.5 * u * np.sign(q[..., :1])
    finite = np.isfinite(k[..., :1])
    k = np.where(finite, 12.5 * u * np.sign(k[..., :1]) + 0.01 * k, k).astype(np.float32)
    k[0, int(case["page_tables"][1, 0]), 2] = 2 * q[16, 0]  # row 16 = seq 1, position 4
    case.update(q=jnp.asarray(q), k_pages=jnp.asarray(k))
    return case


# Kernel vs its pure-jnp reference on these inputs: both take the float32 scores of the same
# inputs and a max-subtracted softmax, so they agree to the ordinary float32 TOL (observed
# ~1.2e-7). Either vs float64: float32 scores of magnitude 1e4 carry ~1e4 * 2^-24 absolute
# rounding, so outputs match float64 only to ~1e-3 (observed 6.4e-4; softmax conditioning, not
# instability); a naive exp(1e4) is inf in float32.
EXTREME_TOL = dict(atol=5e-3, rtol=5e-3)


# ---------------------------------------------------------------------------------------------
# The matrix for every platform's entry point: page sizes 8/16/32, head dims 64/128, GQA
# 1/3/4/8, f32 and bf16, without a full cross product.

RAGGED_SHAPES = [  # (page_size, head_dim, num_kv_heads, group, dtype)
    (8, 64, 2, 1, jnp.float32),
    (16, 128, 2, 3, jnp.float32),
    (32, 64, 1, 4, jnp.float32),
    (8, 128, 1, 8, jnp.float32),
    (16, 64, 2, 3, jnp.bfloat16),
    (32, 128, 1, 8, jnp.bfloat16),
]


def mixed_rows(page_size: int, long: int = 200) -> list[tuple[int, int]]:
    """(seq_len, q_len) per row, in mixed order: decode rows at lengths 1, B-1, B, B+1 and long,
    whole prompts, chunks after a prefix, and empty padding rows (seq_len 0) in the middle."""
    b = page_size
    return [(b + 1, 1), (b - 1, b - 1), (0, 0), (1, 1), (2 * b + 3, b), (long, 1), (b, b),
            (b, 1), (3 * b + 5, 3 * b + 5), (0, 0), (b + 1, 2), (long, 1)]


def ragged_case(seed, rows, *, page_size, num_kv_heads, group, head_dim, dtype=jnp.float32):
    """make_case for (seq_len, q_len) rows in the given order."""
    seq_lens, q_lens = zip(*rows)
    return make_case(seed, seq_lens=seq_lens, q_lens=q_lens, page_size=page_size,
                     num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype)


def call(fn, case, **kw):
    """fn(q, k_pages, v_pages, page_tables, seq_lens, query_start, **kw) on a ragged case (with
    k_scale and v_scale for int8 pages)."""
    return fn(case["q"], case["k_pages"], case["v_pages"], case["page_tables"], case["seq_lens"],
              case["query_start"], **kw, **scales(case))


def engine_metadata(case) -> AttentionMetadata:
    """The engine's metadata for a ragged case, every token a row block of its own (the layout
    the CPU kernel and the XLA path with query_block 1 both take)."""
    query_start, seq_lens = np.asarray(case["query_start"]), np.asarray(case["seq_lens"])
    t, rows = case["q"].shape[0], len(seq_lens)
    positions, token_row = np.zeros(t, np.int32), np.full(t, rows, np.int32)
    for r in range(rows):
        a, b = query_start[r], query_start[r + 1]
        positions[a:b] = np.arange(seq_lens[r] - (b - a), seq_lens[r])
        token_row[a:b] = r
    return AttentionMetadata(positions=jnp.asarray(positions), slot_mapping=jnp.zeros(t, jnp.int32),
                             page_tables=case["page_tables"], seq_lens=case["seq_lens"],
                             query_start=case["query_start"], token_row=jnp.asarray(token_row),
                             num_decode=0)
