"""Devices for the runner: the ("dp", "tp") mesh, and tensor parallelism as a transformation of
the single-device model (Megatron-style: each device runs the model on its own heads and MLP
columns, and the two row-parallel projections of a layer are summed across devices).

Layout on a replica's tp devices (shard s of tp):
  w_qkv [F, H]    column-parallel, regrouped per shard: q heads s*Hq/tp.., then that shard's KV
                  heads (k, then v), so each device holds whole heads and the q heads' KV heads
  w_gate_up [2I, H] column-parallel, regrouped per shard: gate columns s*I/tp.., then the same
                  up columns
  wo [H, Hq*D], w_down [H, I]  row-parallel (input axis): each device's partial sums are added
                  by one all-reduce each (2 per layer)
  KV pool [Hkv', N, B, D] sharded on its head axis; with fewer KV heads than tp each KV head is
                  repeated tp / Hkv times (Hkv' = tp), so every device holds the one its q heads read
  embedding, LM head, norms  replicated: sharding the head over the vocabulary would move each
                  sampled row's logits (R x V floats a step, 12 MiB for 64 rows of SmolLM2) where the
                  hidden all-reduces move T x H; the price is V x H bytes per device
  page tables and all step metadata  replicated (page ids are global: the scheduler is unchanged)
  a mixture of experts' router [E, H] replicated; its experts_gate_up [E, H, 2I'] and
                  experts_down [E, I', H] replicated, or under expert parallelism
                  (`enable_expert_parallel`) sharded on the expert axis: each device holds E/tp
                  whole experts and the layer its expert_ids i32[E/tp] (model/moe.py), and the
                  sparse layer's output is summed by one all-reduce, as a dense layer's w_down

The model runs inside `shard_map` (`tensor_parallel_forward`), so the attention kernels (Pallas
included) see plain per-device arrays; under plain `jit` a Pallas call over a sharded pool is
gathered onto one device.

Weights reach the devices shard by shard, never whole on one: host arrays through
`place_params` (each device's buffer made from its own rows), an unread orbax checkpoint through
`restore_params` (restored into the shardings, fused on each device).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.backends import pool_layout
from jaxserve.config import ModelConfig, kv_heads_per_device
from jaxserve.core import kv_groups
from jaxserve.model import lora as model_lora
from jaxserve.model.quantize import GROUP

AXES = ("dp", "tp")
# Sharded on their output axis (0); sinks f[Hq] (gpt-oss) by query head as w_qkv's q rows.
_COLUMN = ("w_qkv", "b_qkv", "w_gate_up", "sinks")
_ROW = ("wo", "w_down")  # sharded on their input axis (1)
# Sharded on the expert axis (0) under expert parallelism (gpt-oss's expert biases too).
_EXPERTS = ("experts_gate_up", "experts_down", "expert_ids", "experts_gate_up_bias",
            "experts_down_bias")


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1, devices=None) -> Mesh:
    """The ("dp", "tp") mesh over the first dp * tp devices (of `devices`, default all)."""
    devices = list(jax.devices() if devices is None else devices)
    need = tensor_parallel_size * data_parallel_size
    if need > len(devices):
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} x data_parallel_size "
                         f"{data_parallel_size} needs {need} devices; this process has "
                         f"{len(devices)} ({devices[0].platform})")
    grid = np.array(devices[:need], dtype=object).reshape(data_parallel_size,
                                                          tensor_parallel_size)
    return Mesh(grid, AXES)


def replica_mesh(mesh: Mesh, replica: int) -> Mesh:
    """Data-parallel replica `replica`'s devices: a (1, tp) mesh, its row of `mesh`."""
    return Mesh(mesh.devices[replica:replica + 1], AXES)


def tp_size(mesh: Mesh) -> int:
    return mesh.shape["tp"]


def pool_kv_heads(cfg: ModelConfig, tp: int) -> int:
    """KV heads in the pool: the model's, or tp when there are fewer (each repeated)."""
    return kv_heads_per_device(cfg.num_kv_heads, tp) * tp


def pool_layout_of(cfg: ModelConfig, backend, tp: int, kv_dtype, q_dtype):
    """(KV heads the pool holds over all devices, one device's KVLayout): the backend's layout
    of each device's heads (JAX's TPU kernel pads them), the heads repeated up to tp."""
    heads = pool_kv_heads(cfg, tp)
    return heads, pool_layout(backend, heads // tp, cfg.head_dim, kv_dtype,
                              num_q_heads=cfg.num_heads // tp, q_dtype=q_dtype,
                              sinks=cfg.attention_sinks)


