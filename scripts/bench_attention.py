"""Time the XLA paged-attention path (the CPU fast path) for one step over all layers, for a
grid of its block constants, at SmolLM2-135M's shapes.

  python scripts/bench_attention.py                        # decode 256 rows x 192 keys, prefill
  python scripts/bench_attention.py --rows=64 --context=1024

Decode: `rows` sequences, one query each, `context` keys each. Prefill: `prefill_tokens` tokens
as prompts of `context` tokens (the step's chunk is each prompt's last tokens). Pages are
shuffled so reads are scattered as in a running pool. Prints ms per step (best of --repeats).
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 256, "Decode rows.")
flags.DEFINE_integer("context", 192, "Keys per sequence.")
flags.DEFINE_integer("prefill_tokens", 1024, "Prefill tokens in the prefill case (0: skip).")
flags.DEFINE_integer("page_size", 16, "Tokens per page.")
flags.DEFINE_integer("table_width", 512, "Page-table width (the engine's pages per sequence at "
                     "max_model_len; 512 = 8192 tokens, SmolLM2's context); unused entries 0.")
flags.DEFINE_list("pages_per_block", ["4", "8", "16"], "Values to try.")
flags.DEFINE_list("rows_per_chunk", ["8", "16", "32", "1024"], "Values to try (1024: no chunks).")
flags.DEFINE_integer("repeats", 5, "Timed runs per setting.")

LAYERS, KV_HEADS, HEADS, HEAD_DIM = 30, 3, 9, 64  # SmolLM2-135M


def best_ms(fn, *args) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(FLAGS.repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def case(num_seqs: int, context: int, tokens_per_seq: int):
    """Pool, metadata and queries for num_seqs sequences of `context` keys whose last
    tokens_per_seq tokens are this step's queries (1: decode rows)."""
    import jax.numpy as jnp

    from jaxserve.model.attention import AttentionMetadata
    from jaxserve.model.kv_cache import KVCache, KVPool

    b, rng = FLAGS.page_size, np.random.default_rng(0)
    pages = -(-context // b)
    num_pages = 1 + num_seqs * pages
    tables = (1 + rng.permutation(num_seqs * pages)).reshape(num_seqs, pages).astype(np.int32)
    decode = tokens_per_seq == 1
    qblock = 1 if decode else 16
    chunk = -(-tokens_per_seq // qblock) * qblock
    positions, slots, rows = [], [], []
    for s in range(num_seqs):
        pos = np.arange(context - tokens_per_seq, context)
        pos = np.concatenate([pos, np.full(chunk - tokens_per_seq, context - 1)])
        positions.append(pos)
        rows.append(np.full(chunk, s))
        slots.append(tables[s, pos // b] * b + pos % b)
    shape = (KV_HEADS, num_pages, b, HEAD_DIM)
    pool = KVPool(tuple(KVCache(k=jnp.asarray(rng.standard_normal(shape, np.float32)),
                                v=jnp.asarray(rng.standard_normal(shape, np.float32)))
                        for _ in range(LAYERS)))
    cat = lambda xs: jnp.asarray(np.concatenate(xs).astype(np.int32))  # noqa: E731
    md = AttentionMetadata(
        positions=cat(positions), slot_mapping=cat(slots),
        page_tables=jnp.asarray(np.pad(tables, ((0, 0), (0, max(0, FLAGS.table_width - pages))))),
        seq_lens=jnp.full(num_seqs, context, jnp.int32),
        query_start=jnp.asarray(np.arange(num_seqs + 1) * chunk, jnp.int32),
        token_row=cat(rows), num_decode=num_seqs if decode else 0, query_block=qblock)
    q = jnp.asarray(rng.standard_normal((num_seqs * chunk, HEADS, HEAD_DIM), np.float32))
    return q, pool, md


def time_all_layers(q, pool, md, backend: str = "xla") -> float:
    import jax

    from jaxserve import backends
    from jaxserve.model import attention

    backend = backends.get(backend)

    def step(q, pool, md):  # layers unrolled, as in the model
        acc = q * 0
        for cache in pool.layers:
            acc = acc + attention.attend(backend, q, cache, md, HEAD_DIM ** -0.5)
        return acc

    return best_ms(jax.jit(step), q, pool, md)


def sweep(label: str, prefix: str, q, pool, md):
    from jaxserve.backends import xla
    from jaxserve.backends.cpu import kernels as cpu_kernels

    if cpu_kernels.available():  # the same tokens (a prefill case's alignment padding included)
        print(f"{label:44s} cpu kernel (no block constants)  "
              f"{time_all_layers(q, pool, md, 'cpu'):8.1f} ms/step "
              f"({md.token_row.shape[0]} tokens)", flush=True)

    saved = {n: getattr(xla, n) for n in dir(xla) if n.startswith(prefix)}
    for ppb, chunk in itertools.product(FLAGS.pages_per_block, FLAGS.rows_per_chunk):
        setattr(xla, f"{prefix}_PAGES_PER_BLOCK", int(ppb))
        setattr(xla, f"{prefix}_ROWS_PER_CHUNK", int(chunk))
        print(f"{label:44s} pages/block {ppb:>3}  rows/chunk {chunk:>5}  "
              f"{time_all_layers(q, pool, md):8.1f} ms/step", flush=True)
    for n, v in saved.items():
        setattr(xla, n, v)
    print(f"  (defaults: {saved})")


def main(argv):
    del argv
    sweep(f"decode {FLAGS.rows} rows x {FLAGS.context} keys, {LAYERS} layers", "DECODE",
          *case(FLAGS.rows, FLAGS.context, 1))
    if FLAGS.prefill_tokens:
        chunk = min(FLAGS.context, FLAGS.prefill_tokens)
        seqs = FLAGS.prefill_tokens // chunk
        sweep(f"prefill {seqs} x {chunk} tokens of {FLAGS.context}, {LAYERS} layers", "PREFILL",
              *case(seqs, FLAGS.context, chunk))


if __name__ == "__main__":
    app.run(main)
