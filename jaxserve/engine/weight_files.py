"""An update's weights read from a path, for `update_weights` (the server's /update_weights,
docs/rl.md). Three kinds of path:

- a `.safetensors` file, or a directory of them (a Hugging Face checkpoint's; its config.json
  is not read): `(name, array)` in the checkpoint's names, memory-mapped as stored, which
  update_weights converts as the loaders convert;
- a jaxserve orbax checkpoint (`weights.save_orbax`: `jaxserve_model.json` + `params/`, the
  loaders' layout), given unit by unit as a converted update;
- an orbax PyTree checkpoint of a tree like `params_like()` (the engine's own layout, as a
  trainer saves it with orbax), restored straight into the engine's shardings.

Anything else, or a weight whose shape differs from the engine's, is a ValueError naming the
path and the weight; nothing is handed to the engine then. Runs off the engine's loop thread:
reading is the slow part."""

from __future__ import annotations

import os

import jax
import numpy as np

from jaxserve.weights.hf_loader import read_safetensors, safetensors_files
from jaxserve.weights.named_update import NamedUpdate
from jaxserve.weights.orbax_io import META_FILE, OrbaxParams, is_orbax_dir, load_orbax

# Files an orbax PyTree checkpoint directory holds (one of them, by orbax's version).
_ORBAX_MARKERS = ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt")


def read_update(path: str, like: dict, num_layers: int, dtype):
    """The weights at `path` for update_weights: a mapping of Hugging Face names, a NamedUpdate
    (jaxserve orbax), or a tree like `like` (params_like(), whose shardings it is restored
    into). dtype: the loaders' numpy dtype (a jaxserve orbax checkpoint's is read in it)."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise ValueError(f"no such file or directory: {path}")
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise ValueError(f"{path} is a file but not .safetensors: give a .safetensors file, "
                             "a directory of them or an orbax checkpoint directory")
        return read_safetensors(path, float_dtype=None)
    if is_orbax_dir(path):
        return _saved_model(path, num_layers, dtype)
    if any(os.path.exists(os.path.join(path, m)) for m in _ORBAX_MARKERS):
        return _engine_layout(path, like)
    files = safetensors_files(path)
    if not files:
        raise ValueError(f"{path} holds no *.safetensors, no {META_FILE} (jaxserve orbax) and "
                         "no orbax PyTree checkpoint")
    tensors = {}
    for file in files:
        tensors.update(read_safetensors(file, float_dtype=None))
    return tensors


def _saved_model(path: str, num_layers: int, dtype) -> NamedUpdate:
    """A save_orbax checkpoint's params, every unit of them (the loaders' layout)."""
    loaded = load_orbax(path, dtype, lazy=True)
    if loaded.config.num_layers != num_layers:
        raise ValueError(f"{path} holds a model of {loaded.config.num_layers} layers; the "
                         f"engine's has {num_layers}")
    params = loaded.params.numpy() if isinstance(loaded.params, OrbaxParams) else loaded.params
    layers = {i: {k: np.asarray(stack[i]) for k, stack in params["layers"].items()
                  if stack[i] is not None} for i in range(num_layers)}
    return NamedUpdate(layers, {k: v for k, v in params.items() if k != "layers"}, num_layers)


def _engine_layout(path: str, like: dict) -> dict:
    """An orbax PyTree checkpoint of params_like()'s structure and shapes, restored into its
    shardings and dtypes (orbax would pad or cut a weight of another shape: checked first)."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    meta = checkpointer.metadata(path)
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
    stored, wanted = _shapes(tree), _shapes(like)
    if set(stored) != set(wanted):
        raise ValueError(f"{path}: the checkpoint's tree differs from params_like(): missing "
                         f"{sorted(set(wanted) - set(stored))[:5]}, unexpected "
                         f"{sorted(set(stored) - set(wanted))[:5]}")
    for key, shape in wanted.items():
        if stored[key] != shape:
            raise ValueError(f"{path}: weight {key} has shape {stored[key]}, the engine's "
                             f"{shape}")
    restore_args = ocp.checkpoint_utils.construct_restore_args(like)
    return checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=like,
                                                                  restore_args=restore_args))


def _shapes(tree) -> dict[str, tuple[int, ...]]:
    """{"layers/0/wq": shape}: a leaf's path by its keys, indices and attribute names alike
    (orbax's metadata holds a list's items under indices, a node's fields under names)."""
    def name(entry) -> str:
        for attr in ("key", "idx", "name"):
            if hasattr(entry, attr):
                return str(getattr(entry, attr))
        return str(entry)

    return {"/".join(map(name, path)): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}
