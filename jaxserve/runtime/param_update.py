"""The step's params replaced in place (LLMEngine.update_weights): from named units converted as
the loaders convert them (weights/named_update.py), prepared and placed as at load
(params.prepare_layer / prepare_top, sharding.place_params); or from a tree in the step's own
layout (`abstract` gives its structure, shapes, dtypes and shardings), whose matching device
arrays are used as they are. Same shapes, dtypes and shardings as before, so the jitted step
finds its compiled code. Arrays a caller lent are never deleted here: they are the caller's."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh

from jaxserve.backends import Backend
from jaxserve.config import ModelConfig
from jaxserve.model import layer_scan
from jaxserve.runtime import custom_model, sharding
from jaxserve.runtime.params import cast_weight, prepare_layer, prepare_top
from jaxserve.weights.named_update import NamedUpdate


def abstract(params) -> dict:
    """The params' tree of jax.ShapeDtypeStruct, each with its array's sharding."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)


def from_units(update: NamedUpdate, current: dict | None, like: dict, cfg: ModelConfig,
               mesh: Mesh, backend: Backend, *, dtype, quantization: str, expert_parallel: bool,
               scan_layers: bool) -> dict:
    """`current` with the update's units replaced (a full update needs no `current`); a
    weight that comes out unlike `like` (abstract's: a shape the loader does not check) is
    refused, so the step never meets a new shape."""
    if custom_model.is_registered(cfg):
        raise ValueError("a registered model's weights are updated in its own layout "
                         "(params_like), not by checkpoint names")
    if not update.full and (current is None or scan_layers):
        raise ValueError("this update gives some units only and needs the rest in place: "
                         + ("the weights were released by sleep(level=2)" if current is None
                            else "with scan_layers the layers are stacked whole"))
    place = functools.partial(sharding.place_params, cfg=cfg, mesh=mesh,
                              to_dtype=functools.partial(cast_weight, dtype=dtype),
                              expert_parallel=expert_parallel)
    new = {} if current is None else {k: v for k, v in current.items() if k != "layers"}
    if update.top is not None:
        new.update(place(prepare_top(update.top, quantization, backend), []))
        new.pop("layers")
    layers = [None] * cfg.num_layers if current is None else list(current["layers"])
    for i, layer in update.layers.items():
        layers[i] = place({}, [prepare_layer(layer, quantization, backend)])["layers"][0]
    new["layers"] = (layer_scan.group_layers(layers, cfg, layer_scan.stack_on_device)
                     if scan_layers else layers)
    got, want = (jax.tree_util.tree_flatten_with_path(abstract(t)) for t in (new, like))
    for (path, a), (_, b) in zip(got[0], want[0]):
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            delete_unused(new, current, set())
            raise ValueError(f"weight {jax.tree_util.keystr(path)} came out {a.shape} "
                             f"{a.dtype}, not {b.shape} {b.dtype}: check the update's shapes")
    return new


def check_tree(tree, like) -> None:
    """ValueError unless `tree` has the structure and shapes of `like` (abstract's); nothing
    is placed, so an update can be refused before anything changes."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    want, want_def = jax.tree_util.tree_flatten_with_path(like)
    if treedef != want_def:
        paths = {jax.tree_util.keystr(p) for p, _ in leaves}
        wanted = {jax.tree_util.keystr(p) for p, _ in want}
        raise ValueError(f"the weights' tree differs from params_like(): missing "
                         f"{sorted(wanted - paths)[:5]}, unexpected {sorted(paths - wanted)[:5]}")
    for (path, x), (_, w) in zip(leaves, want):
        if tuple(getattr(x, "shape", ())) != tuple(w.shape):
            raise ValueError(f"weight {jax.tree_util.keystr(path)}: shape "
                             f"{getattr(x, 'shape', None)} != {w.shape}")


def from_tree(tree, like) -> tuple[dict, set[int]]:
    """A tree in the step's layout, checked against `like` (abstract's) -> (params, ids of the
    caller's arrays kept). A device array of the same shape, dtype and sharding is used as it
    is; another is put on the sharding (a host array in the dtype)."""
    check_tree(tree, like)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out, lent = [], set()
    for (path, x), w in zip(leaves, jax.tree_util.tree_leaves(like)):
        if isinstance(x, jax.Array) and x.dtype == w.dtype:
            x = x if x.sharding == w.sharding else jax.device_put(x, w.sharding)
            lent.add(id(x))  # (device_put may alias the caller's buffer)
        else:
            x = jax.device_put(np.asarray(x).astype(w.dtype, copy=False), w.sharding)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out), lent


def delete_unused(old, new, lent: set[int]) -> None:
    """Free the device buffers of `old` that `new` does not hold and no caller lent."""
    keep = {id(x) for x in jax.tree_util.tree_leaves(new)} | lent
    for x in jax.tree_util.tree_leaves(old):
        if isinstance(x, jax.Array) and id(x) not in keep and not x.is_deleted():
            x.delete()
