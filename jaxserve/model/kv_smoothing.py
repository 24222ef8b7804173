"""Keys made friendlier to int8 KV pages, folded into the weights at load: q.k is unchanged, so
the float model computes the same attention, while the per-token, per-head int8 scale of a key
(kv_cache.quantize_kv) is no longer set by a few outlier channels.

Rope rotates channel i with channel i + D/2 (rope.py's half-split pairs) by a position's angle,
a complex multiplication of z = k_i + 1j * k_{i+D/2}. Only a complex scalar per pair commutes
with it, so that is all a fold may apply: the key pair is multiplied by exp(1j * phi) / s and
every query head of its KV head's group by exp(1j * phi) * s (a rotation keeps q.k, the scales
cancel). A low-frequency pair barely turns, so its keys stay near one direction: phi turns that
direction to 45 degrees, sharing its magnitude between the two int8 channels; s divides each
pair by the square root of its typical size (SmoothQuant's alpha 1/2), so no pair sets the scale
for the rest. Both come from the weights alone (no calibration pass): a layer's normalised input
is taken as white, so a pair's second moments are those of its W_k columns (times attn_norm)
plus its bias. With q/k norms (RMSNorm of each head before rope) only a per-channel scale fits:
it goes into the norm weights, shared by the heads, with no rotation.

Values need nothing: their int8 error costs a sixteenth of the keys' (docs/memory.md)."""

from __future__ import annotations

import numpy as np

from jaxserve.config import ModelConfig

ALPHA = 0.5  # s = (typical pair size) ** ALPHA: 1/2 measured best of 1/4, 1/2, 3/4 and 1


def _halves(w: np.ndarray, heads: int, d: int):
    """w f[..., heads * D] -> its rope pairs' two channels, each f[..., heads, D / 2]."""
    w = w.reshape(*w.shape[:-1], heads, d)
    return w[..., :d // 2], w[..., d // 2:]


def _turn(w: np.ndarray, heads: int, d: int, phi: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Each rope pair of w f[..., heads * D] multiplied by exp(1j * phi) * s (phi, s broadcast
    to [..., heads, D / 2] from the right)."""
    x, y = _halves(np.asarray(w, np.float64), heads, d)
    c, sn = np.cos(phi) * s, np.sin(phi) * s
    out = np.concatenate([c * x - sn * y, sn * x + c * y], axis=-1)
    return out.reshape(np.shape(w)).astype(np.asarray(w).dtype)


def key_transform(layer: dict, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """(phi, s) f64[..., Hkv, D / 2] of one layer (or stacked layers: any leading axes) of the
    loaders' layout: the turn that gives each key pair equal second moments in its two channels,
    and the pair's scale."""
    d, hkv = cfg.head_dim, cfg.num_kv_heads
    norm = cfg.norm_weight_offset + np.asarray(layer["attn_norm"], np.float64)
    wk = np.asarray(layer["wk"], np.float64) * norm[..., None]
    wx, wy = _halves(wk, hkv, d)  # [..., H, Hkv, D/2]: columns of each pair
    a, b, c = ((u * v).sum(axis=-3) for u, v in ((wx, wx), (wy, wy), (wx, wy)))
    if "bk" in layer:
        bx, by = _halves(np.asarray(layer["bk"], np.float64), hkv, d)
        a, b, c = a + bx * bx, b + by * by, c + bx * by
    phi = 0.5 * np.arctan2(a - b, 2 * c)  # after the turn: a' == b'
    size = np.sqrt(a + b)
    s = size / np.exp(np.mean(np.log(np.maximum(size, 1e-30)), axis=-1, keepdims=True))
    return phi, np.maximum(s, 1e-6) ** ALPHA


def _norm_scale(layer: dict, cfg: ModelConfig) -> np.ndarray:
    """qk_norm: s f64[..., D] per channel (pairs equal), shared by every head: each channel's
    typical key size after the norm, its weight times its W_k columns' share of the head."""
    d, hkv = cfg.head_dim, cfg.num_kv_heads
    wk = np.asarray(layer["wk"], np.float64)
    col = np.sqrt((wk * wk).sum(axis=-2)).reshape(*wk.shape[:-2], hkv, d)
    col = col / np.sqrt(np.mean(col * col, axis=-1, keepdims=True))
    size = np.abs(cfg.norm_weight_offset + np.asarray(layer["k_norm"], np.float64))
    size = size * col.mean(axis=-2)
    pair = np.sqrt(size[..., :d // 2] ** 2 + size[..., d // 2:] ** 2)
    s = pair / np.exp(np.mean(np.log(np.maximum(pair, 1e-30)), axis=-1, keepdims=True))
    s = np.maximum(s, 1e-6) ** ALPHA
    return np.concatenate([s, s], axis=-1)


def smooth_layer(layer: dict, cfg: ModelConfig) -> dict:
    """One layer (or the stacked layers) of the loaders' layout, float weights [in, out], with
    its keys turned and scaled per rope pair and its queries the inverse way (q.k unchanged)."""
    out = dict(layer)
    if cfg.qk_norm:
        s, offset = _norm_scale(layer, cfg), cfg.norm_weight_offset
        for name, m in (("q_norm", s), ("k_norm", 1 / s)):
            w = np.asarray(layer[name])
            out[name] = ((offset + w.astype(np.float64)) * m - offset).astype(w.dtype)
        return out
    phi, s = key_transform(layer, cfg)
    group = cfg.num_heads // cfg.num_kv_heads
    q_phi, q_s = (np.repeat(x, group, axis=-2) for x in (phi, s))  # query heads of each group
    for name, heads, p, m in (("wk", cfg.num_kv_heads, phi[..., None, :, :], 1 / s[..., None, :, :]),
                              ("wq", cfg.num_heads, q_phi[..., None, :, :], q_s[..., None, :, :]),
                              ("bk", cfg.num_kv_heads, phi, 1 / s),
                              ("bq", cfg.num_heads, q_phi, q_s)):
        if name in layer:
            out[name] = _turn(layer[name], heads, cfg.head_dim, p, m)
    return out


def smooth_keys(params: dict, cfg: ModelConfig) -> dict:
    """The loaders' params (layers stacked, in memory) with every layer smoothed."""
    layers = {k: np.asarray(v) for k, v in params["layers"].items()}
    return {**params, "layers": smooth_layer(layers, cfg)}
