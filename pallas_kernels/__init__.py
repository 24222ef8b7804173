"""Pallas attention kernels over a paged KV pool, each with a pure-jnp reference beside it.

The pool is head-major, k_pages/v_pages f[Hkv, N, B, D] (KV heads, pages, page size, head dim),
as in JAX's TPU paged_attention: one head's page k_pages[h, page] is a contiguous [B, D] block.

  paged_decode_attention      one query token per sequence, pages walked via the page table
  ragged_prefill_attention    blocked causal attention for ragged batches (chunked prefill)
  ref_*                       same-signature references (gather, mask, float32 softmax)
  DecodeBlockSizes, PrefillBlockSizes   tuning knobs, apart from numerics

The kernels are TPU-style (Mosaic semantics) and have only been run in interpret mode on CPU.
"""

from pallas_kernels.block_sizes import DecodeBlockSizes, PrefillBlockSizes
from pallas_kernels.decode_attention import paged_decode_attention, validate_decode_inputs
from pallas_kernels.prefill_attention import ragged_prefill_attention, validate_prefill_inputs
from pallas_kernels.reference import ref_paged_decode_attention, ref_ragged_prefill_attention

__all__ = [
    "DecodeBlockSizes",
    "PrefillBlockSizes",
    "paged_decode_attention",
    "ragged_prefill_attention",
    "ref_paged_decode_attention",
    "ref_ragged_prefill_attention",
    "validate_decode_inputs",
    "validate_prefill_inputs",
]
