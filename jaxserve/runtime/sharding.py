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

The model runs inside `shard_map` (`tensor_parallel_forward`), so the attention kernels (Pallas
included) see plain per-device arrays; under plain `jit` a Pallas call over a sharded pool is
gathered onto one device.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve.config import ModelConfig, kv_heads_per_device
from jaxserve.model.quantize import GROUP

AXES = ("dp", "tp")
_COLUMN = ("w_qkv", "b_qkv", "w_gate_up")  # sharded on their output axis (0)
_ROW = ("wo", "w_down")  # sharded on their input axis (1)


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


def check_fits(cfg: ModelConfig, tp: int, quantization: str = "none") -> None:
    """A clear ValueError unless the model splits evenly over tp devices (an int8 weight's
    row-parallel shards into whole groups of GROUP inputs)."""
    if tp == 1:
        return
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


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """What one device's part of the model looks like to the model code."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp,
                               num_kv_heads=pool_kv_heads(cfg, tp) // tp,
                               intermediate_size=cfg.intermediate_size // tp)


def _regroup_qkv(w, cfg: ModelConfig, tp: int):
    """w [F, ...] (F = (Hq + 2 Hkv) D rows; a weight, bias or int8 scale) -> the rows in shard
    order, KV heads repeated up to pool_kv_heads."""
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q, k, v = np.split(np.asarray(w), [hq * d, (hq + hkv) * d])
    rep = pool_kv_heads(cfg, tp) // hkv

    def heads(x, n, repeat=1):  # [n*D, ...] -> [tp, n*repeat*D/tp, ...]
        x = np.repeat(x.reshape(n, d, *x.shape[1:]), repeat, axis=0)
        return x.reshape(tp, -1, *x.shape[2:])

    return np.concatenate([heads(q, hq), heads(k, hkv, rep), heads(v, hkv, rep)], axis=1) \
        .reshape(-1, *q.shape[1:])


def _regroup_gate_up(w, tp: int):
    gate, up = np.split(np.asarray(w), 2)
    return np.concatenate([gate.reshape(tp, -1, *gate.shape[1:]),
                           up.reshape(tp, -1, *up.shape[1:])], axis=1).reshape(w.shape)


def _name(path) -> str | None:
    """The layer-weight name a leaf belongs to (an Int8Weight's fields included)."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return keys[-1] if keys else None


def _spec(path, leaf) -> P:
    name = _name(path)
    if name in _COLUMN:
        return P("tp")
    if name in _ROW:
        return P(None, "tp")
    return P()


def param_specs(params) -> dict:
    """The PartitionSpec of every leaf of the execution-layout params."""
    return jax.tree_util.tree_map_with_path(_spec, params)


def shard_params(params: dict, cfg: ModelConfig, mesh: Mesh, to_dtype) -> dict:
    """Execution-layout host params -> device arrays on `mesh`, each device given only its shard
    (regrouped per shard first when tp > 1). to_dtype(x) casts a host array for serving."""
    tp = tp_size(mesh)
    if tp > 1:

        def regroup(path, x):
            name = _name(path)
            if name in ("w_qkv", "b_qkv"):
                return _regroup_qkv(x, cfg, tp)
            if name == "w_gate_up":
                return _regroup_gate_up(x, tp)
            return x

        params = jax.tree_util.tree_map_with_path(regroup, params)
    specs = param_specs(params)
    return jax.tree_util.tree_map(
        lambda x, spec: jax.device_put(to_dtype(x), NamedSharding(mesh, spec)), params, specs)


def pool_sharding(mesh: Mesh) -> NamedSharding:
    """Every array of the KV pool (pages [Hkv', N, B, D], int8 scales [Hkv', N, B]) on its
    head axis."""
    return NamedSharding(mesh, P("tp"))


def tensor_parallel_forward(forward, mesh: Mesh):
    """forward(params, pool, token_ids, md, sum_shards) -> (pool, hidden), the model on one
    device's shards, run on every device of the mesh; returns the same function of the sharded
    params and pool (sum_shards is the all-reduce over "tp")."""
    def per_device(params, pool, token_ids, md):
        return forward(params, pool, token_ids, md, lambda x: jax.lax.psum(x, "tp"))

    def run(params, pool, token_ids, md):
        pool_spec = jax.tree_util.tree_map(lambda _: P("tp"), pool)
        return jax.shard_map(per_device, mesh=mesh,
                             in_specs=(param_specs(params), pool_spec, P(), P()),
                             out_specs=(pool_spec, P()),
                             # The attention's loops and kernels are not written for JAX's
                             # varying-axis checks; the hidden output is replicated by psum.
                             check_vma=False)(params, pool, token_ids, md)

    return run
