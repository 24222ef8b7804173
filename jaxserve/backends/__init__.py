"""Backends: a platform's choice of primitives under the one model.

A backend names what the model runs on a platform: its attention over the paged KV pool, the
layout its matmul wants the weights in (a transformation applied at load, as quantization is, so
the model code imports no backend), its greedy argmax, and the batch layout its attention reads.

  cpu      C++ XLA FFI kernels (jaxserve/backends/cpu/): paged attention reading pages in place,
           f32/int8/bf16 matmuls over packed weights, argmax. x86-64 with AVX2+FMA or AVX-512.
  xla      plain jnp (jaxserve/backends/xla.py): any device; the fallback.
  pallas   the Pallas kernels (pallas_kernels/tpu/): compiled on TPU; on a CPU only when asked
           for (interpret mode, for tests); refused on a GPU.

`resolve` turns a requested name ("auto" included) into one that runs here, or says why not.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import jax

NAMES = ("cpu", "xla", "pallas")
log = logging.getLogger("jaxserve.backends")


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    # (q f[T, Hq, D], k_pages f[Hkv, N, B, D], v_pages f[Hkv, N, B, D], md: AttentionMetadata,
    #  *, sm_scale) -> f[T, Hq, D]: each token attends its row's pages causally.
    attention: Callable
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


def get(name: str) -> Backend:
    if name == "cpu":
        from jaxserve.backends import cpu

        return cpu.BACKEND
    if name == "xla":
        from jaxserve.backends import xla

        return xla.BACKEND
    if name == "pallas":
        from jaxserve.backends import pallas

        return pallas.BACKEND
    raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(NAMES)}")


def resolve(name: str, dtype: str = "float32", quantization: str = "none") -> str:
    """"auto" -> pallas on TPU (compiled by Mosaic); xla on GPU (the Pallas kernels are
    TPU-style: on a GPU they could only run in interpret mode, about 1000x too slow); on CPU,
    the C++ kernels for a float32 pool where they have a vector path (their portable fallback is
    far slower than XLA's dot) and build, else xla. An explicit name is checked against this
    machine: "cpu" may be asked for on any CPU, "pallas" on a CPU runs in interpret mode (for
    tests and debugging; logged) and is refused on a GPU."""
    from jaxserve.backends.cpu import kernels

    platform = jax.default_backend()
    on_cpu = platform == "cpu"
    if name == "auto":
        if platform == "tpu":
            name = "pallas"
        elif not on_cpu:
            name = "xla"
        else:
            fast = kernels.has_vector_path() and kernels.available()
            name = "cpu" if dtype == "float32" and fast else "xla"
    get(name)  # unknown names fail here
    if name == "pallas" and platform not in ("tpu", "cpu"):
        raise ValueError(f"attention_backend='pallas' has TPU kernels only, which would run in "
                         f"interpret mode on {platform} (far too slow to serve); use "
                         "attention_backend='xla' (or 'auto')")
    if name == "pallas" and on_cpu:
        log.warning("attention_backend='pallas' on a CPU: the Pallas kernels run in interpret "
                    "mode (a correctness tool, not a serving speed)")
    if name == "cpu":
        if not on_cpu or dtype != "float32":
            raise ValueError("attention_backend='cpu' runs on the CPU with a float32 KV pool "
                             f"(this is {jax.default_backend()}, {dtype})")
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
