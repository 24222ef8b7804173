"""Block sizes (tuning knobs) for the TPU attention kernels, kept apart from the numerics.

Block sizes change memory traffic and parallelism, never the result beyond floating-point
evaluation order. Frozen, keyword-only and validated on construction; hashable, so a jit can take
them as a static argument.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuBlockSizes:
    """pages_per_block: KV pages per online-softmax step in both paths (a key block of
    pages_per_block * B keys; two such blocks per K and V live in VMEM for double buffering),
    clamped to the page-table width P at call time. block_q: flat query tokens per program of the
    ragged path (a block may span several rows; T is padded up to a multiple of it)."""

    block_q: int = 32
    pages_per_block: int = 4

    def __post_init__(self):
        for name in ("block_q", "pages_per_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TpuBlockSizes.{name} must be a positive int, got {value!r}")
