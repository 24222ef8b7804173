"""Batch-invariant numerics (LoadConfig.batch_invariant, docs/rl.md): a token's hidden states,
KV, logits and logprobs bitwise the same whatever else is in its step, its row, its prefill
chunking and its prefix hits.

A float sum's value depends on its order, and a compiler picks the order of a reduction from the
whole operand's shape: XLA's CPU dot of [T, K] x [K, N] runs a matrix-vector kernel for T = 1 and
tiled GEMMs otherwise, so a row's result changes with the number of rows beside it. Here every
reduction that a batch's shape could reorder runs on fixed shapes instead:

- `by_row_tiles` runs a per-row function over tiles of ROW_TILE rows, one tile per iteration of
  a loop (at least two, so the loop is never inlined into its neighbours): every row meets the
  same compiled kernel of the same shape. Matmuls (unless the backend's own is already
  row-invariant), norms and the logits' logsumexp go through it.
- Attention runs token by token (`per_token_attention`): each token attends its own row's pages
  as a decode row of one token would, in key blocks of a fixed size from position 0, so a key
  computed in a prefill chunk of any size, after a prefix hit or in decode gives the same sums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROW_TILE = 8


def by_row_tiles(fn, x, tile: int = ROW_TILE):
    """fn (arrays of `tile` rows -> arrays of `tile` rows) applied to x's rows (an array, or a
    tree of arrays of the same rows), tile by tile (zero rows pad the last); returns fn's rows
    for x's rows."""
    t = jax.tree_util.tree_leaves(x)[0].shape[0]
    n = max(2, -(-t // tile))

    def tiles(a):
        a = jnp.pad(a, [(0, n * tile - t)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(n, tile, *a.shape[1:])

    out = jax.lax.map(fn, jax.tree_util.tree_map(tiles, x))
    return jax.tree_util.tree_map(lambda a: a.reshape(n * tile, *a.shape[2:])[:t], out)


def per_token_attention(row_attention, q, md):
    """q f[T, Hq, D] -> f[T, Hq, D]: row_attention(q f[1, 1, Hq, D], page_tables i32[1, P],
    seq_lens i32[1], q_pos i32[1, 1]) -> f[1, Hq, D] (a backend's rows attention, one decode row)
    for each token in turn, as the decode row of its own position. Padding tokens (token_row
    S) attend nothing."""
    s = md.page_tables.shape[0]

    def one(args):
        qt, row, pos = args
        real = row < s
        table = md.page_tables[jnp.minimum(row, s - 1)][None]
        length = jnp.where(real, pos + 1, 0)[None]
        return row_attention(qt[None, None], table, length, pos[None, None])[0]

    return jax.lax.map(one, (q, md.token_row, md.positions))
