"""JAX's own TPU ragged paged attention (`jax.experimental.pallas.ops.tpu.ragged_paged_attention`)
behind this package's contract: the TPU default wherever it applies.

Its pool is page-major with K and V interleaved on the head axis, `kv_pages[N, B, 2 * Hkv', D]`
(head h's keys at 2h, values at 2h + 1), so one DMA moves a whole page of every KV head, K and V
together. Hkv' >= Hkv: JAX's kernel takes only a combined head count that XLA tiles fully
(`padded_kv_heads`: SmolLM2's 3 KV heads are kept as 4); the padded heads are written never and
read by zero queries only.

Where it applies (`applies`): float pages (bf16, f32) with a head dim that is a multiple of 128
(above 128 only with one KV head per head block: Mosaic refuses more).
Elsewhere the pool stays head-major `[Hkv, N, B, D]` and the kernels of this package serve:
  - int8 pages: ours carry a float32 scale per token and KV head; JAX's kernel takes one scalar
    k_scale and v_scale per call (a static Python float), which cannot hold per-token scales.
  - head dim 64 (SmolLM2): JAX's kernel broadcasts its [rows, 128] softmax statistics across
    the head dim by whole 128-lane copies (it asserts D % 128 == 0 when it lowers).

Not interpretable: neither Pallas interpret mode of jax 0.10.2 runs JAX's kernel (the TPU one
has no rule for its reshaped DMA buffers, the generic one none for its scalar-indexed refs), so
the interpreted TPU backend keeps the head-major pool and this package's kernels; the adapter's
layout, padding and options are tested on CPU with JAX's `ref_ragged_paged_attention` in the
kernel's place, and the kernel itself is compiled for v5e and v6e (tests/test_tpu_compile.py).

Cost: JAX's kernel declares no pl.CostEstimate; `common.with_cost` attaches this package's count
of its reads (`common.attention_cost`) to its pallas_call, so XLA's cost model sees its pages.

Block sizes: JAX's tuned table, looked up for the device kind that Mosaic lowers for
(`target_device_kind`, which honours `compile_target`); JAX's own lookup reads
`jax.devices()`, a CPU in a compile-only process, so the adapter passes explicit sizes.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as jax_rpa
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes as tuned

from pallas_kernels.tpu.common import attention_cost, with_cost

# Where no TPU is the target (JAX's reference swapped in by tests), sizes as for this chip.
_DEFAULT_KIND = "TPU v6 lite"
_KV_BUFFER_BYTES = 8 * 2 ** 20  # its two KV buffers' bytes at most (block_sizes)


def applies(head_dim: int, dtype, *, num_q_heads: int, num_kv_heads: int, q_dtype) -> bool:
    """Whether JAX's kernel takes pages of this head dim and dtype for these heads (see the
    module docstring): also, the query heads of one of its head blocks must tile (8 rows, or
    all of them): with 8 float32 KV heads and f32 queries, one each, it picks blocks of 4 of 8
    query heads, which Mosaic refuses ("divisible by 8 and 128")."""
    if head_dim % 128 or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16),
                                                 jnp.dtype(jnp.float32)):
        return False
    heads = padded_kv_heads(num_kv_heads, dtype)
    q_heads = heads * (num_q_heads // num_kv_heads)
    block, combined = jax_rpa.get_min_heads_per_blk(q_heads, 2 * heads, q_dtype, dtype)
    # Head dim 256 with more than one KV head per block (Gemma 2's 4 KV heads): Mosaic refuses
    # it, "The last dim size is not 128 in original base memref" (v5e and v6e, jax 0.10.2).
    if head_dim != 128 and combined > 2:
        return False
    return block == q_heads or block % 8 == 0


@functools.cache
def padded_kv_heads(num_kv_heads: int, dtype) -> int:
    """The fewest KV heads >= num_kv_heads whose combined count (2x) JAX's kernel takes."""
    heads = num_kv_heads
    while True:
        try:
            jax_rpa.get_min_heads_per_blk(heads, 2 * heads, dtype, dtype)
            return heads
        except ValueError:  # "can not be XLA fully tiled"
            heads += 1


