"""Time one decode step of paged attention with and without a sliding window, on the C++ CPU
kernel and the XLA path: 8 rows of 4096 keys, 4 KV heads, 2 query heads each, head dim 64,
pages of 16. With a window of 256 the C++ kernel reads only the window's pages and XLA starts
its block loop at the window, so the step's cost follows W, not the context.

  PYTHONPATH=$PWD python scripts/bench_window_attention.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.backends import xla
from jaxserve.backends.cpu import kernels
from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.kv_cache import KVCache

HKV, G, D, B, T, ROWS, WINDOW, REPEATS = 4, 2, 64, 16, 4096, 8, 256, 20


def main():
    pages = T // B
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((HKV, ROWS * pages + 1, B, D), dtype=np.float32))
            for _ in range(2))
    tables = jnp.asarray(1 + rng.permutation(ROWS * pages).reshape(ROWS, pages), jnp.int32)
    q = jnp.asarray(rng.standard_normal((ROWS, HKV * G, D), dtype=np.float32))
    seq_lens = jnp.full((ROWS,), T, jnp.int32)
    rows = jnp.arange(ROWS, dtype=jnp.int32)
    md = AttentionMetadata(positions=seq_lens - 1, slot_mapping=rows, page_tables=tables,
                           seq_lens=seq_lens, query_start=jnp.arange(ROWS + 1, dtype=jnp.int32),
                           token_row=rows, num_decode=ROWS)
    paths = {"cpu": lambda w: lambda q: kernels.paged_attention(
                 q, k, v, tables, seq_lens, rows, seq_lens - 1, sm_scale=D ** -0.5, window=w),
             "xla": lambda w: lambda q: xla.attention(q, KVCache(k=k, v=v), md,
                                                      sm_scale=D ** -0.5, window=w)}
    for name, make in paths.items():
        if name == "cpu" and not kernels.available():
            print(f"cpu: unavailable ({kernels.unavailable_reason()})")
            continue
        for window in (None, WINDOW):
            step = jax.jit(make(window))
            step(q).block_until_ready()
            start = time.perf_counter()
            for _ in range(REPEATS):
                step(q).block_until_ready()
            ms = (time.perf_counter() - start) / REPEATS * 1e3
            print(f"{name} window={window}: {ms:.2f} ms per decode step "
                  f"({ROWS} rows x {T} keys)")


if __name__ == "__main__":
    main()
