"""Orbax checkpoints of a LoadedModel.

Layout of the directory written by `save_orbax(path, loaded)`:
    path/jaxserve_model.json   config, fingerprint, source, format version
    path/tokenizer/            tokenizer.json + tokenizer_config.json
    path/params/               orbax PyTree checkpoint of the float32 params
The fingerprint is stored, so a model re-loaded from orbax keeps the fingerprint of the weights
it was saved from (the params are the same float32 arrays). A layer weight only some layers
have (a mixture of experts' experts, or its dense MLP among sparse layers: a LayerStack that
reads None at the others) is stored stacked over the layers that have it, which the JSON file
names (`layer_subsets`, format version 2).

`load_orbax(path, lazy=True)` leaves the params unread (OrbaxParams): the runner restores each
weight straight into its devices' sharding (each process reads only its devices' parts).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.weights.layer_stack import LayerStack

META_FILE = "jaxserve_model.json"
FORMAT_VERSION = 2  # 2: layer_subsets (1 had none: every layer weight in every layer)


def is_orbax_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_FILE))


def save_orbax(path: str, loaded) -> str:
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    params_dir = os.path.join(path, "params")
    if os.path.exists(params_dir):
        raise FileExistsError(f"{params_dir} already exists; save to a fresh directory")
    layers, subsets = _stored_layers(loaded.params["layers"])
    ckptr = ocp.PyTreeCheckpointer()
    ckptr.save(params_dir, {**loaded.params, "layers": layers})
    if hasattr(ckptr, "wait_until_finished"):
        ckptr.wait_until_finished()
    loaded.tokenizer.save(os.path.join(path, "tokenizer"))
    meta = {"format": "jaxserve-orbax", "version": FORMAT_VERSION,
            "config": dataclasses.asdict(loaded.config),
            "fingerprint": loaded.fingerprint, "saved_from": loaded.source,
            "layer_subsets": subsets}
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    return path


def _stored_layers(layers: dict) -> tuple[dict, dict]:
    """The loaders' stacked layer weights as stored, and {name: the layers it has} for each
    one that only some layers have (stored stacked over those). A lazy load's LayerStacks are
    read here, layer by layer."""
    stored, subsets = {}, {}
    for name, stack in layers.items():
        if isinstance(stack, np.ndarray):
            stored[name] = stack
            continue
        rows = [stack[i] for i in range(len(stack))]
        held = [i for i, row in enumerate(rows) if row is not None]
        if not held:  # (a lazy load's dense MLP of a model with no dense layer)
            continue
        stored[name] = np.stack([rows[i] for i in held])
        if len(held) < len(rows):
            subsets[name] = held
    return stored, subsets


def _to_numpy(tree, dtype):
    if isinstance(tree, dict):
        return {k: _to_numpy(v, dtype) for k, v in tree.items()}
    return np.asarray(tree, dtype=dtype)


class OrbaxParams:
    """The params of a checkpoint, not yet read: `restore` reads one weight into a sharding,
    `numpy` all of them onto the host (the loaders' layout, weights/__init__.py).
    layer_subsets: {layer weight: the layers that have it} where not every layer does (the
    weight is stored stacked over those only)."""

    def __init__(self, params_dir: str, dtype, num_layers: int,
                 layer_subsets: dict[str, tuple[int, ...]] | None = None):
        self.params_dir, self.dtype, self.num_layers = params_dir, dtype, num_layers
        self.layer_subsets = dict(layer_subsets or {})

    @functools.cached_property
    def shapes(self) -> dict[tuple[str, ...], tuple[int, ...]]:
        """The stored shape of every weight, by its keys (("layers", "wq"), ("embed",))."""
        import jax
        import orbax.checkpoint as ocp

        meta = ocp.PyTreeCheckpointer().metadata(self.params_dir)
        tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
        return {tuple(k.key for k in path): tuple(leaf.shape)
                for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}

    def restore(self, keys: tuple[str, ...], sharding, shape: tuple[int, ...], dtype=None):
        """The weight at params[keys[0]][keys[1]]... as a jax.Array placed by `sharding`, in
        `dtype` (default the load's)."""
        dtype = dtype or self.dtype
        import jax
        import orbax.checkpoint as ocp

        def nest(leaf):
            for key in reversed(keys):
                leaf = {key: leaf}
            return leaf

        item = nest(jax.ShapeDtypeStruct(shape, dtype))
        args = nest(ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype))
        tree = ocp.PyTreeCheckpointer().restore(
            self.params_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=args,
                                                         partial_restore=True))
        for key in keys:
            tree = tree[key]
        return tree

    def numpy(self) -> dict:
        import orbax.checkpoint as ocp

        params = _to_numpy(ocp.PyTreeCheckpointer().restore(self.params_dir), self.dtype)
        layers = params["layers"]
        for name, held in self.layer_subsets.items():  # None at the layers without it
            rows = dict(zip(held, layers[name]))
            layers[name] = LayerStack(
                [functools.partial(np.asarray, rows[i]) if i in rows else None
                 for i in range(self.num_layers)], (self.num_layers, *layers[name].shape[1:]),
                self.dtype)
        return params


def load_orbax(path: str, dtype=np.float32, lazy: bool = False):
    from jaxserve.tokenizer import Tokenizer
    from jaxserve.weights import LoadedModel

    path = os.path.abspath(path)
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    if meta.get("format") != "jaxserve-orbax":
        raise ValueError(f"{path}/{META_FILE} is not a jaxserve orbax checkpoint")
    if meta.get("version", 1) > FORMAT_VERSION:
        raise ValueError(f"{path} is a jaxserve orbax checkpoint of format version "
                         f"{meta['version']}; this jaxserve reads up to {FORMAT_VERSION}")
    cfg = dict(meta["config"])
    cfg["eos_token_ids"] = tuple(cfg.get("eos_token_ids", ()))
    if cfg.get("rope_scaling"):
        scaling = dict(cfg["rope_scaling"])
        if scaling.get("freq_factors") is not None:
            scaling["freq_factors"] = tuple(scaling["freq_factors"])
        cfg["rope_scaling"] = RopeScaling(**scaling)
    if cfg.get("layer_types") is not None:  # JSON lists -> the config's (hashable) tuples
        cfg["layer_types"] = tuple(cfg["layer_types"])
    config = ModelConfig(**cfg)
    subsets = {name: tuple(held) for name, held in meta.get("layer_subsets", {}).items()}
    params = OrbaxParams(os.path.join(path, "params"), dtype, config.num_layers, subsets)
    if not lazy:
        params = params.numpy()
    tokenizer = Tokenizer.from_hf_dir(os.path.join(path, "tokenizer"))
    return LoadedModel(config=config, params=params, tokenizer=tokenizer,
                       fingerprint=meta["fingerprint"], source=path)
