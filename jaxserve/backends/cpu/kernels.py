"""The CPU backend's C++ kernels, as XLA FFI custom calls:

  paged_attention     (paged_attention.cc) XLA's CPU lowering of paged attention gathers
                      every page into a new buffer before reading it; this reads pages in place
                      through the page table, so each key and value is read once. Pages of
                      float32, bfloat16, or int8 with per-token scales, widened as read.
  write_kv            (write_kv.cc) a step's keys and values into their slots, in place
                      (the pages are aliased), int8 quantized as written: one call a layer
                      where XLA's scatter and quantization compile to a dozen kernels.
  matmul_*            (matmul.cc) f32 and weight-only int8 matmuls against weights
                      packed in 48-column panels (`pack_panels`): a register-tiled GEMM that
                      streams each weight from memory once however many rows there are (a
                      decode step's few rows are bound by that stream), and for int8
                      applying the float16 group scales and offsets per group of 32 k
                      (one or two rows) or dequantizing the weights a panel at a time;
                      4-bit levels (GGUF Q4_1 blocks) two a byte (`pack_nibbles`), half
                      int8's bytes, with results equal to int8's.
  matmul_bf16         (matmul_bf16.cc) x rounded to bfloat16 times bfloat16 weights on AMX
                      tiles, f32 accumulation, against weights packed in 16-column tiles
                      (`pack_bf16_tiles`); `amx_bf16_available()` says whether this CPU and
                      kernel allow it.
  expert_matmul_*     (expert_matmul.cc) a mixture of experts' grouped matmul against each
                      expert's panels, the experts stacked: each group of rows times its
                      expert's weight, read in place, only the experts with rows read;
                      f32, int8 and 4-bit experts as the matmuls above (bf16 ones on AMX
                      tiles: matmul_bf16.cc).
  argmax              (argmax.cc) greedy sampling's max and index per row in one vectorised
                      read of the logits, rows in parallel, where XLA's top_k(x, 1) takes many
                      times as long.

The library is built at install (setup.py) or else on first use, by build.py (where, and the
key that says a build is current); `available()` says whether loading it worked, and
`unavailable_reason()` why not.
"""

from __future__ import annotations

import functools
import platform

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.backends.cpu import build
# The build's names that the tests and scripts reach through this module.
from jaxserve.backends.cpu.build import (HEADERS, NATIVE, SOURCES, STALE_DAYS,  # noqa: F401
                                         _prune, compile_command, compiler)

# FFI target name -> the handler symbol the sources export.
_TARGETS = {"jaxserve_paged_attention": "JaxservePagedAttention",
            "jaxserve_paged_attention_bf16": "JaxservePagedAttentionBf16",
            "jaxserve_paged_attention_int8": "JaxservePagedAttentionInt8",
            "jaxserve_write_kv": "JaxserveWriteKv",
            "jaxserve_write_kv_bf16": "JaxserveWriteKvBf16",
            "jaxserve_write_kv_int8": "JaxserveWriteKvInt8",
            "jaxserve_matmul_f32": "JaxserveMatmulF32",
            "jaxserve_matmul_int8": "JaxserveMatmulInt8",
            "jaxserve_matmul_int4": "JaxserveMatmulInt4",
            "jaxserve_matmul_bf16": "JaxserveMatmulBf16",
            "jaxserve_expert_matmul_f32": "JaxserveExpertMatmulF32",
            "jaxserve_expert_matmul_int8": "JaxserveExpertMatmulInt8",
            "jaxserve_expert_matmul_int4": "JaxserveExpertMatmulInt4",
            "jaxserve_expert_matmul_bf16": "JaxserveExpertMatmulBf16",
            "jaxserve_argmax": "JaxserveArgmax"}
PANEL = 48  # output columns per weight panel (matmul.cc's kPanel)
BF16_TILE, BF16_DEPTH = 16, 32  # output columns per bf16 weight tile, k per tile product



