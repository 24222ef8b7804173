"""LoRA deltas inside the model's projections, for a batch whose tokens run under different
adapters (weights/lora.py reads them; core/lora.py assigns their slots).

The adapters of one projection are stacked over slots: A f[S, R, in] and B f[S, R, out] (B^T,
already scaled), S = max_loras + 1 slots with slot 0 all zeros (the base model), every adapter
zero-padded to R = max_lora_rank. A token t of slot s adds x_t @ A[s]^T @ B[s]. The stack is
an argument of the step beside the params (`Adapters`), so placing an adapter in a slot is an
update of that slot (`with_slot`), never a compilation.

A step of more tokens than slots computes the delta for every slot and each token keeps its
own: (x @ A_flat^T) masked to the token's slot's R columns, then @ B_flat, two dense matmuls
over S*R columns, reading the stack once. A smaller one (decode of a few streams) gathers each
token's A[s] and B[s]: T*R*(in + out) weights, fewer than the stack's S*R*(in + out) there and
far more for a prefill chunk of a few hundred tokens (docs/lora.md has both measured).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.weights.lora import LORA_MODULES, module_shapes

# Our fused projections (model/llama.py) and the PEFT modules whose deltas they concatenate.
FUSED = {"w_qkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",),
         "w_gate_up": ("gate_proj", "up_proj"), "w_down": ("down_proj",)}


def delta(x, a, b, slots):
    """x f[T, in], a f[S, R, in], b f[S, R, out], slots i32[T] -> f[T, out]: each token's
    x @ A[slot]^T @ B[slot] (slot 0's zeros: none). A step of no more tokens than slots
    gathers its tokens' adapters; a larger one computes every slot's and masks."""
    s, r, _ = a.shape
    if x.shape[0] <= s:  # static: each shape compiles one way
        return jnp.einsum("tr,tro->to", jnp.einsum("ti,tri->tr", x, a[slots]), b[slots])
    shrunk = (x @ a.reshape(s * r, -1).T).reshape(-1, s, r)
    mine = (slots[:, None] == jnp.arange(s, dtype=slots.dtype)).astype(shrunk.dtype)
    return (shrunk * mine[:, :, None]).reshape(-1, s * r) @ b.reshape(s * r, -1)


class LayerAdapters:
    """One layer's adapter stacks and the step's per-token slots: what a projection adds."""

    def __init__(self, weights: dict, slots):
        self.weights, self.slots = weights, slots  # {module: (A, B)}, i32[T]

    def __call__(self, projection: str, x):
        """The delta of fused projection `projection` (FUSED) for inputs x f[T, in]."""
        parts = [delta(x, *self.weights[m], self.slots) for m in FUSED[projection]]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


class Adapters:
    """The step's adapters: per layer {module: (A, B)} stacks and slots i32[T] per token."""

    def __init__(self, stack: list[dict], slots):
        self.stack, self.slots = stack, slots

    def layer(self, i: int) -> LayerAdapters:
        return LayerAdapters(self.stack[i], self.slots)


def zeros(cfg: ModelConfig, num_slots: int, rank: int, dtype) -> list[dict]:
    """An empty stack: per layer {module: (A f[S, R, in], B f[S, R, out])} of zeros."""
    shapes = module_shapes(cfg)
    return [{m: (jnp.zeros((num_slots, rank, shapes[m][0]), dtype),
                 jnp.zeros((num_slots, rank, shapes[m][1]), dtype)) for m in LORA_MODULES}
            for _ in range(cfg.num_layers)]


def with_slot(stack: list[dict], slot, layers: list[dict]) -> list[dict]:
    """The stack with slot `slot` (a traced i32) replaced by one adapter's layers (each
    {module: (A f[R, in], B f[R, out])}, weights/lora.py's LoRAWeights.layers)."""
    return jax.tree_util.tree_map(lambda s, new: s.at[slot].set(new.astype(s.dtype)),
                                  stack, layers)

