"""Weight-only int8 quantization with per-output-channel scales, applied to a clean float params
tree (the model code only sees {"q_t", "scale"} leaves through `llama.matmul`); and bfloat16
rounding of the same weights for the CPU backend's AMX matmul.

Weights are stored transposed, i8[..., out, in]: XLA's CPU backend converts an [out, in] int8
weight inside `x @ q_t.T` several times faster than an [in, out] one, and faster than a
mixed-dtype `dot_general` (docs/performance-history.md)."""

from __future__ import annotations

import numpy as np

_QUANTIZED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def quantize_weight(w: np.ndarray) -> dict:
    """w f[..., in, out] -> {"q_t": i8[..., out, in], "scale": f32[..., out]};
    w ~= swapaxes(q_t) * scale."""
    w = np.asarray(w, np.float32)
    scale = np.max(np.abs(w), axis=-2) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None, :]), -127, 127).astype(np.int8)
    return {"q_t": np.ascontiguousarray(np.swapaxes(q, -1, -2)), "scale": scale}


def quantize_int8(params: dict) -> dict:
    """Quantize the layer projections and the output head; embeddings and norms stay float.
    A tied head gets its own quantized copy (the embedding lookup keeps the float table)."""
    return _map_weights(params, quantize_weight)


def _map_weights(params: dict, fn) -> dict:
    """fn applied to the layer projections and to the output head ([in, out]; a tied model's
    is the embedding table, transposed, and gets its own copy: the lookup keeps the table)."""
    layers = {k: fn(v) if k in _QUANTIZED else v for k, v in params["layers"].items()}
    head = params["lm_head"] if "lm_head" in params else np.asarray(params["embed"]).T
    return {**params, "layers": layers, "lm_head": fn(head)}


def round_bf16(params: dict) -> dict:
    """The layer projections and the output head rounded to bfloat16 (nearest even); the CPU
    backend packs them for its AMX matmul, which rounds the activations it multiplies too.
    Embeddings and norms stay float; a tied head gets its own rounded copy."""
    from jax.numpy import bfloat16

    return _map_weights(params, lambda w: np.asarray(w, np.float32).astype(bfloat16))


def quantize(params: dict, method: str) -> dict:
    """The loaders' params under EngineConfig.quantization: "none", "int8" or "bf16"."""
    if method == "int8":
        return quantize_int8(params)
    if method == "bf16":
        return round_bf16(params)
    if method != "none":
        raise ValueError(f"unknown quantization {method!r}")
    return params
