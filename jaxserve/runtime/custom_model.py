"""A registered model (jaxserve.register_model, weights/custom.py) on the runner's mesh.

Its parameters are placed by their partition specs (an NNX module's nnx.with_partitioning
annotations, a function's partition rule) over the mesh's "tp" axis, and the model runs under
plain jit: XLA's SPMD partitioner splits its matmuls and adds the collectives its specs imply.
Only the attention is written per device: each layer's write and attention run inside
`shard_map` on each device's heads of q, k, v and of the pool (sharded on its head axis as the
built-in model's, KV heads repeated when there are fewer than tp), so every backend's kernels,
Pallas and the CPU's FFI included, see plain per-device arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.config import ModelConfig
from jaxserve.model import custom
from jaxserve.model.kv_cache import KVPool
from jaxserve.runtime import sharding
from jaxserve.weights.custom import RegisteredModel, lookup


def is_registered(cfg: ModelConfig) -> bool:
    return lookup(cfg.architecture) is not None


def _entry(cfg: ModelConfig) -> RegisteredModel:
    entry = lookup(cfg.architecture)
    if entry is None:
        raise ValueError(f"architecture {cfg.architecture!r} is not registered "
                         "(jaxserve.register_model)")
    return entry


def forward(cfg: ModelConfig, backend, mesh: Mesh):
    """(params, pool, token_ids, md) -> (pool, hidden) of the registered model on the mesh."""
    entry = _entry(cfg)
    tp = sharding.tp_size(mesh)
    attend = custom.attend_layer if tp == 1 else functools.partial(_attend_sharded, cfg, mesh)
    return functools.partial(custom.forward, cfg=cfg, backend=backend,
                             call=functools.partial(entry.call, cfg), attend=attend)


def _attend_sharded(cfg: ModelConfig, mesh: Mesh, cache, q, k, v, md, **options):
    """custom.attend_layer on each device's heads: q, k, v split on their head axis, the cache
    on its own (KV heads first repeated up to the pool's, as sharding.pool_kv_heads has it)."""
    repeat = sharding.pool_kv_heads(cfg, sharding.tp_size(mesh)) // cfg.num_kv_heads
    if repeat > 1:  # pool head j holds the model's head j // repeat
        k, v = jnp.repeat(k, repeat, axis=1), jnp.repeat(v, repeat, axis=1)
    (cache_spec,) = sharding.pool_specs(KVPool((cache,))).layers
    heads = P(None, "tp", None)
    return jax.shard_map(functools.partial(custom.attend_layer, **options), mesh=mesh,
                         in_specs=(cache_spec, heads, heads, heads, P()),
                         out_specs=(cache_spec, heads),
                         # the attention's loops and kernels are not written for JAX's
                         # varying-axis checks (as sharding.tensor_parallel_forward)
                         check_vma=False)(cache, q, k, v, md)


def place(params: dict, cfg: ModelConfig, mesh: Mesh, cast, quantization: str) -> dict:
    """The loader's host params ({"lm_head", "model"}) on the mesh: each leaf cast, then put
    by its partition spec; the head replicated (as the built-in model's)."""
    if quantization != "none":
        raise ValueError(f"quantization={quantization!r} is not supported for a registered "
                         f"model ({cfg.architecture!r}): its module does its own matmuls")
    if hasattr(params, "restore"):
        raise ValueError("a registered model loads from a Hugging Face directory")
    leaves, treedef = jax.tree_util.tree_flatten(params["model"])
    specs = _entry(cfg).partition_specs(params["model"])
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params["model"])[0]]
    placed = [jax.device_put(x, NamedSharding(mesh, _checked(spec, x.shape, path, mesh)))
              for x, spec, path in zip(map(cast, leaves), specs, paths, strict=True)]
    head = jax.device_put(cast(params["lm_head"]), NamedSharding(mesh, P()))
    return {"lm_head": head, "model": jax.tree_util.tree_unflatten(treedef, placed)}


def _checked(spec: P, shape: tuple, path, mesh: Mesh) -> P:
    """spec, or a ValueError naming the parameter where the mesh cannot split it so."""
    name = jax.tree_util.keystr(path)
    if len(spec) > len(shape):
        raise ValueError(f"parameter {name}: partition spec {spec} has more axes than its "
                         f"shape {shape}")
    for dim, axes in zip(shape, spec):
        axes = tuple(a for a in (axes if isinstance(axes, tuple) else (axes,)) if a is not None)
        unknown = [a for a in axes if a not in mesh.shape]
        if unknown:
            raise ValueError(f"parameter {name}: partition spec {spec} names mesh axis "
                             f"{unknown[0]!r}; the engine's mesh has {tuple(mesh.shape)}")
        devices = int(np.prod([mesh.shape[a] for a in axes]))
        if dim % devices:
            raise ValueError(f"parameter {name}: dimension {dim} does not split over "
                             f"{devices} devices of {axes}")
    return spec
