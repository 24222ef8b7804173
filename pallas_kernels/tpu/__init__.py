"""TPU-style (Mosaic) Pallas attention over the paged KV pool.

  ragged_paged_attention   the one entry point: rows in any order (decode, prefill chunks, padding)
  validate_inputs          its input checks (shapes and dtypes; values too outside jit)
  DecodeBlockSizes, PrefillBlockSizes   tuning knobs, apart from numerics

They have only been run in interpret mode on CPU and lowered to Mosaic for "tpu"; their
same-signature reference is `pallas_kernels.reference.ref_ragged_paged_attention`.
"""

from pallas_kernels.tpu.attention import ragged_paged_attention, validate_inputs
from pallas_kernels.tpu.block_sizes import DecodeBlockSizes, PrefillBlockSizes

__all__ = [
    "DecodeBlockSizes",
    "PrefillBlockSizes",
    "ragged_paged_attention",
    "validate_inputs",
]
