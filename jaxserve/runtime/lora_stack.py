"""LoRAStack: the LoRA adapters' device slots (model/lora.py's stack, per layer {module: (A, B)}
over max_loras + 1 slots, slot 0 the base's zeros), owned by the runner and passed to every step
as an argument of its own, beside the params. Placing an adapter in a slot is an in-place
update of that slot: it never compiles the step."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.config import ModelConfig
from jaxserve.model import lora as model_lora
from jaxserve.runtime import sharding


@functools.partial(jax.jit, donate_argnames=("stack",))
def _place(stack: list[dict], slot, layers: list[dict]) -> list[dict]:
    return model_lora.with_slot(stack, slot, layers)


@jax.tree_util.register_pytree_node_class
class LoRAStack:
    """The stack's arrays, replicated on the runner's devices; a pytree, so that the step reads
    the arrays the stack holds when it is called."""

    def __init__(self, stack: list[dict]):
        self.stack = stack

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_slots: int, rank: int, dtype, mesh: Mesh) -> LoRAStack:
        """Empty slots, on the mesh's devices as their projections are sharded (one slot's
        arrays alike, without the slot axis); the placing compiled once here rather than at
        the first adapter's request."""
        make = functools.partial(model_lora.zeros, cfg, num_slots, rank, dtype)
        specs = sharding.lora_specs(jax.eval_shape(make))
        self = cls(jax.jit(make, out_shardings=_named(mesh, specs))())
        self._slot_shardings = _named(mesh, jax.tree_util.tree_map(
            lambda p: PartitionSpec(*p[1:]), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)))
        self.place(0, jax.tree_util.tree_map(lambda x: np.zeros(x.shape[1:], np.float32),
                                             self.stack))
        return self

    def place(self, slot: int, layers: list[dict]) -> None:
        """An adapter's weights (weights/lora.py's LoRAWeights.layers) into slot `slot`. A
        step dispatched before still reads the slot's previous adapter (the arrays it was
        given; the update waits for it)."""
        layers = jax.device_put(layers, self._slot_shardings)
        self.stack = _place(self.stack, np.int32(slot), layers)

    def tree_flatten(self):
        return (self.stack,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def _named(mesh: Mesh, specs):
    return jax.tree_util.tree_map(lambda p: NamedSharding(mesh, p), specs,
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))


def step_args(lora: LoRAStack | None, slots) -> dict:
    """The model's keyword arguments for a step's adapters (none without a stack): its
    Adapters over the batch's per-token slots i32[T]."""
    return {} if lora is None else {"lora": model_lora.Adapters(lora.stack, slots)}
