"""Weights packed for the CPU backend's matmul, applied at load as a transformation of the
model's execution-layout params (as quantization is): every projection and the head become
PanelWeights, which the model multiplies through their own `matmul`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.backends.cpu import kernels

PROJECTIONS = ("w_qkv", "wo", "w_gate_up", "w_down")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["panels", "scale"],
                   meta_fields=["n"])
@dataclasses.dataclass(frozen=True)
class PanelWeight:
    """A weight [in, out=n] packed for the CPU matmul: panels [ceil(n / 48), in, 48], f32, or
    int8 with a per-output-channel scale f32[n] (None otherwise); or the bits of bfloat16 tiles
    u16[ceil(n / 16), in / 2, 16, 2] (kernels.pack_bf16_tiles) for the AMX matmul."""
    panels: jax.Array
    scale: jax.Array | None
    n: int

    def matmul(self, x):
        """x f[M, in] @ W -> f32[M, n]."""
        x = x.astype(jnp.float32)
        if self.panels.dtype == jnp.uint16:
            return kernels.matmul_bf16(x, self.panels, self.n)
        if self.scale is None:
            return kernels.matmul_f32(x, self.panels, self.n)
        return kernels.matmul_int8(x, self.panels, self.scale.astype(jnp.float32), self.n)

    def embed(self, token_ids):
        """Rows of a tied float embedding [V, H] stored as the head's panels: the table is kept
        once."""
        return self.panels[token_ids // kernels.PANEL, :, token_ids % kernels.PANEL]


def pack(w) -> PanelWeight:
    """An [out, in] weight (float, bfloat16 or int8 dict) -> a PanelWeight (host numpy
    arrays)."""
    if isinstance(w, dict):
        return PanelWeight(kernels.pack_panels(np.asarray(w["q_t"])),
                           np.asarray(w["scale"], np.float32), len(w["scale"]))
    if w.dtype == jnp.bfloat16:
        return PanelWeight(kernels.pack_bf16_tiles(w), None, w.shape[0])
    w = np.asarray(w, np.float32)
    return PanelWeight(kernels.pack_panels(w), None, w.shape[0])


def pack_params(params: dict) -> dict:
    """Every layer projection and the head packed; a tied float embedding becomes the head's
    panels (looked up by PanelWeight.embed)."""
    layers = [{k: pack(v) if k in PROJECTIONS else v for k, v in lp.items()}
              for lp in params["layers"]]
    out = {**params, "layers": layers}
    if "lm_head" in params:
        out["lm_head"] = pack(params["lm_head"])
    else:
        out["embed"] = pack(params["embed"])  # [V, H] is the tied head's [out, in]
    return out
