"""The runner's device arrays as abstract values (jax.ShapeDtypeStruct with their shardings), for
compiling the engine's calls for a target that holds no weights (`jaxserve compile`): the params
in the execution layout the runner places (params.prepare_params, sharding.place_params), the KV
pool as the runner makes it, and any host tree (a step batch) replicated over the mesh.

The params follow prepare_params's layout without reading or making a weight: per layer w_qkv
[F, H] (F = the q heads, then each shard's KV heads, repeated where fewer than tp; sharding.py),
wo [H, Hq*D], w_gate_up [2I, H], w_down [H, I] and the norms (biases, q/k norms, sandwich norms
where the model has them; a mixture of experts' sparse layer has router [E, H], experts_gate_up
[E, H, 2I'] and experts_down [E, I', H] instead of the MLP's, on every device, or under expert
parallelism sharded on E with their expert_ids i32[E]: model/moe.py, sharding.with_expert_ids);
outside the layers embed [V, H], final_norm [H] and lm_head [V, H] when untied or quantized.
int8 weights are quantize.Int8Weight(q_t i8[out, in], scale and offset f16[out, in / 32]; a
mixture's experts [E, out, in] and [E, out, in / 32]). A backend's pack_params (the CPU's
packed panels) is not modelled: the targets compiled this way are accelerators, where the
Pallas and XLA backends pack nothing.
tests/test_compile_command.py checks the tree against a real runner's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.backends import Backend
from jaxserve.config import ModelConfig
from jaxserve.core import kv_groups
from jaxserve.model import layer_scan
from jaxserve.model.kv_cache import KVPool
from jaxserve.model.quantize import GROUP, Int8Weight
from jaxserve.runtime import sharding
from jaxserve.runtime.params import JNP_DTYPES


def _weight(out: int, inp: int, dtype, quantization: str, experts: int = 0):
    """One [out, in] projection in the serving layout; with experts, a mixture's stack of them:
    float [E, in, out], int8 [E, out, in] (model/moe.py)."""
    if quantization == "int8":
        lead = (experts,) if experts else ()
        groups = (*lead, out, inp // GROUP)
        return Int8Weight(jax.ShapeDtypeStruct((*lead, out, inp), jnp.int8),
                          jax.ShapeDtypeStruct(groups, jnp.float16),
                          jax.ShapeDtypeStruct(groups, jnp.float16))
    if quantization != "none":  # bf16 is the CPU backend's (AMX panels), not modelled here
        raise ValueError(f"quantization {quantization!r} is not modelled for compile targets "
                         "(none or int8)")
    return jax.ShapeDtypeStruct((experts, inp, out) if experts else (out, inp), dtype)


def _qkv_rows(cfg: ModelConfig, tp: int) -> int:
    """Rows of the fused q/k/v projection over all tp shards (KV heads repeated up to tp)."""
    kv = sharding.pool_kv_heads(cfg, tp)
    return (cfg.num_heads + 2 * kv) * cfg.head_dim


def _layer(cfg: ModelConfig, tp: int, dtype, quantization: str, i: int,
           expert_parallel: bool = False) -> dict:
    """Layer i."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    vec = jax.ShapeDtypeStruct((h,), dtype)
    layer = {"attn_norm": vec, "mlp_norm": vec,
             "w_qkv": _weight(_qkv_rows(cfg, tp), h, dtype, quantization),
             "wo": _weight(h, cfg.num_heads * d, dtype, quantization),
             "w_gate_up": _weight(2 * inter, h, dtype, quantization),
             "w_down": _weight(h, inter, dtype, quantization)}
    if cfg.attention_bias:
        layer["b_qkv"] = jax.ShapeDtypeStruct((_qkv_rows(cfg, tp),), dtype)
    if cfg.qk_norm:
        layer["q_norm"] = layer["k_norm"] = jax.ShapeDtypeStruct((d,), dtype)
    if cfg.sandwich_norms:
        layer["post_attn_norm"] = layer["post_mlp_norm"] = vec
    if cfg.layer_is_sparse(i):
        e, m = cfg.num_experts, cfg.moe_intermediate_size
        del layer["w_gate_up"], layer["w_down"]
        layer.update(router=jax.ShapeDtypeStruct((e, h), dtype),
                     experts_gate_up=_weight(2 * m, h, dtype, quantization, experts=e),
                     experts_down=_weight(h, m, dtype, quantization, experts=e))
        if sharding.experts_sharded(cfg, tp, expert_parallel):
            layer["expert_ids"] = jax.ShapeDtypeStruct((e,), jnp.int32)
    return layer


def _placed(tree, mesh: Mesh):
    """Each leaf of an execution-layout tree with the sharding place_params gives it."""
    specs = sharding.param_specs(tree)
    return jax.tree_util.tree_map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
        tree, specs)


def abstract_params(cfg: ModelConfig, mesh: Mesh, dtype: str, quantization: str = "none",
                    scan_layers: bool = False, expert_parallel: bool = False) -> dict:
    """The params the runner would place on `mesh` for `cfg` in `dtype` ("bfloat16", "float32",
    "float16") under `quantization`, as sharded ShapeDtypeStructs; with scan_layers stacked as
    model/layer_scan.py groups them; expert_parallel: the experts spread over the tp devices."""

    dt, tp = JNP_DTYPES[dtype], sharding.tp_size(mesh)
    h, v = cfg.hidden_size, cfg.vocab_size
    top = {"embed": jax.ShapeDtypeStruct((v, h), dt), "final_norm": jax.ShapeDtypeStruct((h,), dt)}
    if not cfg.tie_word_embeddings or quantization != "none":  # quantize_head's own copy
        top["lm_head"] = _weight(v, h, dt, quantization)
    top["layers"] = [_layer(cfg, tp, dt, quantization, i, expert_parallel)
                     for i in range(cfg.num_layers)]
    if scan_layers:
        top["layers"] = layer_scan.group_layers(
            top["layers"], cfg,
            lambda xs: jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype))
    return _placed(top, mesh)


def abstract_pool(cfg: ModelConfig, mesh: Mesh, num_pages: int, page_size: int, kv_dtype: str,
                  backend: Backend, dtype: str, scan_layers: bool = False) -> KVPool:
    """The runner's KV pool (reset_pool) of num_pages pages in the backend's layout, each
    array with its sharding over the mesh's tp devices (scan_layers: one cache of every
    layer's pages)."""

    tp = sharding.tp_size(mesh)
    heads, layout = sharding.pool_layout_of(cfg, backend, tp, JNP_DTYPES[kv_dtype],
                                            JNP_DTYPES[dtype])
    slots = kv_groups.groups_of(cfg).size  # layers of each group's pages
    layers, pages = (1, slots * num_pages) if scan_layers else (slots, num_pages)
    pool = jax.eval_shape(lambda: KVPool.zeros(layers, heads, pages, page_size,
                                               cfg.head_dim, JNP_DTYPES[kv_dtype], layout, tp))
    return jax.tree_util.tree_map(
        lambda x, placed: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed), pool,
        sharding.pool_sharding(mesh, pool))


def replicated(tree, mesh: Mesh):
    """A host tree (numpy leaves: a step batch, logit controls) as ShapeDtypeStructs replicated
    over the mesh, as the step's metadata is."""
    everywhere = NamedSharding(mesh, PartitionSpec())
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=everywhere),
        tree)


def bytes_per_device(tree) -> int:
    """Bytes one device holds of an abstract tree: each leaf's shard (its sharding's shard shape)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total
