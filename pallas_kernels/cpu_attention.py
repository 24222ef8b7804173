"""Paged attention for the CPU backend: a C++ XLA FFI custom call (cpu_paged_attention.cc).

XLA's CPU lowering of paged attention gathers every page into a new buffer before it reads it;
this kernel reads pages in place through the page table, so each key and value is read once.
The source is compiled with the machine's C++ compiler on first use (a few seconds) into
$XDG_CACHE_HOME/jaxserve/kernels (or ~/.cache), keyed by the source, the compiler flags, jaxlib's
version and the CPU's features; `available()` says whether that worked, and why not.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

_SOURCE = Path(__file__).with_name("cpu_paged_attention.cc")
_TARGET = "jaxserve_paged_attention"
# Associative math lets the compiler vectorise the dot products and sums over keys.
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
          "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math", "-ffp-contract=fast")


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _library_path() -> Path:
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), jax.__version__.encode(),
                 _cpu_features().encode()):
        key.update(part)
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "jaxserve" / "kernels" / f"cpu_paged_attention-{key.hexdigest()[:16]}.so"


def _build(path: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++/c++ or $CXX) to build the CPU attention kernel")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(_SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building the CPU attention kernel failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, path)  # atomic: a concurrent build of the same key is harmless
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _load() -> str | None:
    """Builds (once per cache key) and registers the kernel; returns None or why it failed."""
    import ctypes

    try:
        path = _library_path()
        if not path.exists():
            _build(path)
        library = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(library.JaxservePagedAttention),
                                    platform="cpu")
    except (OSError, RuntimeError) as e:
        return str(e)
    return None


def available() -> bool:
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


def cpu_paged_attention(q, k, v, page_tables, seq_lens, token_row, positions, *,
                        sm_scale: float):
    """q f32[T, Hq, D]; k, v f32[Hkv, N, B, D]; page_tables i32[S, P]; seq_lens i32[S];
    token_row i32[T] (S or more: a padding token, output zeros); positions i32[T]. Token t
    attends positions j <= positions[t], j < seq_lens[token_row[t]] of its row. -> f32[T, Hq, D]."""
    reason = _load()
    if reason is not None:
        raise RuntimeError(f"CPU attention kernel unavailable: {reason}")
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                i32(page_tables), i32(seq_lens), i32(token_row), i32(positions),
                sm_scale=np.float32(sm_scale))
