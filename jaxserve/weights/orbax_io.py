"""Orbax checkpoints of a LoadedModel.

Layout of the directory written by `save_orbax(path, loaded)`:
    path/jaxserve_model.json   config, fingerprint, source, format version
    path/tokenizer/            tokenizer.json + tokenizer_config.json
    path/params/               orbax PyTree checkpoint of the float32 params
The fingerprint is stored, so a model re-loaded from orbax keeps the fingerprint of the weights
it was saved from (the params are the same float32 arrays).
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


def load_orbax(path: str, dtype=np.float32):
    import orbax.checkpoint as ocp

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
    params = _to_numpy(ocp.PyTreeCheckpointer().restore(os.path.join(path, "params")), dtype)
    tokenizer = Tokenizer.from_hf_dir(os.path.join(path, "tokenizer"))
    return LoadedModel(config=config, params=params, tokenizer=tokenizer,
                       fingerprint=meta["fingerprint"], source=path)
