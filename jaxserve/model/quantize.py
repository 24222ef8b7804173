"""Weight-only int8 quantization with a scale and an offset per group of 32 input channels of each
output channel (Int8Weight, which multiplies itself), applied to a clean float params tree; and
bfloat16 rounding of the same weights for the CPU backend's AMX matmul.

Groups are GGUF's 32-element blocks, and each group maps its [min, max] onto 256 levels. A Q4_1
block (d * q + m, q in 0..15, its min at q = 0 and its max at q = 15 by construction) then
lands exactly on int8 levels, 17 apart (255 = 15 * 17): the default model is served without
loss beyond f32 rounding. A symmetric group (scale only) would need the block's 16 levels to
fall on multiples of absmax / 127, which they do not.

Weights are stored transposed, i8[..., out, in]: XLA's CPU backend converts an [out, in] int8
weight inside `x @ w.T` faster than an [in, out] one (docs/performance-history.md)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

_QUANTIZED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
GROUP = 32  # input channels per scale and offset: GGUF's block size


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q_t", "scale", "offset"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """W[in, out] as q_t i8[..., out, in], scale and offset f32[..., out, in / 32]:
    W[.., j, o] ~= q_t[.., o, j] * scale[.., o, j // 32] + offset[.., o, j // 32]."""
    q_t: np.ndarray
    scale: np.ndarray
    offset: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """[..., out, in], as a float weight's."""
        return self.q_t.shape

    def matmul(self, x):
        """x f[T, in] @ W -> f[T, out], dequantized group by group in x's dtype: XLA's CPU
        backend fuses that into a decode step's matrix-vector product (the f32 weight is never
        written), and at many rows the dequantized copy is reused by every row."""
        out, inp = self.q_t.shape
        g = self.q_t.reshape(out, inp // GROUP, GROUP).astype(x.dtype)
        g = g * self.scale[..., None].astype(x.dtype) + self.offset[..., None].astype(x.dtype)
        return x @ g.reshape(out, inp).T

    def dequantize(self) -> np.ndarray:
        """f32[..., out, in] (the stored, transposed layout)."""
        q = np.asarray(self.q_t, np.float32)
        g = q.reshape(*q.shape[:-1], -1, GROUP)
        return (g * self.scale[..., None] + self.offset[..., None]).reshape(q.shape)

    @staticmethod
    def concat(ws: list[Int8Weight]) -> Int8Weight:
        """Weights [out_i, in] concatenated along the output axis (fused projections)."""
        return Int8Weight(*(np.concatenate([getattr(w, f) for w in ws], axis=0)
                            for f in ("q_t", "scale", "offset")))


def quantize_weight(w: np.ndarray) -> Int8Weight:
    """w f[..., in, out] -> its Int8Weight: each group of 32 inputs of an output channel maps
    its [min, max] onto 256 levels, so every weight is within half a step ((max - min) / 510)."""
    w = np.asarray(w, np.float32)
    if w.shape[-2] % GROUP:
        raise ValueError(f"int8 quantization groups {GROUP} input channels; "
                         f"{w.shape[-2]} is not a multiple of {GROUP}")
    wt = np.swapaxes(w, -1, -2)
    g = wt.reshape(*wt.shape[:-1], -1, GROUP)  # [..., out, groups, 32]
    lo, hi = g.min(axis=-1), g.max(axis=-1)
    scale = ((hi - lo) / 255.0).astype(np.float32)
    step = np.where(scale == 0, 1.0, scale)[..., None]  # a constant group: every q is -128
    q = np.clip(np.rint((g - lo[..., None]) / step), 0, 255) - 128
    return Int8Weight(np.ascontiguousarray(q.astype(np.int8).reshape(wt.shape)), scale,
                      (lo + 128.0 * scale).astype(np.float32))


def _weight_fn(method: str):
    """The map of one [..., in, out] weight under EngineConfig.quantization (None: kept)."""
    if method == "int8":
        return quantize_weight
    if method == "bf16":
        # The CPU backend packs these for its AMX matmul, which rounds the activations it
        # multiplies too (nearest even).
        return lambda w: np.asarray(w, np.float32).astype(jnp.bfloat16)
    if method != "none":
        raise ValueError(f"unknown quantization {method!r}")
    return None


def quantize_layer(layer: dict, method: str) -> dict:
    """The projections of one layer's dict, or of the stacked layers' (any leading axes);
    norms and biases stay float."""
    fn = _weight_fn(method)
    if fn is None:
        return layer
    return {k: fn(v) if k in _QUANTIZED else v for k, v in layer.items()}


def quantize_head(params: dict, method: str) -> dict:
    """The output head ([in, out]) under `method`; a tied model's is the embedding table,
    transposed, and gets its own copy (the lookup keeps the float table). Layers untouched."""
    fn = _weight_fn(method)
    if fn is None:
        return params
    head = params["lm_head"] if "lm_head" in params else np.asarray(params["embed"]).T
    return {**params, "lm_head": fn(head)}


def quantize(params: dict, method: str) -> dict:
    """The loaders' params under EngineConfig.quantization: "none", "int8" (layer projections
    and the head; embeddings and norms stay float) or "bf16" (the same rounded to bfloat16)."""
    _weight_fn(method)  # an unknown method is an error before anything is read
    return quantize_head({**params, "layers": quantize_layer(params["layers"], method)}, method)
