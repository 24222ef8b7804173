"""Llama-family decoder as pure functions of a params pytree: Llama, Mistral, Qwen2/3, SmolLM,
Gemma 1/2/3 (text) and the mixtures of experts Mixtral and Qwen3-MoE (model/moe.py) are options
of ModelConfig on this one model (sliding windows per layer,
q/k norm, GeGLU, scaled embeddings, RMSNorm with 1 + weight, norms around attention and MLP,
soft-capped scores and logits, separate rope bases for local layers).

Loaders stack layers on a leading axis (weights/__init__.py); the runner hands `forward` one
dict per layer (`per_layer_params`) and the layers run as an unrolled Python loop, or with
scan_layers stacked again and run by `lax.scan` (layer_scan.py): it compiles faster, but XLA's
CPU backend copies each layer's weight slice out of the stack before its matmul
(docs/serving.md and docs/performance-history.md have the measurements).

Params in the execution layout (weights stored [out, in], y = x @ W.T; F = (Hq + 2 Hkv) D):
  embed f[V, H]; final_norm f[H]; lm_head f[V, H] (absent when tied: the head is embed)
  layers: a list of L dicts: attn_norm f[H]; w_qkv f[F, H]; b_qkv f[F] (attention_bias only);
          wo f[H, Hq*D]; mlp_norm f[H]; w_gate_up f[2I, H]; w_down f[H, I]
          q_norm, k_norm f[D] (qk_norm only); post_attn_norm, post_mlp_norm f[H] (sandwich_norms
          only: Gemma 2/3's norms of the attention and MLP outputs before each residual add)
          bo f[H] (the output projection's bias) and sinks f[Hq] (attention_sinks): gpt-oss only
          a sparse layer (mixture of experts): router, experts_gate_up, experts_down
          (model/moe.py) in place of w_gate_up, w_down
A weight may instead be an int8 weight with group scales (quantize.Int8Weight), or a backend's
packed weight (jaxserve/backends/cpu/packing.py), either of which multiplies itself; a tied
embedding packed with the head looks up its own rows. Q, K, V and gate, up are fused into one
matmul each, so that one token's 7 matrix-vector products a layer are 4 larger ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.core import kv_groups
from jaxserve.model import attention, layer_scan, moe
from jaxserve.model.batch_invariant import by_row_tiles
from jaxserve.model.attention import AttentionMetadata
from jaxserve.model.kv_cache import KVCache, KVPool
from jaxserve.model.quantize import Int8Weight
from jaxserve.model.rope import apply_rope, rope_tables


def rms_norm(x, weight, eps, offset: float = 0.0):
    """Normalised in float32, scaled by (offset + weight) (Gemma stores weight - 1: offset 1)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def matmul(x, w):
    """x @ w.T for a float weight w [out, in]; any other weight (int8, or packed at load for a
    backend's matmul: jaxserve/backends/) multiplies itself."""
    if isinstance(w, (jax.Array, np.ndarray)):
        return x @ w.T
    return w.matmul(x)


def embed(params, token_ids):
    """token_ids i32[T] -> f[T, H]: rows of the embedding table (or of a tied head packed for a
    backend, which looks them up itself)."""
    table = params["embed"]
    if isinstance(table, (jax.Array, np.ndarray)):
        return table[token_ids]
    return table.embed(token_ids)


def _out_in(ws: list):
    """Loader weights f[in, out] (or Int8Weights, stored [out, in]) -> one [out, in] weight,
    the given ones concatenated along the output axis."""
    if isinstance(ws[0], Int8Weight):
        return Int8Weight.concat(ws)
    return np.ascontiguousarray(np.concatenate(ws, axis=-1).T)


def per_layer_params(params: dict) -> dict:
    """The loaders' layout (layers stacked {name: [L, ...]}, separate [in, out] projections,
    numpy) -> the layout `forward` runs: a list of L per-layer dicts of fused [out, in]
    projections, and an [out, in] lm_head. A backend may then pack the projections and the head
    for its matmul (Backend.pack_params)."""
    stacked = params["layers"]
    layers = [fuse_layer(layer_of(stacked, i)) for i in range(len(stacked["attn_norm"]))]
    return {**head_params(params), "layers": layers}


def layer_of(stacked: dict, i: int) -> dict:
    """Layer i of the loaders' stacked layers (an Int8Weight's fields sliced alike), without
    the weights it lacks (a stack that reads None there: a mixture of experts' dense layers
    have no experts, its sparse ones no dense MLP)."""
    layer = {k: jax.tree_util.tree_map(lambda x: x[i], v) for k, v in stacked.items()}
    return {k: jax.tree_util.tree_map(np.asarray, v) for k, v in layer.items() if v is not None}