def pool_bytes_per_token(cfg: ModelConfig, backend, tp: int, kv_dtype, q_dtype,
                         dtype_bytes: int, scale_bytes: int) -> int:
    """One token's KV bytes as the pool stores them over all devices (padded and repeated
    heads included), so a byte budget buys the pages it pays for: of each layer group's
    layers (core/kv_groups.py; every layer for a model of one group)."""
    _, layout = pool_layout_of(cfg, backend, tp, kv_dtype, q_dtype)
    stored = layout.heads * tp
    slots = kv_groups.groups_of(cfg).size
    return (cfg.kv_bytes_per_token(dtype_bytes, scale_bytes) * stored // cfg.num_kv_heads
            * slots // cfg.num_layers)


def check_fits(cfg: ModelConfig, tp: int, quantization: str = "none",
               expert_parallel: bool = False) -> None:
    """A clear ValueError unless the model splits evenly over tp devices (an int8 weight's
    row-parallel shards into whole groups of GROUP inputs; under expert parallelism its
    experts into whole experts)."""
    if tp == 1:
        return
    if experts_sharded(cfg, tp, expert_parallel) and cfg.num_experts % tp:
        raise ValueError(f"enable_expert_parallel: tensor_parallel_size {tp} must divide the "
                         f"model's {cfg.num_experts} experts (each device holds whole experts)")
    if cfg.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the model's {cfg.num_heads} "
                         "query heads")
    kv_heads_per_device(cfg.num_kv_heads, tp)
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide the MLP's "
                         f"{cfg.intermediate_size} intermediate columns")
    rows = {"wo": cfg.num_heads * cfg.head_dim // tp, "w_down": cfg.intermediate_size // tp}
    for name, n in rows.items():
        if quantization == "int8" and n % GROUP:
            raise ValueError(f"quantization='int8' at tensor_parallel_size {tp} splits {name}'s "
                             f"inputs into {n} per device, not whole groups of {GROUP}")


def experts_sharded(cfg: ModelConfig, tp: int, expert_parallel: bool) -> bool:
    """Whether the experts are spread over the tp devices: expert parallelism asked, a
    mixture of experts, several devices."""
    return bool(expert_parallel and cfg.num_experts and tp > 1)


def with_expert_ids(layer: dict, cfg: ModelConfig) -> dict:
    """A sparse layer (one with a router) gains expert_ids i32[E], sharded with its experts so
    that each device's slice names the experts it holds (model/moe.py); others unchanged."""
    if "router" not in layer:
        return layer
    return {**layer, "expert_ids": np.arange(cfg.num_experts, dtype=np.int32)}


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """What one device's part of the model looks like to the model code."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp,
                               num_kv_heads=pool_kv_heads(cfg, tp) // tp,
                               intermediate_size=cfg.intermediate_size // tp)


def _qkv_shard(w, cfg: ModelConfig, tp: int, s: int) -> np.ndarray:
    """Shard s of w [F, ...] (F = (Hq + 2 Hkv) D rows; a weight, bias or int8 field): its q
    heads, then the KV heads they read (k, then v; repeated up to pool_kv_heads)."""
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q, k, v = np.split(w, [hq * d, (hq + hkv) * d])
    n, pool = hq // tp, pool_kv_heads(cfg, tp)
    per_device = pool // tp
    kv = [(s * per_device + j) * hkv // pool for j in range(per_device)]  # pool head -> model's

    def rows(x, heads):
        return np.concatenate([x[h * d:(h + 1) * d] for h in heads])

    return np.concatenate([q[s * n * d:(s + 1) * n * d], rows(k, kv), rows(v, kv)])


def _gate_up_shard(w, tp: int, s: int) -> np.ndarray:
    """Shard s of w [2I, ...]: its gate columns, then the same up columns."""
    gate, up = np.split(w, 2)
    m = gate.shape[0] // tp
    return np.concatenate([gate[s * m:(s + 1) * m], up[s * m:(s + 1) * m]])


def _name(path) -> str | None:
    """The layer-weight name a leaf belongs to (an Int8Weight's fields included)."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return keys[-1] if keys else None


def _spec(path, leaf, experts: bool = False) -> P:
    """experts: the experts are sharded (expert parallelism)."""
    name = _name(path)
    spec = (P("tp") if name in _COLUMN or (experts and name in _EXPERTS) else
            P(None, "tp") if name in _ROW else P())
    # scan_layers' stacked weights (model/layer_scan.py) lead with an unsharded layer axis
    return P(None, *spec) if any(getattr(k, "key", None) == "stacked" for k in path) else spec


def param_specs(params) -> dict:
    """The PartitionSpec of every leaf of the execution-layout params (the experts sharded
    where the layers hold expert_ids: with_expert_ids)."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    experts = any(_name(path) == "expert_ids" for path, _ in leaves)
    return jax.tree_util.tree_map_with_path(functools.partial(_spec, experts=experts), params)


def place_params(top: dict, layers, cfg: ModelConfig, mesh: Mesh, to_dtype,
                 expert_parallel: bool = False) -> dict:
    """Execution-layout host params -> device arrays on `mesh`: the leaves outside the layers
    (`top`), then `layers` (an iterable: the runner makes them one at a time). Each leaf is cast
    by to_dtype, then each device's buffer is made from its own rows only (a column-parallel
    leaf regrouped shard by shard), so no device, and no host buffer beyond that one tensor,
    holds a whole regrouped weight; with several processes each builds only its devices'
    shards. expert_parallel: each device holds only its experts (with_expert_ids)."""
    tp = tp_size(mesh)
    experts = experts_sharded(cfg, tp, expert_parallel)

    def place(path, x):
        x, name, spec = to_dtype(x), _name(path), _spec(path, None, experts)
        shape, shard = x.shape, x.__getitem__
        if tp > 1 and name in ("w_qkv", "b_qkv", "w_gate_up"):
            regroup = (functools.partial(_qkv_shard, x, cfg, tp) if name != "w_gate_up"
                       else functools.partial(_gate_up_shard, x, tp))
            rows = len(regroup(0))  # more than x's / tp where KV heads are repeated
            shape = (rows * tp, *x.shape[1:])

            def shard(index):  # index[0] is shard s's rows of the regrouped weight
                return regroup((index[0].start or 0) // rows)[(slice(None),) + tuple(index[1:])]

        return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), shard)

    placed = jax.tree_util.tree_map_with_path(place, top)
    placed["layers"] = [jax.tree_util.tree_map_with_path(
        place, with_expert_ids(lp, cfg) if experts else lp) for lp in layers]
    return placed


def pool_specs(pool):
    """Every array of the KV pool on its layout's head axis (the cache's HEAD_AXIS: head-major
    pages [Hkv', N, B, D] and int8 scales [Hkv', N, B] on axis 0, page-major [N, B, 2Hkv', D]
    on axis 2, each shard holding its heads' K and V); `pool` may be abstract."""
    return type(pool)(tuple(
        jax.tree_util.tree_map(  # int8 scale rows [N, L]: their lanes, head by head
            lambda x, a=cache.HEAD_AXIS: P(*[None] * min(a, len(x.shape) - 1), "tp"), cache)
        for cache in pool.layers))


def pool_sharding(mesh: Mesh, pool=None):
    """pool_specs as NamedShardings on `mesh` (pool None: one head-major sharding for all)."""
    if pool is None:
        return NamedSharding(mesh, P("tp"))
    return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), pool_specs(pool),
                                  is_leaf=lambda x: isinstance(x, P))


