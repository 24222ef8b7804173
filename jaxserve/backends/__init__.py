"""Backends: a platform's choice of primitives under the one model.

A backend names what the model runs on a platform: its attention over the paged KV pool, the
layout its matmul wants the weights in (a transformation applied at load, as quantization is, so
the model code imports no backend), its greedy argmax, and the batch layout its attention reads.

  cpu      C++ XLA FFI kernels (jaxserve/backends/cpu/): paged attention reading pages in place,
           KV writes in place, f32/int8/bf16 matmuls over packed weights, argmax. x86-64 with AVX2+FMA or AVX-512.
  xla      plain jnp (jaxserve/backends/xla.py): any device; the fallback.
  pallas   the Pallas kernels of pallas_kernels/, one family per platform: gpu/ (Triton) compiled
           on a GPU, tpu/ (Mosaic) compiled on a TPU; on a CPU only when asked for (interpret
           mode, for tests and debugging; tpu/ unless pallas_kernels="gpu").

`resolve` turns a requested name ("auto" included) into the name of a backend that runs here, or
says why not. A resolved Pallas backend names its family and whether it interprets:
"pallas-gpu", "pallas-tpu", "pallas-tpu-interpret", "pallas-gpu-interpret".
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import jax

NAMES = ("cpu", "xla", "pallas")
PALLAS = ("pallas-gpu", "pallas-tpu", "pallas-gpu-interpret", "pallas-tpu-interpret")
log = logging.getLogger("jaxserve.backends")


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    # (q f[T, Hq, D], cache: the layout kv_layout names (KVCache: pages f[Hkv, N, B, D], or
    #  int8 with scales; PagedKV: f[N, B, 2*Hkv', D]),
    #  md: AttentionMetadata, *, sm_scale, window, soft_cap) -> f[T, Hq, D]: each token attends
    #  its row's pages causally (within the last `window` positions; scores soft-capped).
    attention: Callable
    # (cache: KVCache, k, v f[T, Hkv, D], slot_mapping i32[T]) -> the cache with each token's
    # key and value at its slot (kv_cache.write_kv's semantics); None: kv_cache.write_kv.
    write_kv: Callable | None = None
    # The KV pool's layout, this backend's choice: (KV heads per device, head dim, page dtype,
    # *, num_q_heads per device, q_dtype, sinks: the model has attention sinks) ->
    # kv_cache.KVLayout; None: head-major
    # [Hkv, N, B, D] (kv_cache.py).
    kv_layout: Callable | None = None
    # Prefill chunks start at multiples of this many tokens (see AttentionMetadata).
    query_block: int = 1
    # Decode rows packed back to back with the prefill chunks (runtime/batch.py): an attention
    # that treats every row alike needs no decode/prefill split.
    packed: bool = False
    # Params in the model's execution layout -> the same with weights packed for this backend's
    # matmul (objects with .matmul(x) and, for a tied head, .embed(ids)); None: unchanged.
    pack_params: Callable | None = None
    # logits f32[R, V] -> (ids i32[R], max f32[R]), lowest index among ties; None: lax.top_k.
    argmax: Callable | None = None
    # How many times longer a FLOP of this attention takes than a FLOP of the weight matmuls,
    # for prefill chunks deep into a long context (measured: docs/performance-history.md); the
    # scheduler weighs a chunk's context by it (SchedulerConfig.prefill_keys_per_token).
    attention_cost: float = 1.0
    # Reductions in an order that no batch shape changes (model/batch_invariant.py): see
    # batch_invariant().
    batch_invariant: bool = False


def pool_layout(backend: Backend, num_kv_heads: int, head_dim: int, dtype, *,
                num_q_heads: int, q_dtype, sinks: bool = False):
    """The backend's layout for a device's num_kv_heads (kv_cache.KVLayout); sinks: the model
    has attention sinks (a kernel without them must not be chosen)."""
    from jaxserve.model.kv_cache import KVLayout

    if backend.kv_layout is None:
        return KVLayout(num_kv_heads)
    return backend.kv_layout(num_kv_heads, head_dim, dtype, num_q_heads=num_q_heads,
                             q_dtype=q_dtype, sinks=sinks)


def get(name: str) -> Backend:
    if name == "cpu":
        from jaxserve.backends import cpu

        return cpu.BACKEND
    if name == "xla":
        from jaxserve.backends import xla

        return xla.BACKEND
    if name in PALLAS:
        from jaxserve.backends import pallas

        _, family, *interpret = name.split("-")
        return pallas.backend(family, interpret=bool(interpret))
    raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(NAMES)}")


def batch_invariant(backend: Backend, model_config=None, tensor_parallel_size: int = 1
                    ) -> Backend:
    """The backend under LoadConfig.batch_invariant: attention token by token in jnp
    (xla.invariant_attention, on the head-major pools of cpu and xla), the model's per-token
    parts (norms, matmuls, rope, activations) and the logsumexps in fixed row tiles. Other
    backends are refused: their kernels' orders are not made fixed here."""
    if backend.name not in ("cpu", "xla"):
        raise ValueError(f"batch_invariant is guaranteed on the cpu and xla backends only, not "
                         f"{backend.name!r}; choose attention_backend='xla' (or 'cpu')")
    if getattr(model_config, "num_experts", 0) or tensor_parallel_size > 1:
        raise ValueError("batch_invariant is not guaranteed for a mixture of experts (tokens "
                         "routed together) or tensor_parallel_size > 1 (sums across devices)")
    from jaxserve.backends import xla

    return dataclasses.replace(backend, attention=xla.invariant_attention, batch_invariant=True)


