"""GPU (Pallas Triton) attention over the paged KV pool.

  ragged_paged_attention   the one entry point: rows in any order (decode, prefill chunks, padding)
  check_supported          whether a model's head dim, page size and KV dtype fit the kernel
  validate_inputs          its input checks (shapes and dtypes; values too outside jit)
  GpuBlockSizes            tuning knobs, apart from numerics

Run in Pallas interpret mode on CPU and lowered for "cuda" there; compiled and timed only on a
lent GPU (scripts/device_check.py). The same-signature reference is
`pallas_kernels.reference.ref_ragged_paged_attention`.
"""

from pallas_kernels.gpu.attention import check_supported, ragged_paged_attention
from pallas_kernels.gpu.block_sizes import GpuBlockSizes
from pallas_kernels.validation import validate_inputs

__all__ = ["GpuBlockSizes", "check_supported", "ragged_paged_attention", "validate_inputs"]
