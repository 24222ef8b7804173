"""The loaders' params -> the params the step runs, on a runner's devices: on the host, keys
smoothed for int8 KV pages (kv_smoothing.py), quantized, in the execution layout and packed for
the backend's matmul, one layer at a time as each is placed (sharding.place_params); an unread
orbax checkpoint restored straight into its shardings where none of that applies; a registered
model's (register_model) in its own layout (custom_model.place)."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.backends import Backend
from jaxserve.config import ModelConfig
from jaxserve.model import llama
from jaxserve.model.kv_smoothing import ALPHA, CALIBRATION_TOKENS, key_transforms, layer_smoother
from jaxserve.model.quantize import quantize_head, quantize_layer
from jaxserve.runtime import custom_model, sharding

JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
          "int8": jnp.int8}  # int8: KV pages only
_CALIBRATION_FORMAT = 1  # calibrated_turns' files: a change of kv_smoothing's math bumps it


def prepare_params(params: dict, quantization: str, backend: Backend,
                   smooth_keys_for: ModelConfig | None = None, fingerprint: str | None = None):
    """The loaders' params -> what the step runs, as host numpy: (the leaves outside the
    layers, an iterator of the layers), keys smoothed for int8 pages when smooth_keys_for
    gives the model's config (kv_smoothing.py; the calibration kept on disk by the weights'
    fingerprint: calibrated_turns), quantized, in the execution layout and packed for the
    backend's matmul. The layers are made one at a time as they are placed, so the host holds
    one beyond the loaders' copy (a lazy load's: none)."""
    stacked = params["layers"]
    turns = (calibrated_turns(params, smooth_keys_for, fingerprint)
             if smooth_keys_for is not None else None)
    smooth = layer_smoother(params, smooth_keys_for, turns)
    layers = (prepare_layer(smooth(i, llama.layer_of(stacked, i)), quantization, backend)
              for i in range(len(stacked["attn_norm"])))
    return prepare_top(params, quantization, backend), layers


def prepare_layer(layer: dict, quantization: str, backend: Backend) -> dict:
    """One layer of the loaders' layout (llama.layer_of) -> the step's: quantized, fused and
    packed for the backend."""
    pack = backend.pack_params or (lambda tree: tree)
    return pack({"layers": [llama.fuse_layer(quantize_layer(layer, quantization))]})["layers"][0]


def prepare_top(params: dict, quantization: str, backend: Backend) -> dict:
    """The loaders' leaves outside the layers -> the step's (the head quantized and packed)."""
    pack = backend.pack_params or (lambda tree: tree)
    top = pack({**llama.head_params(quantize_head(params, quantization)), "layers": []})
    return {k: v for k, v in top.items() if k != "layers"}


def calibrated_turns(params: dict, cfg: ModelConfig, fingerprint: str | None) -> list:
    """kv_smoothing.key_transforms of the model, read from $XDG_CACHE_HOME/jaxserve/kv_smoothing
    where an earlier load of the same weights (fingerprint, and the key projections' bytes,
    which an edit of the params under the same fingerprint changes), config and dtype
    calibrated them, else calibrated (a pass of the float model over CALIBRATION_TOKENS:
    seconds) and written there. No fingerprint: calibrated, not kept. A cache that cannot be read or written is
    passed by."""
    if fingerprint is None:
        return key_transforms(params, cfg)
    h = hashlib.sha256(repr((_CALIBRATION_FORMAT, fingerprint, cfg, str(params["embed"].dtype),
                             ALPHA, CALIBRATION_TOKENS)).encode())
    stacked = params["layers"]
    for i in range(len(stacked["attn_norm"])):  # params edited under the same fingerprint
        h.update(np.ascontiguousarray(stacked["wk"][i]).tobytes())
    key = h.hexdigest()[:24]
    path = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                        "jaxserve", "kv_smoothing", f"{key}.npz")
    try:
        with np.load(path) as kept:
            return [(kept[f"phi{i}"], kept[f"s{i}"]) for i in range(len(kept.files) // 2)]
    except (OSError, ValueError, KeyError):
        pass
    turns = key_transforms(params, cfg)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), suffix=".npz",
                                         delete=False) as f:
            np.savez(f, **{f"{name}{i}": a for i, turn in enumerate(turns)
                           for name, a in zip(("phi", "s"), turn)})
        os.replace(f.name, path)  # whole or not at all, for a concurrent reader
    except OSError as e:
        logging.debug("int8 KV calibration not kept in %s: %s", path, e)
    return turns


def cast_weight(x, dtype) -> np.ndarray:
    """A host weight in dtype; the int8 weights' float16 group scales and offsets (quantize.py)
    and integer arrays keep theirs."""
    x = np.asarray(x)
    keep = x.dtype == np.float16 or not jnp.issubdtype(x.dtype, jnp.floating)
    return x if keep else x.astype(dtype, copy=False)


def device_params(params, cfg: ModelConfig, mesh: Mesh, backend: Backend, *, dtype, kv_dtype,
                  quantization: str = "none", expert_parallel: bool = False,
                  fingerprint: str | None = None) -> dict:
    """The loaders' host params (or an unread orbax checkpoint, weights.orbax_io.OrbaxParams)
    on `mesh`, weights in `dtype`; kv_dtype: the pool's (int8 smooths the keys first, its
    calibration kept by `fingerprint`, the weights'); expert_parallel: the experts spread over
    the tp devices (sharding.place_params)."""
    cast = functools.partial(cast_weight, dtype=dtype)
    int8_kv = kv_dtype == jnp.int8
    if custom_model.is_registered(cfg):  # jaxserve.register_model's: its own layout
        return custom_model.place(params, cfg, mesh, cast, quantization)
    if hasattr(params, "restore"):
        # float weights are packed on the host only by the cpu backend (its panels)
        if quantization == "none" and backend.pack_params is None and not int8_kv:
            return sharding.restore_params(params, cfg, mesh, dtype, expert_parallel)
        params = params.numpy()
    return sharding.place_params(*prepare_params(
        params, quantization, backend, cfg if int8_kv else None, fingerprint), cfg, mesh, cast,
        expert_parallel)