def lora_specs(stack: list[dict]) -> list[dict]:
    """LoRA adapter stacks (model/lora.py: per layer {module: (A f[S, R, in], B f[S, R, out])})
    sharded as their projections: a column-parallel one's B on its output columns, a
    row-parallel one's A on its input rows (its partial deltas join the projection's sum)."""
    rows = ("o_proj", "down_proj")
    return [{m: (P(None, None, "tp"), P()) if m in rows else (P(), P(None, None, "tp"))
             for m in layer} for layer in stack]


def tensor_parallel_forward(forward, mesh: Mesh):
    """forward(params, pool, token_ids, md, sum_shards) -> (pool, hidden), the model on one
    device's shards, run on every device of the mesh; returns the same function of the sharded
    params and pool (sum_shards is the all-reduce over "tp"), and of LoRA adapters if given
    (model/lora.py's Adapters, sharded by lora_specs)."""
    def per_device(params, pool, token_ids, md, *lora):
        extra = {"lora": model_lora.Adapters(*lora)} if lora else {}
        return forward(params, pool, token_ids, md, lambda x: jax.lax.psum(x, "tp"), **extra)

    def run(params, pool, token_ids, md, lora=None):
        pool_spec = pool_specs(pool)
        adapters = () if lora is None else (lora.stack, lora.slots)
        specs = () if lora is None else (lora_specs(lora.stack), P())
        return jax.shard_map(per_device, mesh=mesh,
                             in_specs=(param_specs(params), pool_spec, P(), P(), *specs),
                             out_specs=(pool_spec, P()),
                             # The attention's loops and kernels are not written for JAX's
                             # varying-axis checks; the hidden output is replicated by psum.
                             check_vma=False)(params, pool, token_ids, md, *adapters)

    return run