@contextlib.contextmanager
def compile_target(device):
    """Lower JAX's kernel (and Mosaic's device-dependent rules) for `device`, a TPU device of a
    libtpu topology, in a process whose jax.devices() are CPUs: an abstract mesh whose abstract
    device is that chip, which Mosaic's lowering (its tpu_info.get_device_kind) and this
    adapter's block-size lookup read instead of the default device. Scoped to the `with` block (a
    thread-local JAX context); not needed where the process runs on the TPU itself."""
    mesh = jax.sharding.AbstractMesh(
        (1,), ("compile_target",), abstract_device=jax.sharding.AbstractDevice(
            device_kind=device.device_kind, num_cores=device.num_cores, platform="tpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def target_device_kind() -> str:
    """The chip Mosaic lowers for: compile_target's abstract device, else the default device (as
    Mosaic's own lookup, jax._src.pallas.mosaic.tpu_info.get_device_kind, reads it)."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    return abstract.device_kind if abstract is not None else jax.devices()[0].device_kind


def block_sizes(q_dtype, kv_dtype, num_q_heads: int, num_kv_heads: int, head_dim: int,
                page_size: int, num_tokens: int, pages_per_seq: int) -> tuple[int, int]:
    """(KV pages, queries) per block from JAX's tuned table for the target chip (JAX's
    defaults where the table has no entry), clamped to the table width and token count."""
    kind = target_device_kind()
    if "TPU" not in kind:
        kind = _DEFAULT_KIND
    heads, combined = jax_rpa.get_min_heads_per_blk(num_q_heads, 2 * num_kv_heads, q_dtype,
                                                    kv_dtype)
    key = tuned.simplify_key((q_dtype, kv_dtype, heads, combined // 2, head_dim, page_size,
                              num_tokens, pages_per_seq))
    pages, queries = (32, 32) if kind.startswith("TPU v4") else (128, 32)
    pages, queries = tuned.TUNED_BLOCK_SIZES.get(" ".join(kind.split()[:2]), {}).get(
        key, (pages, queries))
    # Its double-buffered KV block within half of v5e's 16 MiB of scoped VMEM: 128 pages of 8
    # bf16 KV heads of dim 128 (an 8B at TP 1) take 16 MiB and fail to compile there.
    page_bytes = 2 * page_size * combined * head_dim * jnp.dtype(kv_dtype).itemsize
    pages = max(1, min(pages, _KV_BUFFER_BYTES // page_bytes))
    return min(pages_per_seq, pages), min(num_tokens, queries)


def ragged_paged_attention(
    q: jax.Array,  # f[T, Hq, D]
    kv_pages: jax.Array,  # f[N, B, 2 * Hkv', D], K and V interleaved; this step's KV written
    page_tables: jax.Array,  # i32[S, P]
    seq_lens: jax.Array,  # i32[S], KV length of each row after this step; 0 = padding row
    query_start: jax.Array,  # i32[S + 1]
    *,
    num_kv_heads: int,  # Hkv: the model's KV heads, the first Hkv of the pool's Hkv'
    sm_scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:  # f[T, Hq, D]; tokens past query_start[S] are unspecified (padding)
    """This package's ragged contract (`pallas_kernels.reference.ref_ragged_paged_attention`)
    on JAX's kernel. The query heads of the padded KV heads are zeros, dropped from the output.
    Every row is passed (num_seqs = S): padding rows have seq_len 0 and no queries."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, combined, _ = kv_pages.shape
    padded, group = combined // 2, num_q_heads // num_kv_heads
    if padded > num_kv_heads:
        q = q.reshape(num_tokens, num_kv_heads, group, head_dim)
        q = jnp.pad(q, ((0, 0), (0, padded - num_kv_heads), (0, 0), (0, 0)))
        q = q.reshape(num_tokens, padded * group, head_dim)
    pages, queries = block_sizes(q.dtype, kv_pages.dtype, padded * group, padded, head_dim,
                                 page_size, num_tokens, page_tables.shape[1])
    num_seqs = np.array([page_tables.shape[0]], np.int32)  # concrete: the reference reads it
    kernel = lambda *args: jax_rpa.ragged_paged_attention(  # noqa: E731 - num_seqs concrete
        *args, num_seqs, sm_scale=sm_scale, sliding_window=window, soft_cap=soft_cap,
        num_kv_pages_per_block=pages, num_queries_per_block=queries)
    # It declares no cost; ours from its reads: whole rows (it masks a window, reads all pages),
    # every combined head, once per (row, query block).
    cost = attention_cost(
        num_tokens=num_tokens, num_rows=page_tables.shape[0], block_q=queries,
        pages_read=page_tables.shape[1], page_size=page_size, num_q_heads=padded * group,
        kv_heads_read=padded, head_dim=head_dim, kv_itemsize=kv_pages.dtype.itemsize,
        q_itemsize=q.dtype.itemsize, soft_cap=soft_cap is not None)
    out = with_cost(kernel, cost)(q, kv_pages, seq_lens, page_tables, query_start)
    return out[:, :num_q_heads] if padded > num_kv_heads else out

