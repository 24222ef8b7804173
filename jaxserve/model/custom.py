"""A model registered from outside the tree (jaxserve.register_model) run over the paged pool.

The registered model is a call `(params, token_ids, metadata, attention) -> hidden` (an NNX
module's is made by weights/custom.py): it never sees pages. `metadata` is a StepMetadata (the
tokens' positions), `attention(layer, q, k, v)` writes the layer's keys and values into the pool
and returns the attention of q over the layer's pages, through the backend's attention as the
built-in model's layers do. The pool is threaded through the callable: each call replaces the
layer's cache, so the step stays `(params, pool, ...) -> (pool, hidden)` with the pool donated.
Because the callable keeps the pool between calls, a model calls it from its Python loop over
the layers (once per layer and step), not from inside a lax.scan of its own.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable

import jax

from jaxserve.config import ModelConfig
from jaxserve.model import attention as attn
from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.kv_cache import KVPool
from jaxserve.pytree import pytree_dataclass


@pytree_dataclass
class StepMetadata:
    """What a registered model learns of the step besides its tokens."""

    positions: jax.Array  # i32[T] position of each token in its sequence (padding: any)


def attend_layer(cache, q, k, v, md: AttentionMetadata, *, backend, sm_scale: float,
                 window: int | None, soft_cap: float | None):
    """One layer's write and attention on one device: (cache, q f[T, Hq, D], k, v f[T, Hkv, D])
    -> (cache with k, v at their slots, o f[T, Hq, D])."""
    cache = attn.write(backend, cache, k, v, md.slot_mapping)
    return cache, attn.attend(backend, q, cache, md, sm_scale, window=window, soft_cap=soft_cap)


def _pages(cache) -> int:
    return cache.kv.shape[0] if hasattr(cache, "kv") else cache.k.shape[1]


class PagedAttention:
    """The `attention` a registered model is given for one step; holds the pool it updates."""

    def __init__(self, pool: KVPool, md: AttentionMetadata, cfg: ModelConfig, backend,
                 attend: Callable):
        self.pool, self._md, self._cfg, self._backend, self._attend = pool, md, cfg, backend, attend
        # scan_layers' pool is one cache of every layer's pages, layer i's from page i * N on
        # (model/layer_scan.py); else one cache per layer.
        self._scanned = len(pool.layers) != cfg.num_layers
        self.calls = 0

    def __call__(self, layer: int, q, k, v, *, scale: float | None = None,
                 soft_cap: float | None = None):
        """q f[T, Hq, D], k and v f[T, Hkv, D] (rotary already applied) of layer `layer` ->
        f[T, Hq, D]: each token attends its sequence's keys up to its own position, this
        step's included. scale: of the scores (default D ** -0.5); soft_cap: scores become
        soft_cap * tanh(score / soft_cap)."""
        cfg = self._cfg
        try:  # static: it picks the layer's cache
            layer = operator.index(layer)
        except TypeError:
            layer = None
        if layer is None or not 0 <= layer < cfg.num_layers:
            raise ValueError(f"attention: layer must be a Python int in 0..{cfg.num_layers - 1}"
                             " (the model's layers)")
        want = {"q": (cfg.num_heads, cfg.head_dim), "k": (cfg.num_kv_heads, cfg.head_dim),
                "v": (cfg.num_kv_heads, cfg.head_dim)}
        for name, x in zip("qkv", (q, k, v)):
            if x.ndim != 3 or tuple(x.shape[1:]) != want[name] or x.shape[0] != self._tokens:
                raise ValueError(f"attention: {name} must be [{self._tokens}, {want[name][0]}, "
                                 f"{want[name][1]}] (tokens, heads, head dim), got {x.shape}")
        md, index = self._md, layer
        if self._scanned:
            (cache,) = self.pool.layers
            n, index = _pages(cache) // cfg.num_layers, 0
            md = dataclasses.replace(md, page_tables=md.page_tables + layer * n,
                                     slot_mapping=md.slot_mapping + layer * n * cache.page_size)
        cache, o = self._attend(self.pool.layers[index], q, k, v, md, backend=self._backend,
                                sm_scale=cfg.head_dim ** -0.5 if scale is None else scale,
                                window=cfg.layer_window(layer), soft_cap=soft_cap)
        layers = list(self.pool.layers)
        layers[index] = cache
        self.pool = KVPool(tuple(layers))
        self.calls += 1
        return o

    @property
    def _tokens(self) -> int:
        return self._md.positions.shape[0]


def forward(params, pool: KVPool, token_ids, md: AttentionMetadata, *, cfg: ModelConfig,
            backend, call: Callable, attend: Callable = attend_layer):
    """token_ids i32[T] -> (pool with this step's KV written, hidden f[T, H]) of a registered
    model: call(params["model"], token_ids, StepMetadata, attention) -> hidden. attend: one
    layer's write and attention (attend_layer's signature), replaced under tensor parallelism
    by one that runs it on each device's heads (runtime/custom_model.py)."""
    attention = PagedAttention(pool, md, cfg, backend, attend)
    hidden = call(params["model"], token_ids, StepMetadata(md.positions), attention)
    if attention.calls == 0:
        raise ValueError(f"the registered model {cfg.architecture!r} never called attention: "
                         "its keys and values would never reach the KV pool")
    t = token_ids.shape[0]
    if getattr(hidden, "shape", None) != (t, cfg.hidden_size):
        raise ValueError(f"the registered model {cfg.architecture!r} must return hidden states "
                         f"[{t}, {cfg.hidden_size}] (tokens, hidden size), got "
                         f"{getattr(hidden, 'shape', type(hidden).__name__)}")
    return attention.pool, hidden