def fuse_layer(lp: dict) -> dict:
    """One layer of the loaders' layout -> its execution layout (fused [out, in] projections)."""
    fused = {"attn_norm": lp["attn_norm"],
             "w_qkv": _out_in([lp["wq"], lp["wk"], lp["wv"]]),
             "wo": _out_in([lp["wo"]]), "mlp_norm": lp["mlp_norm"]}
    if "router" in lp:  # a sparse layer: its experts instead of the dense MLP
        fused.update(moe.fuse_experts(lp))
    else:
        fused.update(w_gate_up=_out_in([lp["w_gate"], lp["w_up"]]), w_down=_out_in([lp["w_down"]]))
    if "bq" in lp:
        fused["b_qkv"] = np.concatenate([lp["bq"], lp["bk"], lp["bv"]], axis=-1)
    for name in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm", "bo", "sinks"):
        if name in lp:
            fused[name] = lp[name]
    return fused


def head_params(params: dict) -> dict:
    """The loaders' leaves outside the layers in the execution layout (lm_head [out, in])."""
    out = {k: v for k, v in params.items() if k != "layers"}
    if "lm_head" in params:
        out["lm_head"] = _out_in([params["lm_head"]])
    return out


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def _qkv(cfg: ModelConfig, lp, x, rope, lora=None):
    """x f[T, H] -> q f[T, Hq, D], k, v f[T, Hkv, D], keys and queries rotated: per token.
    lora: the layer's adapters (model/lora.py), whose deltas each projection adds."""
    t, d = x.shape[0], cfg.head_dim
    hq, hkv = cfg.num_heads * d, cfg.num_kv_heads * d
    eps, offset = cfg.rms_norm_eps, cfg.norm_weight_offset
    h = rms_norm(x, lp["attn_norm"], eps, offset)
    qkv = matmul(h, lp["w_qkv"])
    if lora is not None:
        qkv = qkv + lora("w_qkv", h)
    if cfg.attention_bias:
        qkv = qkv + lp["b_qkv"]
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    q, k = q.reshape(t, cfg.num_heads, d), k.reshape(t, cfg.num_kv_heads, d)
    if cfg.qk_norm:
        q, k = rms_norm(q, lp["q_norm"], eps, offset), rms_norm(k, lp["k_norm"], eps, offset)
    cos, sin = rope
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.reshape(t, cfg.num_kv_heads, d)


def _out_mlp(cfg: ModelConfig, lp, x, o, sum_shards, lora=None):
    """The attention output o f[T, Hq, D] projected and added to x f[T, H], then the MLP:
    per token (a mixture's routing aside)."""
    eps, offset = cfg.rms_norm_eps, cfg.norm_weight_offset
    o = o.reshape(o.shape[0], -1)
    o = sum_shards(matmul(o, lp["wo"]) if lora is None else matmul(o, lp["wo"]) + lora("wo", o))
    if "bo" in lp:  # the output projection's bias (gpt-oss), once after the sum over devices
        o = o + lp["bo"]
    if cfg.sandwich_norms:
        o = rms_norm(o, lp["post_attn_norm"], eps, offset)
    x = x + o
    h = rms_norm(x, lp["mlp_norm"], eps, offset)
    act = jax.nn.silu if cfg.mlp_activation == "silu" else _gelu_tanh
    if "router" in lp:  # a sparse layer of a mixture of experts
        o = moe.sparse_mlp(cfg, h, lp, act, sum_shards)  # summed under expert parallelism
    else:
        gate_up = matmul(h, lp["w_gate_up"])
        if lora is not None:
            gate_up = gate_up + lora("w_gate_up", h)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        a = act(gate) * up
        o = sum_shards(matmul(a, lp["w_down"]) if lora is None
                       else matmul(a, lp["w_down"]) + lora("w_down", a))
    if cfg.sandwich_norms:
        o = rms_norm(o, lp["post_mlp_norm"], eps, offset)
    return x + o


