"""Orbax checkpoints of a LoadedModel.

Layout of the directory written by `save_orbax(path, loaded)`:
    path/jaxserve_model.json   config, fingerprint, source, format version
    path/tokenizer/            tokenizer.json + tokenizer_config.json
    path/params/               orbax PyTree checkpoint of the float32 params
The fingerprint is stored, so a model re-loaded from orbax keeps the fingerprint of the weights
it was saved from (the params are the same float32 arrays).

`load_orbax(path, lazy=True)` leaves the params unread (OrbaxParams): the runner restores each
weight straight into its devices' sharding (each process reads only its devices' parts).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from jaxserve.config import ModelConfig, RopeScaling

META_FILE = "jaxserve_model.json"
FORMAT_VERSION = 1


def is_orbax_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_FILE))


def save_orbax(path: str, loaded) -> str:
    import orbax.checkpoint as ocp

    if loaded.config.num_experts:  # restore_params places no experts yet
        raise ValueError("saving a mixture of experts as an orbax checkpoint is not supported "
                         "yet: serve it from its Hugging Face directory")
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    params_dir = os.path.join(path, "params")
    if os.path.exists(params_dir):
        raise FileExistsError(f"{params_dir} already exists; save to a fresh directory")
    ckptr = ocp.PyTreeCheckpointer()
    ckptr.save(params_dir, loaded.params)
    if hasattr(ckptr, "wait_until_finished"):
        ckptr.wait_until_finished()
    loaded.tokenizer.save(os.path.join(path, "tokenizer"))
    meta = {"format": "jaxserve-orbax", "version": FORMAT_VERSION,
            "config": dataclasses.asdict(loaded.config),
            "fingerprint": loaded.fingerprint, "saved_from": loaded.source}
    with open(os.path.join(path, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    return path


def _to_numpy(tree, dtype):
    if isinstance(tree, dict):
        return {k: _to_numpy(v, dtype) for k, v in tree.items()}
    return np.asarray(tree, dtype=dtype)


class OrbaxParams:
    """The params of a checkpoint, not yet read: `restore` reads one weight into a sharding,
    `numpy` all of them onto the host (the loaders' layout, weights/__init__.py)."""

    def __init__(self, params_dir: str, dtype):
        self.params_dir, self.dtype = params_dir, dtype

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

        return _to_numpy(ocp.PyTreeCheckpointer().restore(self.params_dir), self.dtype)


def load_orbax(path: str, dtype=np.float32, lazy: bool = False):
    from jaxserve.tokenizer import Tokenizer
    from jaxserve.weights import LoadedModel

    path = os.path.abspath(path)
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    if meta.get("format") != "jaxserve-orbax":
        raise ValueError(f"{path}/{META_FILE} is not a jaxserve orbax checkpoint")
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
    params = OrbaxParams(os.path.join(path, "params"), dtype)
    if not lazy:
        params = params.numpy()
    tokenizer = Tokenizer.from_hf_dir(os.path.join(path, "tokenizer"))
    return LoadedModel(config=config, params=params, tokenizer=tokenizer,
                       fingerprint=meta["fingerprint"], source=path)
