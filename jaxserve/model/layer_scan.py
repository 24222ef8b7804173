"""The layers run by `jax.lax.scan` (EngineConfig scan_layers): the layer body is traced and
compiled once instead of once per layer, as MaxText trains.

Weights: the per-layer dicts stacked on a leading axis, grouped by the model's layer pattern.
Layers differ in their sliding window (and the rope base that follows it), which the attention
backends take as a compile-time constant, and in their weights' tree (a mixture of experts'
sparse and dense layers), so the scan runs blocks of `period` layers (the shortest repeat of
the pattern: 1 for Llama, 2 for Gemma 2, 6 for Gemma 3), each block's layers unrolled inside
the body; the layers past the last whole block run unrolled
after it. params["layers"] = {"stacked": (period dicts of leaves [blocks, ...]),
"rest": (per-layer dicts)}.

KV pool: every layer slot's pages in one cache of Lg * N pages (slot s's page p is page
s * N + p; Lg = L slots for a model of one layer group, core/kv_groups.py), stacked on the page
axis, not a new leading one: the scan carries the one buffer, and layer i (slot s of group g)
reads and writes it through group g's page tables and slots offset by s * N pages. No backend kernel
changes, no layer's pages are sliced out (a slice fed to a custom call is copied), writes stay
in place, and the head axis is where tensor parallelism shards it. Page 0 of each layer's range
is that layer's scratch page."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxserve.core import kv_groups
from jaxserve.model.kv_cache import KVPool


def period(cfg, layers: list | None = None) -> int:
    """The shortest p with layer i alike layer i % p for every layer: the same window, and of
    `layers` (per-layer trees) the same tree structure (a dense and a sparse MLP differ)."""
    kinds = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    if layers is not None:
        kinds = [(w, jax.tree_util.tree_structure(lp)) for w, lp in zip(kinds, layers)]
    return next(p for p in range(1, len(kinds) + 1)
                if all(k == kinds[i % p] for i, k in enumerate(kinds)))


def group_layers(layers: list, cfg, stack) -> dict:
    """A list of L per-layer trees -> the scanned layout; stack(list of leaves) -> one leaf
    [blocks, ...] (numpy, device or abstract). Each leaf is stacked, then the next, so a
    stack that frees its inputs holds one leaf twice at most."""
    p = period(cfg, layers)
    blocks = len(layers) // p
    stacked = []
    for j in range(p):
        group = layers[j:blocks * p:p]
        leaves = [jax.tree_util.tree_flatten(lp) for lp in group]
        treedef = leaves[0][1]
        columns = [stack([lv[k] for lv, _ in leaves]) for k in range(len(leaves[0][0]))]
        stacked.append(jax.tree_util.tree_unflatten(treedef, columns))
    return {"stacked": tuple(stacked), "rest": tuple(layers[blocks * p:])}


def stack_on_device(leaves: list) -> jax.Array:
    """One weight of several layers stacked on a new leading axis where they lie (their
    sharding, the layer axis unsharded); the per-layer arrays are freed."""
    spec = leaves[0].sharding.spec
    placed = NamedSharding(leaves[0].sharding.mesh, PartitionSpec(None, *spec))
    out = jax.jit(jnp.stack, out_shardings=placed)(leaves)
    for x in leaves:
        x.delete()
    return out


def is_scanned(params: dict) -> bool:
    return isinstance(params["layers"], dict)


def _pages(cache) -> int:
    """Pages in a cache, whatever its layout (head-major [Hkv, N, B, D] or page-major [N, ...])."""
    return cache.kv.shape[0] if hasattr(cache, "kv") else cache.k.shape[1]


def copy_pages(pool: KVPool, src, dst, num_layers: int) -> KVPool:
    """Copy-on-write in a scanned pool: page src[i] -> dst[i] in every layer slot's range
    (num_layers: the pool's slots, kv_groups.KVGroups.size)."""
    (cache,) = pool.layers
    n = _pages(cache) // num_layers
    offsets = n * jnp.arange(num_layers, dtype=jnp.int32)[:, None]
    return KVPool((cache.copy_pages((src[None] + offsets).reshape(-1),
                                    (dst[None] + offsets).reshape(-1)),))


def run_layers(params: dict, pool: KVPool, x, md, *, cfg, layer, rope_of):
    """x f[T, H] through every layer: layer(md, window, rope, x, cache, lp) -> (x, cache) is
    one decoder layer (md: that layer's metadata, rope: rope_of(window), its rope tables)."""
    (cache,) = pool.layers
    groups = kv_groups.groups_of(cfg)
    n = _pages(cache) // groups.size
    page_size = cache.page_size
    group_of, slot_of = (np.asarray(a, np.int32) for a in zip(*groups.slot_of))

    def run(i, j, x, cache, lp):
        """Layer i, position j of the window pattern."""
        if groups.num_groups == 1:  # slot i, the plain metadata
            shifted = dataclasses.replace(md, page_tables=md.page_tables + i * n,
                                          slot_mapping=md.slot_mapping + i * n * page_size)
        else:
            g, s = jnp.asarray(group_of)[i], jnp.asarray(slot_of)[i]
            mine = md.for_group(g)
            shifted = dataclasses.replace(mine, page_tables=mine.page_tables + s * n,
                                          slot_mapping=mine.slot_mapping + s * n * page_size)
        window = cfg.layer_window(j)
        return layer(shifted, window, rope_of(window), x, cache, lp)

    stacked, rest = params["layers"]["stacked"], params["layers"]["rest"]
    p = len(stacked)
    blocks = jax.tree_util.tree_leaves(stacked)[0].shape[0]

    def body(carry, xs):
        x, cache = carry
        b, block = xs
        for j, lp in enumerate(block):
            x, cache = run(b * p + j, j, x, cache, lp)
        return (x, cache), None

    ids = jnp.arange(blocks, dtype=jnp.int32)
    (x, cache), _ = jax.lax.scan(body, (x, cache), (ids, stacked))
    for r, lp in enumerate(rest):
        i = blocks * p + r
        x, cache = run(np.int32(i), i, x, cache, lp)
    return KVPool((cache,)), x
