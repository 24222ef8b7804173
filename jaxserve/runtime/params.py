"""The loaders' params -> the params the step runs, on a runner's devices: on the host, keys
smoothed for int8 KV pages (kv_smoothing.py), quantized, in the execution layout and packed for
the backend's matmul, one layer at a time as each is placed (sharding.place_params); an unread
orbax checkpoint restored straight into its shardings where none of that applies; a registered
model's (register_model) in its own layout (custom_model.place)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.backends import Backend
from jaxserve.config import ModelConfig
from jaxserve.model import llama
from jaxserve.model.kv_smoothing import layer_smoother
from jaxserve.model.quantize import quantize_head, quantize_layer
from jaxserve.runtime import custom_model, sharding

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
          "int8": jnp.int8}  # int8: KV pages only


def prepare_params(params: dict, quantization: str, backend: Backend,
                   smooth_keys_for: ModelConfig | None = None):
    """The loaders' params -> what the step runs, as host numpy: (the leaves outside the
    layers, an iterator of the layers), keys smoothed for int8 pages when smooth_keys_for
    gives the model's config (kv_smoothing.py), quantized, in the execution layout and packed
    for the backend's matmul. The layers are made one at a time as they are placed, so the
    host holds one beyond the loaders' copy (a lazy load's: none)."""
    pack = backend.pack_params or (lambda tree: tree)
    stacked = params["layers"]
    smooth = layer_smoother(params, smooth_keys_for)
    layers = (pack({"layers": [llama.fuse_layer(quantize_layer(
                  smooth(i, llama.layer_of(stacked, i)), quantization))]})["layers"][0]
              for i in range(len(stacked["attn_norm"])))
    top = pack({**llama.head_params(quantize_head(params, quantization)), "layers": []})
    return {k: v for k, v in top.items() if k != "layers"}, layers


def device_params(params, cfg: ModelConfig, mesh: Mesh, backend: Backend, *, dtype, kv_dtype,
                  quantization: str = "none", expert_parallel: bool = False) -> dict:
    """The loaders' host params (or an unread orbax checkpoint, weights.orbax_io.OrbaxParams)
    on `mesh`, weights in `dtype`; kv_dtype: the pool's (int8 smooths the keys first);
    expert_parallel: the experts spread over the tp devices (sharding.place_params)."""
    def cast(x) -> np.ndarray:
        """A host weight in dtype; the int8 weights' float16 group scales and offsets
        (quantize.py) and integer arrays keep theirs."""
        x = np.asarray(x)
        keep = x.dtype == np.float16 or not jnp.issubdtype(x.dtype, jnp.floating)
        return x if keep else x.astype(dtype, copy=False)

    int8_kv = kv_dtype == jnp.int8
    if custom_model.is_registered(cfg):  # jaxserve.register_model's: its own layout
        return custom_model.place(params, cfg, mesh, cast, quantization)
    if hasattr(params, "restore"):
        # float weights are packed on the host only by the cpu backend (its panels)
        if quantization == "none" and backend.pack_params is None and not int8_kv:
            return sharding.restore_params(params, cfg, mesh, dtype, expert_parallel)
        params = params.numpy()
    return sharding.place_params(*prepare_params(
        params, quantization, backend, cfg if int8_kv else None), cfg, mesh, cast,
        expert_parallel)
