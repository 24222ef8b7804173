"""Layer groups of the KV pool: which layers share a page table. Plain Python, no JAX.

Layers of one attention kind (full, or sliding with window W) form groups of `size` layers
each; every group has its own page table per sequence, and a sliding group releases the pages
before its window as the sequence grows (core/kv_manager.py). All groups draw page ids from
one free list (PagePool): the pool's arrays are `size` slots of N pages ([size, N, ...] in
effect, one array per slot), and page j given to group g holds, in slot s, the KV of group g's
s-th layer. So a page costs `size` layers' bytes whatever its group, and num_pages and the
memory plan keep one meaning: pages of the shared pool.

size is the fewest layers of any kind (Gemma 3 4B: 5 full, 29 sliding -> groups of 5: one
full, six sliding, the last of them with 4 layers and one slot unused); a model of one kind is
one group of all its layers, exactly the pool of one page table it always had. Full groups
come first, so group 0 is a full group wherever the model has one (the page table a draft
model and anything that needs every position reads).
"""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' window (None: full attention)
    layers: tuple[tuple[int, ...], ...]  # per group: its layers, slot s holding layers[g][s]
    size: int  # slots: layers per group (a page's layers)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @functools.cached_property
    def slot_of(self) -> tuple[tuple[int, int], ...]:
        """(group, slot) of each layer, by layer index."""
        where = {layer: (g, s) for g, group in enumerate(self.layers)
                 for s, layer in enumerate(group)}
        return tuple(where[i] for i in range(len(where)))

    def describe(self) -> str:
        kinds = ["full" if w is None else f"window {w}" for w in self.windows]
        return ", ".join(f"group {g} ({k}): layers {list(ls)}"
                         for g, (k, ls) in enumerate(zip(kinds, self.layers)))


@functools.lru_cache(maxsize=None)
def group_layers(layer_windows: tuple[int | None, ...]) -> KVGroups:
    """Groups of the layers whose windows are layer_windows (None: full attention)."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    by_kind = {k: tuple(i for i, w in enumerate(layer_windows) if w == k) for k in kinds}
    if len(kinds) == 1:
        return KVGroups((kinds[0],), (by_kind[kinds[0]],), len(layer_windows))
    size = min(len(ls) for ls in by_kind.values())
    windows, layers = [], []
    for k in kinds:
        ls = by_kind[k]
        for start in range(0, len(ls), size):
            windows.append(k)
            layers.append(ls[start:start + size])
    return KVGroups(tuple(windows), tuple(layers), size)


def groups_of(cfg) -> KVGroups:
    """The groups of a ModelConfig's layers."""
    return group_layers(tuple(cfg.layer_window(i) for i in range(cfg.num_layers)))