def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (avx512f, amx_bf16, ...); empty elsewhere."""
    line = build.cpu_features()
    return frozenset(line.split(":", 1)[1].split()) if line.startswith("flags") else frozenset()


def has_vector_path() -> bool:
    """Whether the kernels have a vector path for this CPU (x86-64 with AVX-512, or AVX2 with
    FMA); elsewhere they compile to portable C++ that is several times slower than XLA's dot."""
    flags = cpu_flags()
    return platform.machine() in ("x86_64", "AMD64") and (
        "avx512f" in flags or {"avx2", "fma"} <= flags)


_library = None


@functools.cache
def _load() -> str | None:
    """Finds or builds the library (build.library) and registers the kernels; returns None
    or why that failed."""
    import ctypes

    global _library
    try:
        library = ctypes.cdll.LoadLibrary(str(build.library()))
        for target, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                        platform="cpu")
        _library = library
    except (OSError, RuntimeError) as e:
        return str(e)
    return None


def available() -> bool:
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


@functools.cache
def amx_bf16_available() -> bool:
    """The kernels built with AMX-BF16 and Linux granted this process the tile state."""
    return _load() is None and bool(_library.JaxserveAmxBf16Available())


def _call(target: str, result, *args, aliases: dict | None = None, **attrs):
    """`result`: a jax.ShapeDtypeStruct, or a tuple of them for several outputs; aliases:
    {argument index: result index} of results written in place of their arguments."""
    reason = _load()
    if reason is not None:
        raise RuntimeError(f"CPU kernels unavailable: {reason}")
    return jax.ffi.ffi_call(target, result, input_output_aliases=aliases)(*args, **attrs)


def _f32(*shape) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


# The page dtypes paged_attention reads, and the FFI target of each.
_ATTENTION_TARGETS = {jnp.dtype(jnp.float32): "jaxserve_paged_attention",
                      jnp.dtype(jnp.bfloat16): "jaxserve_paged_attention_bf16",
                      jnp.dtype(jnp.int8): "jaxserve_paged_attention_int8"}


