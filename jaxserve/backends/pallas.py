"""The Pallas backends: each platform's `ragged_paged_attention` from pallas_kernels/ (gpu/ in
Triton, tpu/ in Mosaic), compiled on its device or interpreted on a CPU. The entry point takes
rows in any order, so batches are packed (decode rows and prefill chunks back to back, one step
shape per token bucket) and the engine calls nothing else."""

from __future__ import annotations

import functools

from jaxserve.backends import Backend


@functools.cache
def backend(family: str, *, interpret: bool) -> Backend:
    if family == "gpu":
        from pallas_kernels.gpu import ragged_paged_attention
    elif family == "tpu":
        from pallas_kernels.tpu import ragged_paged_attention
    else:
        raise ValueError(f"no Pallas kernel family {family!r} (gpu or tpu)")

    def attention(q, cache, md, *, sm_scale: float, window: int | None = None,
                  soft_cap: float | None = None):
        return ragged_paged_attention(q, cache.k, cache.v, md.page_tables, md.seq_lens,
                                      md.query_start, sm_scale=sm_scale, interpret=interpret,
                                      k_scale=cache.k_scale, v_scale=cache.v_scale,
                                      window=window, soft_cap=soft_cap)

    name = f"pallas-{family}" + ("-interpret" if interpret else "")
    return Backend(name=name, attention=attention, packed=True)
