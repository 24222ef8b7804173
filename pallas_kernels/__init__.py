"""Pallas attention kernels over a paged KV pool, by platform, with pure-jnp references.

The pool is head-major, k_pages/v_pages f[Hkv, N, B, D] (KV heads, pages, page size, head dim),
as in JAX's TPU paged_attention: one head's page k_pages[h, page] is a contiguous [B, D] block.

  tpu/         TPU-style (Mosaic) decode and ragged prefill kernels, with their block sizes
  reference.py same-signature references (gather, mask, float32 softmax) for every platform
"""
