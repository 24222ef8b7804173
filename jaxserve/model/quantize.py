"""Weight-only int8 quantization with a scale and an offset per group of 32 input channels of each
output channel (Int8Weight, which multiplies itself), applied to a clean float params tree; and
bfloat16 rounding of the same weights for the CPU backend's AMX matmul.

Groups are GGUF's 32-element blocks; scales and offsets are float16 (4 bytes a group, 1/8 of its
int8 weights: a decode step streams the weights, so every byte counts). A group that is a GGUF
block keeps the block's own float16 d and m and its levels: Q4_1 (d * q + m, q in 0..15, its min
at q = 0 and its max at q = 15 by construction) and Q8_0 (d * q, q in -127..127, its absmax at
|q| = 127) are stored exactly, so the default model (Q4_1 layers, a Q8_0 head) is served without
loss. Any other group maps its [min, max] onto 256 levels against the float16-rounded offset and
scale (rounded up, so the levels cover the range): every weight stays within half a step.

Weights are stored transposed, i8[..., out, in]: XLA's CPU backend converts an [out, in] int8
weight inside `x @ w.T` faster than an [in, out] one (docs/performance-history.md)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

# The layer weights quantized: the projections, and a mixture of experts' experts ([E, in, out];
# the router stays float: it is small, and its logits choose the experts).
_QUANTIZED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "experts_gate", "experts_up",
              "experts_down")
GROUP = 32  # input channels per scale and offset: GGUF's block size


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q_t", "scale", "offset"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """W[in, out] as q_t i8[..., out, in], scale and offset f16[..., out, in / 32] (f32 once
    widened for XLA's CPU backend):
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
        return x @ self.dequantize_in(x.dtype)

    def dequantize(self) -> np.ndarray:
        """f32[..., out, in] (the stored, transposed layout)."""
        q = np.asarray(self.q_t, np.float32)
        g = q.reshape(*q.shape[:-1], -1, GROUP)
        scale, offset = (np.asarray(a, np.float32)[..., None] for a in (self.scale, self.offset))
        return (g * scale + offset).reshape(q.shape)

    def take(self, index):
        """Entries `index` of the leading axis (experts) of a stacked weight, as an Int8Weight."""
        return Int8Weight(self.q_t[index], self.scale[index], self.offset[index])

    def dequantize_in(self, dtype):
        """f[..., in, out] in dtype, in a traced function (the [in, out] layout, as float
        experts are)."""
        *lead, out, inp = self.q_t.shape
        g = self.q_t.reshape(*lead, out, inp // GROUP, GROUP).astype(dtype)
        g = g * self.scale[..., None].astype(dtype) + self.offset[..., None].astype(dtype)
        return jnp.swapaxes(g.reshape(*lead, out, inp), -1, -2)

    @staticmethod
    def concat(ws: list[Int8Weight]) -> Int8Weight:
        """Weights [..., out_i, in] concatenated along the output axis (fused projections, a
        mixture's gate and up experts)."""
        return Int8Weight(*(np.concatenate([getattr(w, f) for w in ws], axis=-2)
                            for f in ("q_t", "scale", "offset")))


def widen_factors(params: dict) -> dict:
    """Every Int8Weight's scales and offsets as float32 (exact: they are float16 values), for a
    matmul that reads f32 faster than it converts f16."""
    def widen(w):
        if not isinstance(w, Int8Weight):
            return w
        return Int8Weight(w.q_t, *(np.asarray(a, np.float32) for a in (w.scale, w.offset)))
    return jax.tree_util.tree_map(widen, params, is_leaf=lambda w: isinstance(w, Int8Weight))


def _f16(x: np.ndarray) -> np.ndarray:
    """x rounded to float16, as float32."""
    return x.astype(np.float16).astype(np.float32)


def _gguf_block(g: np.ndarray, d: np.ndarray, m: np.ndarray, q_min: int, q_max: int):
    """Groups g [n, 32] as GGUF blocks d * q + m (float32 product, then sum, as GGUF
    dequantizes) for float16 d, m and integers q in q_min..q_max: (d, m, q), with d NaN for a
    group that is not exactly such a block."""
    q = np.clip(np.rint((g - m[..., None]) / np.where(d == 0, 1, d)[..., None]), q_min, q_max)
    exact = np.all(d[..., None] * q + m[..., None] == g, axis=-1)
    exact &= (_f16(d) == d) & (_f16(m) == m)
    return np.where(exact, d, np.nan), m, q


def quantize_weight(w: np.ndarray) -> Int8Weight:
    """w f[..., in, out] -> its Int8Weight: a group that is a Q4_1 or Q8_0 block is kept
    exactly; any other maps its [min, max] onto 256 levels, every weight within half a step
    (scale / 2, the scale within float16 rounding of (max - min) / 255)."""
    w = np.asarray(w, np.float32)
    if w.shape[-2] % GROUP:
        raise ValueError(f"int8 quantization groups {GROUP} input channels; "
                         f"{w.shape[-2]} is not a multiple of {GROUP}")
    if not np.all(np.abs(w) <= 60000):
        raise ValueError("int8 quantization stores float16 scales and offsets: weights must be "
                         "finite and within +-60000")
    wt = np.swapaxes(w, -1, -2)
    flat = wt.reshape(-1, GROUP)  # every group of 32, in [..., out, groups] order
    q = np.empty(flat.shape, np.int8)
    scale, offset = np.empty(len(flat), np.float16), np.empty(len(flat), np.float16)
    rest = np.arange(len(flat))  # the groups not yet quantized: each pass takes only these
    for kind in ("Q4_1", "Q8_0", "256 levels"):
        g = flat[rest]
        lo, hi = g.min(axis=-1), g.max(axis=-1)
        if kind == "Q4_1":
            d, m, qg = _gguf_block(g, _f16((hi - lo) / 15.0), lo, 0, 15)
        elif kind == "Q8_0":
            d, m, qg = _gguf_block(g, _f16(np.maximum(hi, -lo) / 127.0), np.zeros_like(lo),
                                   -127, 127)
        else:
            d, m, qg = _levels(g, lo, hi)
        taken = ~np.isnan(d)
        q[rest[taken]], scale[rest[taken]], offset[rest[taken]] = qg[taken], d[taken], m[taken]
        rest = rest[~taken]
    groups = (*wt.shape[:-1], wt.shape[-1] // GROUP)
    return Int8Weight(q.reshape(wt.shape), scale.reshape(groups), offset.reshape(groups))


def _levels(g: np.ndarray, lo: np.ndarray, hi: np.ndarray):
    """Groups g [n, 32] mapped onto 256 levels: the offset (level 0) rounded to float16 first,
    then the smallest float16 scale whose levels -128..127 around it reach both lo and hi.
    Returns (scale, offset, q)."""
    offset = _f16(lo + 128.0 * ((hi - lo) / 255.0))
    need = np.maximum((offset - lo) / 128.0, (hi - offset) / 127.0)
    scale = need.astype(np.float16)
    scale = np.where(scale.astype(np.float32) < need, np.nextafter(scale, np.float16(np.inf)),
                     scale).astype(np.float32)
    step = np.where(scale == 0, 1.0, scale)[..., None]  # a constant float16 group: every q is 0
    return scale, offset, np.clip(np.rint((g - offset[..., None]) / step), -128, 127)


def _weight_fn(method: str):
    """The map of one [..., in, out] weight under LoadConfig.quantization (None: kept)."""
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
    """The projections and experts of one layer's dict, or of the stacked layers' (any leading
    axes); norms, biases and routers stay float."""
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
    """The loaders' params under LoadConfig.quantization: "none", "int8" (layer projections
    and the head; embeddings and norms stay float) or "bf16" (the same rounded to bfloat16)."""
    _weight_fn(method)  # an unknown method is an error before anything is read
    return quantize_head({**params, "layers": quantize_layer(params["layers"], method)}, method)
