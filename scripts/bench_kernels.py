"""Time the TPU entry point ragged_paged_attention against its pure-jnp reference on the default
device, on a decode batch (T == S: the token-at-a-time path) and a prefill batch (the ragged
blocked path).

Each function is jitted, warmed up once (compile excluded), then timed over --repeats calls;
the table reports the median wall time per call. On CPU (or any non-TPU backend) the kernels run
in Pallas interpret mode, which is a correctness tool, not a performance number: the table says
so. Shapes follow the default model (9 query heads, 3 KV heads, head dim 64); the KV pool is
head-major, f[Hkv, N, B, D], as the engine stores it.

  python scripts/bench_kernels.py [--repeats 5] [--page-size 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import ref_ragged_paged_attention
from pallas_kernels.tpu import TpuBlockSizes, ragged_paged_attention


def _pool(rng, seq_lens, page_size, num_kv_heads, head_dim, dtype):
    pages_needed = -(-np.asarray(seq_lens) // page_size)
    width = int(pages_needed.max())
    num_pages = 1 + int(pages_needed.sum())
    shape = (num_kv_heads, num_pages, page_size, head_dim)  # head-major pool
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    ids = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((len(seq_lens), width), np.int32)
    cursor = 0
    for s, n in enumerate(pages_needed):
        table[s, :n] = ids[cursor:cursor + n]
        cursor += n
    return k, v, jnp.asarray(table), jnp.asarray(seq_lens, jnp.int32)


def _time(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    flags = parser.parse_args()
    backend = jax.default_backend()
    interpret = backend != "tpu"
    mode = "Pallas interpret mode (not a performance number)" if interpret else "compiled"
    dtype = jnp.dtype(flags.dtype)
    rng = np.random.default_rng(0)
    num_q_heads, num_kv_heads, head_dim, b = 9, 3, 64, flags.page_size
    scale = head_dim ** -0.5
    rows = []

    sizes = TpuBlockSizes(block_q=32, pages_per_block=4)
    kernel = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=scale, block_sizes=sizes,
                                                       interpret=interpret))
    ref = jax.jit(lambda *a: ref_ragged_paged_attention(*a, sm_scale=scale))
    batches = [  # (name, seq_lens, q_lens)
        ("decode", [1, b - 1, b + 1, 37, 91, 128, 201, 255], [1] * 8),
        ("prefill", [64, 100, 160, 31], [64, 36, 96, 31]),  # two after a cached prefix
    ]
    for name, seq_lens, q_lens in batches:
        k, v, table, lens = _pool(rng, seq_lens, b, num_kv_heads, head_dim, dtype)
        q = jnp.asarray(rng.standard_normal((int(sum(q_lens)), num_q_heads, head_dim)), dtype)
        query_start = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        args = (q, k, v, table, lens, query_start)
        err = float(jnp.max(jnp.abs(kernel(*args).astype(jnp.float32)
                                    - ref(*args).astype(jnp.float32))))
        rows.append((name, f"T={q.shape[0]} S={len(seq_lens)} max_len={max(seq_lens)}",
                     _time(kernel, args, flags.repeats), _time(ref, args, flags.repeats), err))

    print(f"device: {jax.devices()[0].device_kind} ({backend}); kernels: {mode}")
    print(f"Hq={num_q_heads} Hkv={num_kv_heads} D={head_dim} B={b} dtype={dtype.name}; "
          f"median of {flags.repeats} calls after warm-up")
    header = f"{'batch':<10} {'shape':<28} {'kernel ms':>10} {'ref ms':>9} {'ratio':>7} {'max|diff|':>10}"
    print(header)
    print("-" * len(header))
    for name, shape, t_kernel, t_ref, err in rows:
        print(f"{name:<10} {shape:<28} {t_kernel * 1e3:>10.2f} {t_ref * 1e3:>9.2f} "
              f"{t_kernel / t_ref:>7.1f} {err:>10.2e}")


if __name__ == "__main__":
    main()