def paged_attention(q, k, v, page_tables, seq_lens, token_row, positions, *, sm_scale: float,
                    k_scale=None, v_scale=None, window: int | None = None,
                    soft_cap: float | None = None, sinks=None):
    """q f32[T, Hq, D]; k, v [Hkv, N, B, D] of float32 or bfloat16, or int8 with k_scale, v_scale
    f32[Hkv, N, B] (a key is k * k_scale[..., None]; kv_cache.quantize_kv); page_tables
    i32[S, P]; seq_lens i32[S]; token_row i32[T] (S or more: a padding token, output zeros);
    positions i32[T]. Token t attends positions j <= positions[t], j < seq_lens[token_row[t]]
    of its row (and j > positions[t] - window with a window; pages wholly before it are not
    read); soft_cap: scaled scores -> soft_cap * tanh(score / soft_cap); sinks f[Hq]: a logit
    per query head in the softmax's denominator (None: an empty buffer, no work).
    -> f32[T, Hq, D]. The pages are read in place in their dtype (never converted:
    that would copy the pool each call); any other dtype, or scales missing for int8 pages or
    given for float ones, is a ValueError. A row's seq_len over its table's P * B keys, or a
    page id outside [0, N) among the pages its keys occupy, fails the call (a JaxRuntimeError
    naming the row) instead of reading outside the pool."""
    target = _ATTENTION_TARGETS.get(jnp.dtype(k.dtype))
    if target is None or v.dtype != k.dtype:
        raise ValueError(f"paged_attention reads float32, bfloat16 or int8 pages (k and v alike), "
                         f"not k {k.dtype}, v {v.dtype}")
    scaled = k.dtype == jnp.int8
    if scaled != (k_scale is not None) or scaled != (v_scale is not None):
        raise ValueError("int8 pages need k_scale and v_scale [Hkv, N, B]; float pages take none")
    scales = ()
    if scaled:
        if k_scale.shape != k.shape[:3] or v_scale.shape != v.shape[:3]:
            raise ValueError(f"k_scale {k_scale.shape}, v_scale {v_scale.shape}: want "
                             f"{k.shape[:3]} ([Hkv, N, B] of k {k.shape})")
        scales = (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32))
    if sinks is not None and sinks.shape != q.shape[1:2]:
        raise ValueError(f"sinks must be f[Hq] with Hq = {q.shape[1]}, got {sinks.shape}")
    sinks = jnp.zeros((0,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return _call(target, _f32(*q.shape), q.astype(jnp.float32), k, v, *scales, i32(page_tables),
                 i32(seq_lens), i32(token_row), i32(positions), sinks,
                 sm_scale=np.float32(sm_scale),
                 window=np.int64(window or 0), soft_cap=np.float32(soft_cap or 0.0))


_WRITE_TARGETS = {jnp.dtype(jnp.float32): "jaxserve_write_kv",
                  jnp.dtype(jnp.bfloat16): "jaxserve_write_kv_bf16",
                  jnp.dtype(jnp.int8): "jaxserve_write_kv_int8"}


def write_kv(k_new, v_new, slots, k, v, k_scale=None, v_scale=None):
    """k_new, v_new f[T, Hkv, D] into pages k, v [Hkv, N, B, D] (float32, bfloat16, or int8
    with scales f32[Hkv, N, B]) at slots i32[T] (page * B + offset) -> the pages (and scales),
    written in place: they are the call's outputs, aliased to its inputs. A slot outside the
    pool fails the call (a JaxRuntimeError) before anything is written."""
    target = _WRITE_TARGETS.get(jnp.dtype(k.dtype))
    if target is None or v.dtype != k.dtype or (k.dtype == jnp.int8) != (k_scale is not None):
        raise ValueError(f"write_kv writes float32, bfloat16, or int8 pages with scales, not "
                         f"k {k.dtype}, v {v.dtype}")
    pages = (k, v) if k_scale is None else (k, v, k_scale, v_scale)
    first = 3  # the pages' argument index: after k_new, v_new, slots
    return _call(target, tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pages),
                 k_new.astype(jnp.float32), v_new.astype(jnp.float32),
                 jnp.asarray(slots, jnp.int32), *pages,
                 aliases={first + i: i for i in range(len(pages))})


def pack_panels(w_out_in: np.ndarray) -> np.ndarray:
    """A weight [N, K] ([out, in], any dtype) -> [ceil(N / 48), K, 48]: panel p holds output
    columns 48 p .. 48 p + 47, k-major, zero past N."""
    n, k = w_out_in.shape
    panels = -(-n // PANEL)
    padded = np.zeros((panels * PANEL, k), w_out_in.dtype)
    padded[:n] = w_out_in
    return np.ascontiguousarray(padded.reshape(panels, PANEL, k).transpose(0, 2, 1))


def pack_bf16_tiles(w_out_in: np.ndarray) -> np.ndarray:
    """A weight [N, K] ([out, in]) -> its bfloat16 bits u16[ceil(N / 16), Kp / 2, 16, 2] (Kp:
    K rounded up to 32), rounded to nearest even: element [t, i, c, j] is W[16 t + c, 2 i + j],
    zero past N and K (the pair layout AMX's TDPBF16PS reads)."""
    n, k = w_out_in.shape
    tiles, kp = -(-n // BF16_TILE), -(-k // BF16_DEPTH) * BF16_DEPTH
    padded = np.zeros((tiles * BF16_TILE, kp), jnp.bfloat16)
    padded[:n, :k] = np.asarray(w_out_in, np.float32).astype(jnp.bfloat16)
    bits = padded.view(np.uint16).reshape(tiles, BF16_TILE, kp // 2, 2)
    return np.ascontiguousarray(bits.transpose(0, 2, 1, 3))


def matmul_bf16(x, tiles, n: int):
    """bf16(x f32[M, K]) @ W for W [K, n] packed by `pack_bf16_tiles`, accumulated in f32 ->
    f32[M, n]. Needs amx_bf16_available()."""
    return _call("jaxserve_matmul_bf16", _f32(x.shape[0], n), x, tiles)


def matmul_f32(x, panels, n: int):
    """x f32[M, K] @ W, for W [K, n] packed by `pack_panels` -> f32[M, n]."""
    return _call("jaxserve_matmul_f32", _f32(x.shape[0], n), x, panels)


def matmul_int8(x, panels, scale, offset, n: int):
    """x f32[M, K] @ (Q * scale + offset) for Q i8[K, n] packed by `pack_panels`, and its scale
    and offset per 32 k of each column (f16[n, K / 32], quantize.py) packed the same way,
    dequantizing the weights inside the product -> f32[M, n]."""
    return _call("jaxserve_matmul_int8", _f32(x.shape[0], n), x, panels, scale, offset)


def pack_nibbles(panels: np.ndarray) -> np.ndarray:
    """Int8 panels [P, K, 48] of levels 0..15 (K even) -> u8[P, K / 2, 48], two k a byte:
    byte [p, i, c] = levels [p, 2 i, c] | levels [p, 2 i + 1, c] << 4."""
    q = np.asarray(panels)
    if q.shape[1] % 2 or q.min(initial=0) < 0 or q.max(initial=0) > 15:
        raise ValueError("pack_nibbles takes levels 0..15 over an even number of k")
    q = q.astype(np.uint8)
    return np.ascontiguousarray(q[:, 0::2] | q[:, 1::2] << 4)


def matmul_int4(x, nibbles, scale, offset, n: int):
    """matmul_int8 for levels 0..15 packed by `pack_nibbles` (half the bytes; equal results)."""
    return _call("jaxserve_matmul_int4", _f32(x.shape[0], n), x, nibbles, scale, offset)


def expert_matmul_f32(x, panels, group_sizes, n: int):
    """x f32[M, K] rows in groups (group e: the next group_sizes[e] rows; rows past the last
    group give 0) times expert e's W [K, n], the experts' weights packed by `pack_panels` and
    stacked f32[E, P, K, 48] -> f32[M, n]."""
    return _call("jaxserve_expert_matmul_f32", _f32(x.shape[0], n), x, panels,
                 jnp.asarray(group_sizes, jnp.int32))


def expert_matmul_int8(x, panels, scale, offset, group_sizes, n: int):
    """expert_matmul_f32 for int8 experts: levels i8[E, P, K, 48] (or, with 4-bit levels packed
    by `pack_nibbles`, u8[E, P, K / 2, 48]), scales and offsets f16[E, P, K / 32, 48]: each
    expert as matmul_int8's (matmul_int4's) weight, stacked."""
    target = ("jaxserve_expert_matmul_int4" if panels.dtype == jnp.uint8
              else "jaxserve_expert_matmul_int8")
    return _call(target, _f32(x.shape[0], n), x, panels, scale, offset,
                 jnp.asarray(group_sizes, jnp.int32))


def expert_matmul_bf16(x, tiles, group_sizes, n: int):
    """expert_matmul_f32 for bfloat16 experts, each packed by `pack_bf16_tiles` and stacked
    u16[E, T, Kp / 2, 16, 2], x rounded to bfloat16 (matmul_bf16's products). Needs
    amx_bf16_available()."""
    return _call("jaxserve_expert_matmul_bf16", _f32(x.shape[0], n), x, tiles,
                 jnp.asarray(group_sizes, jnp.int32))


def argmax(x):
    """x f32[R, V] -> (ids i32[R], max f32[R]): each row's maximum and its lowest index, as
    jax.lax.top_k(x, 1)."""
    rows = x.shape[0]
    return _call("jaxserve_argmax", (jax.ShapeDtypeStruct((rows,), jnp.int32), _f32(rows)),
                 x.astype(jnp.float32))
