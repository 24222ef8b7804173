"""A stacked weight of the loaders' layout ([L, ...], weights/__init__.py) that reads one layer
at a time from the checkpoint: what `load_model(lazy=True)` gives for GGUF and safetensors, so
that the runner, which places the model layer by layer, never holds all of it on the host.
Anything that needs the whole array gets it from np.asarray. A weight only some layers have
(a mixture of experts' experts, or its dense MLP among sparse layers) is a LayerStack that
reads None at the others, held in memory where the load is not lazy."""

from __future__ import annotations

from typing import Callable

import numpy as np


class LayerStack:
    def __init__(self, layers: list[Callable[[], np.ndarray] | None], shape: tuple[int, ...],
                 dtype):
        """layers[i]() reads layer i (shape[1:], in dtype); None: layer i lacks this weight."""
        self._layers, self.shape, self.dtype = layers, tuple(shape), np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        present = sum(read is not None for read in self._layers)
        return present * int(np.prod(self.shape[1:])) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i) -> np.ndarray:
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"a LayerStack reads one layer at a time (x[i]), not x[{i!r}]")
        read = self._layers[i]
        return None if read is None else read()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if None in self._layers:
            raise ValueError("this weight exists in some layers only (a mixture of experts with "
                             "dense layers): it is read layer by layer, never as one array")
        out = np.empty(self.shape, dtype or self.dtype)
        for i in range(len(self)):
            out[i] = self[i]
        return out