def resolve_dtype(dtype: str, platform: str | None = None) -> str:
    """"auto" -> bfloat16 on GPU and TPU (half the bytes per weight and KV slot; the kernels keep
    softmax statistics in float32), float32 on CPU (where f32 matmuls are the fast path).
    platform: the one to serve on (default this process's, jax.default_backend())."""
    if dtype != "auto":
        return dtype
    return "float32" if (platform or jax.default_backend()) == "cpu" else "bfloat16"


def resolve(name: str, dtype: str = "float32", quantization: str = "none", *,
            kv_cache_dtype: str | None = None, pallas_kernels: str = "auto",
            head_dim: int | None = None, page_size: int | None = None,
            tensor_parallel_size: int = 1, platform: str | None = None) -> str:
    """"auto" -> the Pallas kernels compiled for this device on TPU and GPU (on a GPU when the
    Triton kernels take the model's head dim and page size, else xla, logged); on CPU, the C++
    kernels for a float32 pool where they have a vector path (their portable fallback is far
    slower than XLA's dot) and build, else xla. An explicit name is checked against this
    machine: "cpu" may be asked for on any CPU; "pallas" on a CPU runs in interpret mode (for
    tests and debugging; logged), with the family `pallas_kernels` names (tpu by default).
    Interpret mode is never chosen on an accelerator. kv_cache_dtype: the pool's pages (None:
    dtype). platform: the one to serve on (default this process's; `jaxserve compile` resolves
    for a TPU topology from any host)."""
    from jaxserve.backends import cpu
    from jaxserve.backends.cpu import kernels

    kv = kv_cache_dtype or dtype
    platform = platform or jax.default_backend()
    on_cpu = platform == "cpu"
    device_family = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(platform)
    if pallas_kernels not in ("auto", "tpu", "gpu"):
        raise ValueError(f"pallas_kernels must be auto, tpu or gpu, got {pallas_kernels!r}")
    if name == "auto":
        if device_family == "gpu" and head_dim is not None and page_size is not None:
            from pallas_kernels import gpu

            try:
                gpu.check_supported(head_dim=head_dim, page_size=page_size, dtype=kv)
                name = "pallas"
            except ValueError as e:
                log.warning("the GPU Pallas kernels do not take this model (%s); serving with "
                            "attention_backend='xla'", e)
                name = "xla"
        elif device_family is not None:
            name = "pallas"
        elif not on_cpu:
            name = "xla"
        else:
            fast = kernels.has_vector_path() and kernels.available()
            takes = dtype == "float32" and kv in cpu.KV_CACHE_DTYPES
            name = "cpu" if takes and fast and tensor_parallel_size == 1 else "xla"
    if name == "pallas":
        name = _resolve_pallas(platform, device_family, pallas_kernels)
    get(name)  # unknown names fail here
    if name == "cpu":
        if tensor_parallel_size > 1:
            raise ValueError(f"attention_backend='cpu' runs on one device (its packed weights are "
                             f"not sharded); tensor_parallel_size {tensor_parallel_size} takes "
                             "attention_backend='xla' (or 'auto', which chooses it)")
        if not on_cpu or dtype != "float32" or kv not in cpu.KV_CACHE_DTYPES:
            raise ValueError(f"attention_backend='cpu' runs on the CPU with float32 weights and "
                             f"a KV pool of {' or '.join(cpu.KV_CACHE_DTYPES)} (this is "
                             f"{platform}, dtype {dtype}, kv_cache_dtype {kv}); "
                             "attention_backend='xla' takes any")
        if not kernels.available():
            raise ValueError(f"the CPU kernels are unavailable: {kernels.unavailable_reason()}")
    if quantization == "bf16":
        amx = kernels.amx_bf16_available()
        if name != "cpu" or not amx:
            raise ValueError(f"quantization='bf16' runs on the CPU backend with AMX-BF16 "
                             f"(backend {name!r}, AMX "
                             f"{'available' if amx else 'unavailable'}); on GPU or TPU use "
                             "dtype='bfloat16'")
    return name


def _resolve_pallas(platform: str, device_family: str | None, pallas_kernels: str) -> str:
    if device_family is not None:  # an accelerator: its own family, compiled
        if pallas_kernels not in ("auto", device_family):
            raise ValueError(f"pallas_kernels={pallas_kernels!r} cannot run compiled on "
                             f"{platform} (its kernels are {device_family!r}), and interpret "
                             "mode is never chosen on an accelerator")
        return f"pallas-{device_family}"
    if platform != "cpu":
        raise ValueError(f"attention_backend='pallas' has kernels for TPU and GPU; on {platform} "
                         "use attention_backend='xla' (or 'auto')")
    family = "tpu" if pallas_kernels == "auto" else pallas_kernels
    log.warning("attention_backend='pallas' on a CPU: the %s Pallas kernels run in interpret "
                "mode (a correctness tool, not a serving speed)", family)
    return f"pallas-{family}-interpret"