# Execution-layout leaves of a layer made of several of the loaders' stacked weights (fused on
# their last axis: model/llama.py fuse_layer, model/moe.py fuse_experts); every other layer
# weight is its one loader weight.
_GROUPS = {"w_qkv": ("wq", "wk", "wv"), "b_qkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up"),
           "experts_gate_up": ("experts_gate", "experts_up"),
           "experts_gate_up_bias": ("experts_gate_bias", "experts_up_bias")}
_TRANSPOSED = ("w_qkv", "w_gate_up", "wo", "w_down", "router")  # loaders' [in, out] -> [out, in]


def restore_params(source, cfg: ModelConfig, mesh: Mesh, dtype,
                   expert_parallel: bool = False) -> dict:
    """An unread checkpoint (weights.orbax_io.OrbaxParams) -> the execution-layout params on
    `mesh`, as place_params makes them, without a host copy: each stacked weight is restored
    straight into the sharding that gives every device the columns (or rows, or experts) its
    shard is made of (a KV weight whole where its heads are repeated), then each layer's shard
    is fused on its own device. Device memory peaks at the shards plus one leaf's stacked
    weights. A weight only some layers have is stacked over those (source.layer_subsets)."""
    tp, shapes = tp_size(mesh), source.shapes
    d, hkv = cfg.head_dim, cfg.num_kv_heads
    repeated = hkv < tp
    experts = experts_sharded(cfg, tp, expert_parallel)

    def loader_spec(name: str, ndim: int) -> P:
        if name in ("wq", "w_gate", "w_up", "bq", "sinks") or (
                name in ("wk", "wv", "bk", "bv") and not repeated):
            return P(*[None] * (ndim - 1), "tp")  # output columns (sinks: query heads)
        if name in ("wo", "w_down"):
            return P(None, "tp", None)  # input rows
        if experts and name.startswith("experts_"):
            return P(None, "tp")  # the experts' axis, after the layers'
        return P()

    def restore(keys):
        spec = loader_spec(keys[-1], len(shapes[keys]))
        return source.restore(keys, NamedSharding(mesh, spec), shapes[keys], dtype), spec

    def per_device(name, ws, i):
        ws = [w[i] for w in ws]
        if name in ("w_qkv", "b_qkv") and repeated:  # this device's one KV head, of all k, v
            head = jax.lax.axis_index("tp") * hkv // tp
            ws[1:] = [jax.lax.dynamic_slice_in_dim(w, head * d, d, axis=-1) for w in ws[1:]]
        fused = jax.numpy.concatenate(ws, axis=-1) if len(ws) > 1 else ws[0]
        return fused.T if name in _TRANSPOSED else fused

    top = {k[0]: restore(k)[0] for k in shapes if k[0] != "layers"}
    if "lm_head" in top:
        top["lm_head"] = jax.jit(lambda w: w.T)(top["lm_head"])
    stored = {k[1] for k in shapes if k[0] == "layers"}
    parts_of = {name: (name,) for name in stored - {p for ps in _GROUPS.values() for p in ps}}
    parts_of |= {name: parts for name, parts in _GROUPS.items() if parts[0] in stored}
    layers = [{} for _ in range(cfg.num_layers)]
    for name, parts in parts_of.items():
        ws, specs = zip(*(restore(("layers", p)) for p in parts))
        fuse = jax.jit(jax.shard_map(functools.partial(per_device, name), mesh=mesh,
                                     in_specs=(list(specs), P()),
                                     out_specs=_spec([jax.tree_util.DictKey(name)], None,
                                                     experts),
                                     check_vma=False))
        held = source.layer_subsets.get(parts[0], range(cfg.num_layers))
        for j, i in enumerate(held):
            layers[i][name] = fuse(list(ws), np.int32(j))
        for w in ws:
            w.delete()
    if experts:  # each device's slice names the experts it holds (with_expert_ids)
        ids = np.arange(cfg.num_experts, dtype=np.int32)
        layers = [{**layer, "expert_ids": jax.make_array_from_callback(
                      ids.shape, NamedSharding(mesh, P("tp")), ids.__getitem__)}
                  if "router" in layer else layer for layer in layers]
    return {**top, "layers": layers}
