"""Weight-only int8 quantization with per-output-channel scales, applied to a clean float params
tree (the model code only sees {"q", "scale"} leaves through `llama.matmul`)."""

from __future__ import annotations

import numpy as np

_QUANTIZED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def quantize_weight(w: np.ndarray) -> dict:
    """w f[..., in, out] -> {"q": i8[..., in, out], "scale": f32[..., out]}; w ~= q * scale."""
    w = np.asarray(w, np.float32)
    scale = np.max(np.abs(w), axis=-2) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.rint(w / scale[..., None, :]), -127, 127).astype(np.int8)
    return {"q": q, "scale": scale}


def quantize_int8(params: dict) -> dict:
    """Quantize the layer projections and the output head; embeddings and norms stay float.
    A tied head gets its own quantized copy (the embedding lookup keeps the float table). The
    head is stored [V, H] ("q_t"): measured on XLA CPU, an int8 [H, V] head dequantised at a
    single token ran 10x slower than f32, the [V, H] one 5x faster."""
    layers = {k: quantize_weight(v) if k in _QUANTIZED else v for k, v in params["layers"].items()}
    head = params["lm_head"] if "lm_head" in params else np.asarray(params["embed"]).T
    q = quantize_weight(head)
    return {**params, "layers": layers,
            "lm_head": {"q_t": np.ascontiguousarray(q["q"].T), "scale": q["scale"]}}
