"""The Pallas backend: the kernels of pallas_kernels/ (compiled on TPU, interpret mode
elsewhere), decode rows through the paged decode kernel and prefill chunks through the ragged
prefill kernel."""

from __future__ import annotations

import jax.numpy as jnp

from jaxserve.backends import Backend


def attention(q, k_pages, v_pages, md, *, sm_scale: float):
    from pallas_kernels.tpu import paged_decode_attention, ragged_prefill_attention

    sd = md.num_decode
    parts = []
    if sd:
        parts.append(paged_decode_attention(q[:sd], k_pages, v_pages, md.page_tables[:sd],
                                            md.seq_lens[:sd], sm_scale=sm_scale))
    if q.shape[0] > sd:
        query_start = md.query_start[sd:] - sd
        parts.append(ragged_prefill_attention(q[sd:], k_pages, v_pages, md.page_tables[sd:],
                                              md.seq_lens[sd:], query_start, sm_scale=sm_scale))
    return jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]


BACKEND = Backend(name="pallas", attention=attention)
