"""TPU-style (Mosaic) Pallas attention over the paged KV pool.

  ragged_paged_attention   the one entry point: rows in any order (decode, prefill chunks, padding)
  validate_inputs          its input checks (shapes and dtypes; values too outside jit)
  TpuBlockSizes            tuning knobs, apart from numerics
  jax_kernel               JAX's own TPU ragged paged attention behind the same contract, over
                           a page-major pool: the TPU default where it applies

Run in Pallas interpret mode on CPU, and compiled by XLA and Mosaic for v5e and v6e topologies
without a TPU (libtpu, tests/test_tpu_compile.py); never run on a TPU nor timed. The
same-signature reference is `pallas_kernels.reference.ref_ragged_paged_attention`.
"""

from pallas_kernels.tpu import jax_kernel
from pallas_kernels.tpu.attention import ragged_paged_attention
from pallas_kernels.tpu.block_sizes import TpuBlockSizes
from pallas_kernels.validation import validate_inputs

__all__ = ["TpuBlockSizes", "jax_kernel", "ragged_paged_attention", "validate_inputs"]
