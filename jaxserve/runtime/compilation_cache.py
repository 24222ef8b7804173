"""JAX's persistent compilation cache, as every runner uses it."""

from __future__ import annotations

import os

import jax


def use_compilation_cache() -> None:
    """Keep compiled steps on disk across processes (JAX's persistent compilation cache), in
    $XDG_CACHE_HOME/jaxserve/xla unless JAX_COMPILATION_CACHE_DIR already names a directory:
    the unrolled model compiles slowly and loads from the cache much faster."""
    if jax.config.jax_compilation_cache_dir is None:
        root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        jax.config.update("jax_compilation_cache_dir", os.path.join(root, "jaxserve", "xla"))
    # JAX caches only compiles over 1 s by default; the cpu backend's steps compile in under
    # a second each, so none would be kept.
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
