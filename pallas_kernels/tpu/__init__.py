"""TPU-style (Mosaic) Pallas attention over the paged KV pool.

  paged_decode_attention      one query token per sequence, pages walked via the page table
  ragged_prefill_attention    blocked causal attention for ragged batches (chunked prefill)
  DecodeBlockSizes, PrefillBlockSizes   tuning knobs, apart from numerics

They have only been run in interpret mode on CPU; their same-signature references are
`pallas_kernels.reference`.
"""

from pallas_kernels.tpu.block_sizes import DecodeBlockSizes, PrefillBlockSizes
from pallas_kernels.tpu.decode_attention import paged_decode_attention, validate_decode_inputs
from pallas_kernels.tpu.prefill_attention import ragged_prefill_attention, validate_prefill_inputs

__all__ = [
    "DecodeBlockSizes",
    "PrefillBlockSizes",
    "paged_decode_attention",
    "ragged_prefill_attention",
    "validate_decode_inputs",
    "validate_prefill_inputs",
]
