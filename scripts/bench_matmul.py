"""Time SmolLM2's 30 layers of projections (fused QKV, O, gate/up, down, with the RMS norms,
residuals and SiLU between them) through the CPU backend's panel matmul and through XLA's dot,
at each row count given. Random weights of the model's shapes; each chain is jitted, warmed up,
and timed as the best of --repeats calls.

  python scripts/bench_matmul.py --rows=1,8,16,32,256
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve.backends.cpu import kernels as cpu_kernels  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("rows", ["1", "2", "8", "16", "32", "64", "256"], "Row counts (tokens a step).")
flags.DEFINE_integer("repeats", 8, "Timed calls per row count (best reported).")
flags.DEFINE_integer("layers", 30, "Layers in the chain.")

HIDDEN, INTER = 576, 1536
SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # [out, in]


def _chain(x, weights, matmul):
    for w_qkv, w_o, w_gate_up, w_down in weights:
        x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)
        h = matmul(x, w_qkv, SHAPES[0][0])
        x = x + matmul(h[:, :HIDDEN], w_o, HIDDEN)
        g = matmul(x, w_gate_up, 2 * INTER)
        x = x + matmul(jax.nn.silu(g[:, :INTER]) * g[:, INTER:], w_down, HIDDEN)
    return x


def _best(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main(argv):
    del argv
    if not cpu_kernels.available():
        sys.exit(f"CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    rng = np.random.default_rng(0)
    out_in = [[rng.standard_normal(s, np.float32) / np.sqrt(s[1]) for s in SHAPES]
              for _ in range(FLAGS.layers)]
    plain = [[jnp.asarray(w) for w in ws] for ws in out_in]
    panels = [[jnp.asarray(cpu_kernels.pack_panels(w)) for w in ws] for ws in out_in]
    xla = jax.jit(lambda x, ws: _chain(x, ws, lambda a, w, n: a @ w.T))
    kernel = jax.jit(lambda x, ws: _chain(x, ws, cpu_kernels.matmul_f32))
    flops_per_row = 2 * FLAGS.layers * sum(o * i for o, i in SHAPES)
    print(f"{FLAGS.layers} layers of projections, f32; best of {FLAGS.repeats} (ms)")
    print(f"{'rows':>6} {'xla dot':>9} {'panels':>9} {'speedup':>8} {'panel GFLOP/s':>14}")
    for rows in map(int, FLAGS.rows):
        x = jnp.asarray(rng.standard_normal((rows, HIDDEN), np.float32))
        t_xla, t_kernel = _best(xla, x, plain), _best(kernel, x, panels)
        print(f"{rows:>6} {t_xla:>9.2f} {t_kernel:>9.2f} {t_xla / t_kernel:>7.2f}x "
              f"{rows * flops_per_row / t_kernel / 1e6:>14.0f}")


if __name__ == "__main__":
    app.run(main)