def decoder_layer(cfg: ModelConfig, backend: attention.AttentionBackend, md: AttentionMetadata,
                  rope, window, x, cache: KVCache, lp, sum_shards, lora=None):
    """One layer of `forward` (x f[T, H] -> (x, cache)); also kv_smoothing's calibration. On a
    batch-invariant backend the per-token parts run in fixed row tiles, whole (transcendentals
    included: a vector loop's tail may round differently), model/batch_invariant.py; a
    tile is one call of the backend's matmul. lora: the layer's adapters (model/lora.py; not
    with a batch-invariant backend)."""
    if getattr(backend, "batch_invariant", False):
        q, k, v = by_row_tiles(lambda a: _qkv(cfg, lp, *a), (x, rope))
    else:
        q, k, v = _qkv(cfg, lp, x, rope, lora)
    cache = attention.write(backend, cache, k, v, md.slot_mapping)
    o = attention.attend(backend, q, cache, md, sm_scale=cfg.attention_scale, window=window,
                         soft_cap=cfg.attn_logit_softcapping, sinks=lp.get("sinks"))
    if getattr(backend, "batch_invariant", False):
        return by_row_tiles(lambda a: _out_mlp(cfg, lp, *a, sum_shards),
                            (x, o)), cache
    return _out_mlp(cfg, lp, x, o, sum_shards, lora), cache


def forward(params, pool: KVPool, token_ids, md: AttentionMetadata, sum_shards=None, *,
            cfg: ModelConfig, backend: attention.AttentionBackend, lora=None):
    """token_ids i32[T] -> (pool with this step's KV written, final hidden states f[T, H]).
    lora: the step's LoRA adapters (model/lora.py's Adapters; unrolled layers only), None: none.

    Under tensor parallelism (jaxserve/runtime/sharding.py) this runs on one device's shards:
    cfg counts that device's heads and MLP columns, and sum_shards(x) adds the partial outputs
    of the row-parallel projections (wo, w_down) across devices; None: one device."""
    sum_shards = sum_shards or (lambda x: x)
    def final_norm(x):
        norm = lambda a: rms_norm(a, params["final_norm"], cfg.rms_norm_eps,  # noqa: E731
                                  cfg.norm_weight_offset)
        return by_row_tiles(norm, x) if getattr(backend, "batch_invariant", False) else norm(x)

    x = embed(params, token_ids)
    if cfg.embed_scale:  # sqrt(hidden) rounded to the model dtype first, as Gemma's reference
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)
    tables = rope_tables
    if getattr(backend, "batch_invariant", False):  # cos and sin in fixed row tiles
        tables = lambda pos, *a: by_row_tiles(lambda p: rope_tables(p, *a), pos)  # noqa: E731
    rope = tables(md.positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    local_rope = rope
    if cfg.rope_local_theta is not None:  # sliding layers' own base, unscaled (Gemma 3)
        local_rope = tables(md.positions, cfg.head_dim, cfg.rope_local_theta)

    if layer_scan.is_scanned(params):  # scan_layers: stacked weights, one pool of all pages
        if lora is not None:
            raise ValueError("LoRA adapters run on unrolled layers only (scan_layers off)")
        pool, x = layer_scan.run_layers(
            params, pool, x, md, cfg=cfg, rope_of=lambda w: rope if w is None else local_rope,
            layer=lambda md, w, r, x, c, lp: decoder_layer(cfg, backend, md, r, w, x, c, lp,
                                                           sum_shards))
        return pool, final_norm(x)
    # Layer i reads and writes slot s of the pool through its group g's pages
    # (core/kv_groups.py); a model of one group: slot i, the plain metadata.
    groups = kv_groups.groups_of(cfg)
    if len(pool.layers) != groups.size:
        raise ValueError(f"a pool of {len(pool.layers)} layer slots for {groups.size}")
    caches = list(pool.layers)
    for i, lp in enumerate(params["layers"]):
        window = cfg.layer_window(i)  # static per layer: the loop is unrolled
        g, s = groups.slot_of[i]
        x, caches[s] = decoder_layer(cfg, backend, md.for_group(g),
                                     rope if window is None else local_rope, window, x,
                                     caches[s], lp, sum_shards,
                                     None if lora is None else lora.layer(i))
    return KVPool(tuple(caches)), final_norm(x)


def logits(params, hidden, cfg: ModelConfig, backend=None):
    """hidden f[R, H] -> f32 logits [R, V], soft-capped where the model is (Gemma 2). A tied
    model's head is the embedding table unless a separate (e.g. quantized) lm_head was added.
    backend: a batch-invariant one multiplies in fixed row tiles."""
    head = params["lm_head"] if "lm_head" in params else params["embed"]
    cap = cfg.final_logit_softcapping

    def rows(h):
        out = matmul(h, head).astype(jnp.float32)
        return out if cap is None else cap * jnp.tanh(out / cap)

    if getattr(backend, "batch_invariant", False):  # fixed row tiles (model/batch_invariant.py)
        return by_row_tiles(rows, hidden)
    return rows(hidden)
