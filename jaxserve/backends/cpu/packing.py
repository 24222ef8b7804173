"""Weights packed for the CPU backend's matmul, applied at load as a transformation of the
model's execution-layout params (as quantization is): every projection and the head become
PanelWeights, which the model multiplies through their own `matmul`, and a mixture of experts'
experts (float, int8 or bf16) PanelExperts, which model/moe.py multiplies through their
`grouped_matmul`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.backends.cpu import kernels
from jaxserve.model.quantize import Int8Weight

PROJECTIONS = ("w_qkv", "wo", "w_gate_up", "w_down")
EXPERTS = ("experts_gate_up", "experts_down")  # [E, in, out] (model/moe.py)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["panels", "scale", "offset"], meta_fields=["n"])
@dataclasses.dataclass(frozen=True)
class PanelWeight:
    """A weight [in, out=n] packed for the CPU matmul: panels [ceil(n / 48), in, 48], f32, or
    int8 with a scale and an offset per 32 inputs of each column, packed the same way
    f16[ceil(n / 48), in / 32, 48] (None otherwise), or with those the int8 levels of a weight
    that are all 0..15 (GGUF Q4_1 blocks) two a byte, u8[ceil(n / 48), in / 2, 48]; or the bits of bfloat16 tiles
    u16[ceil(n / 16), in / 2, 16, 2] (kernels.pack_bf16_tiles) for the AMX matmul."""
    panels: jax.Array
    scale: jax.Array | None
    offset: jax.Array | None
    n: int

    def matmul(self, x):
        """x f[M, in] @ W -> f32[M, n]."""
        x = x.astype(jnp.float32)
        if self.panels.dtype == jnp.uint16:
            return kernels.matmul_bf16(x, self.panels, self.n)
        if self.scale is None:
            return kernels.matmul_f32(x, self.panels, self.n)
        int4 = self.panels.dtype == jnp.uint8
        matmul = kernels.matmul_int4 if int4 else kernels.matmul_int8
        return matmul(x, self.panels, self.scale, self.offset, self.n)

    def embed(self, token_ids):
        """Rows of a tied float embedding [V, H] stored as the head's panels: the table is kept
        once."""
        return self.panels[token_ids // kernels.PANEL, :, token_ids % kernels.PANEL]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["panels", "scale", "offset"], meta_fields=["shape"])
@dataclasses.dataclass(frozen=True)
class PanelExperts:
    """A mixture of experts' stacked weights [E, in, out] (shape), each expert packed as a
    PanelWeight is: f32 panels [E, ceil(out / 48), in, 48], or int8 levels (4-bit ones two a
    byte) with their scales and offsets, or bfloat16 AMX tiles [E, ceil(out / 16), in / 2, 16,
    2], stacked."""
    panels: jax.Array
    scale: jax.Array | None
    offset: jax.Array | None
    shape: tuple

    def grouped_matmul(self, x, group_sizes):
        """x f[M, in], rows in groups (group e: the next group_sizes[e] rows, rows past the
        last group give 0) -> each group's rows @ expert e's weight, f32[M, out]. Reads only
        the experts that have rows, in place (kernels.expert_matmul_*)."""
        x, n = x.astype(jnp.float32), self.shape[2]
        if self.panels.dtype == jnp.uint16:
            return kernels.expert_matmul_bf16(x, self.panels, group_sizes, n)
        if self.scale is None:
            return kernels.expert_matmul_f32(x, self.panels, group_sizes, n)
        return kernels.expert_matmul_int8(x, self.panels, self.scale, self.offset, group_sizes, n)


def pack_experts(w) -> PanelExperts:
    """Stacked experts [E, in, out], float, bfloat16 (quantization='bf16': AMX tiles) or
    Int8Weight -> PanelExperts, each expert packed as `pack` packs a weight."""
    if isinstance(w, Int8Weight):
        experts = [pack(w.take(e)) for e in range(w.shape[0])]
        shape = (w.shape[0], w.shape[2], w.shape[1])
    else:
        experts = [pack(np.swapaxes(e, 0, 1)) for e in w]  # [out, in] each, dtype kept
        shape = w.shape
    if len({e.panels.dtype for e in experts}) > 1:  # some experts' levels 0..15, some not
        experts = [pack(w.take(e), nibbles=False) for e in range(w.shape[0])]
    stack = lambda field: (None if getattr(experts[0], field) is None  # noqa: E731
                           else np.stack([getattr(e, field) for e in experts]))
    return PanelExperts(stack("panels"), stack("scale"), stack("offset"), tuple(shape))


def pack(w, nibbles: bool = True) -> PanelWeight:
    """An [out, in] weight (float, bfloat16 or Int8Weight) -> a PanelWeight (host numpy
    arrays). An Int8Weight whose levels are all 0..15 (every group a Q4_1 block) is packed two
    levels a byte (unless nibbles=False): a decode step streams the weights, and there it is
    half int8's bytes."""
    if isinstance(w, Int8Weight):
        q, scale, offset = (kernels.pack_panels(np.asarray(a)) for a in (w.q_t, w.scale, w.offset))
        if nibbles and q.min(initial=0) >= 0 and q.max(initial=0) <= 15:
            q = kernels.pack_nibbles(q)
        return PanelWeight(q, scale, offset, len(w.q_t))
    if w.dtype == jnp.bfloat16:
        return PanelWeight(kernels.pack_bf16_tiles(w), None, None, w.shape[0])
    w = np.asarray(w, np.float32)
    return PanelWeight(kernels.pack_panels(w), None, None, w.shape[0])


def pack_params(params: dict) -> dict:
    """Every layer projection, a mixture's experts and the head packed; a tied float embedding
    becomes the head's panels (looked up by PanelWeight.embed). Parts of a tree pack alike (the
    runner packs the layers one at a time): a tree without a head or embedding packs its layers
    only."""
    layers = [{k: pack(v) if k in PROJECTIONS else pack_experts(v) if k in EXPERTS else v
               for k, v in lp.items()} for lp in params["layers"]]
    out = {**params, "layers": layers}
    if "lm_head" in params:
        out["lm_head"] = pack(params["lm_head"])
    elif "embed" in params:
        out["embed"] = pack(params["embed"])  # [V, H] is the tied head's [out, in]
    return out
