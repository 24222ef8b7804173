"""Rotary position embeddings in Hugging Face's half-split convention, with the scalings that
stretch a model past its pretrained context (RopeScaling): "linear" (positions divided by the
factor), "llama3" (low frequencies divided by the factor, high ones kept, a smooth blend
between) and "yarn" (a ramp between interpolated and extrapolated frequencies over the head
dimensions, and cos/sin scaled by an attention factor), and GGUF's per-pair divisors
("freq_factors"). Scaled frequencies are computed once, on
the host in float64, as the model's constants."""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from jaxserve.config import RopeScaling


@functools.lru_cache(maxsize=None)
def scaled_inv_frequencies(head_dim: int, theta: float,
                           scaling: RopeScaling) -> tuple[tuple[float, ...], float]:
    """(inverse frequency of each of the head_dim / 2 rotated pairs, factor on cos and sin)
    under a scaling (plain rope: rope_tables computes it on the device)."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = scaling.factor
    if scaling.rope_type == "freq_factors":
        if len(scaling.freq_factors) != len(inv):
            raise ValueError(f"{len(scaling.freq_factors)} rope frequency factors for "
                             f"{len(inv)} rotated pairs")
        return tuple(inv / np.asarray(scaling.freq_factors, np.float64)), 1.0
    if scaling.rope_type == "linear":
        return tuple(inv / factor), 1.0
    if scaling.rope_type == "llama3":
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return tuple(np.where(medium, blended, scaled)), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(inv, head_dim, theta, scaling)
    raise ValueError(f"rope scaling {scaling.rope_type!r} is not supported")


def _yarn(inv, head_dim: int, theta: float, s: RopeScaling):
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        attention = (mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
                     if s.mscale and s.mscale_all_dim else mscale(s.factor))

    def correction_dim(rotations):  # the dimension that turns `rotations` times in the context
        return (head_dim * math.log(s.original_max_position_embeddings
                                    / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp  # 1: keep the pretrained frequency; 0: divide it by the factor
    return tuple(inv / s.factor * (1 - extrapolated) + inv * extrapolated), float(attention)


def rope_tables(positions, head_dim: int, theta: float, scaling: RopeScaling | None = None):
    """cos, sin f32[T, D] for these positions."""
    if scaling is None:  # in float32 on the device, as Hugging Face computes it
        inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
        attention = 1.0
    else:
        inv, attention = scaled_inv_frequencies(head_dim, theta, scaling)
        inv = jnp.asarray(inv, jnp.float32)
    freqs = positions.astype(jnp.float32)[:, None] * inv[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * attention, jnp.sin(emb) * attention


def apply_rope(x, cos, sin):
    """x f[T, H, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    xf = x.astype(jnp.float32)
    return (xf * cos[:, None, :] + rotated.astype(jnp.float32) * sin[:, None, :]).astype(x.dtype)
