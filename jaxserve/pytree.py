"""Frozen dataclasses registered as JAX pytrees: the per-step metadata (attention, sampling, the
batch) and the KV pool cross the jit boundary as these."""

from __future__ import annotations

import dataclasses

import jax


def pytree_dataclass(cls):
    """Frozen dataclass registered as a pytree; fields with metadata static=True are treated as
    compile-time constants (part of the jit cache key)."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    return jax.tree_util.register_dataclass(
        cls,
        data_fields=[f.name for f in fields if not f.metadata.get("static")],
        meta_fields=[f.name for f in fields if f.metadata.get("static")],
    )


def static_field(**kwargs):
    return dataclasses.field(metadata={"static": True}, **kwargs)
