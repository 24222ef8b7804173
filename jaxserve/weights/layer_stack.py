"""A stacked weight of the loaders' layout ([L, ...], weights/__init__.py) that reads one layer
at a time from the checkpoint: what `load_model(lazy=True)` gives for GGUF and safetensors, so
that the runner, which places the model layer by layer, never holds all of it on the host.
Anything that needs the whole array gets it from np.asarray."""

from __future__ import annotations

from typing import Callable

import numpy as np


class LayerStack:
    def __init__(self, layers: list[Callable[[], np.ndarray]], shape: tuple[int, ...], dtype):
        """layers[i]() reads layer i (shape[1:], in dtype)."""
        self._layers, self.shape, self.dtype = layers, tuple(shape), np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i) -> np.ndarray:
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"a LayerStack reads one layer at a time (x[i]), not x[{i!r}]")
        return self._layers[i]()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.empty(self.shape, dtype or self.dtype)
        for i in range(len(self)):
            out[i] = self[i]
        return out
